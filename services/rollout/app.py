"""The rollout service: a worker loop plus ``/health`` and ``/metrics``.

pbsd serve rollout        (settings from PBSD_ROLLOUT_* and REDIS_URL)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from fastapi import FastAPI, Response

from agent.chat import ChatTokenizer
from services.bus import Bus, ConsumerOptions
from services.rollout.engine import Engine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.telemetry import add_metrics_route, setup_logging
from services.tools.client import GatewayClient

log = logging.getLogger(__name__)


def build_engine(settings: RolloutSettings) -> Engine:
    if settings.engine == "sglang":
        from services.rollout.sglang import SglangEngine

        config = json.loads((Path(settings.model) / "config.json").read_text())
        return SglangEngine(
            settings.sglang_urls,
            layers=config.get("num_hidden_layers"),
            top_k=config.get("num_experts_per_tok"),
        )
    from services.model.checkpoint import load_model
    from services.rollout.inprocess import InProcessEngine

    return InProcessEngine(load_model(settings.model, dtype=settings.dtype, device=settings.device))


def create_app(settings: RolloutSettings | None = None) -> FastAPI:
    settings = settings or RolloutSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        setup_logging(settings.log_level)
        bus = Bus.from_url(settings.redis_url, prefix=settings.stream_prefix)
        engine = build_engine(settings)
        tools = GatewayClient(settings.tools_url)
        worker = RolloutWorker(
            bus,
            engine,
            tools,
            ChatTokenizer.from_pretrained(settings.model),
            name=settings.worker_name,
            concurrency=settings.concurrency,
            date=settings.date,
            seed=settings.seed,
            options=ConsumerOptions(claim_idle_ms=settings.claim_idle_ms),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        app.state.worker, app.state.task, app.state.engine = worker, task, engine
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, 30)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            await tools.aclose()
            await engine.aclose()
            await bus.close()

    app = FastAPI(title="pbsd rollout", version="0.1.0", lifespan=lifespan)
    add_metrics_route(app)

    @app.get("/health")
    async def health(response: Response) -> dict:
        worker, task = app.state.worker, app.state.task
        if task.done():
            response.status_code = 503
            exc = task.exception() if not task.cancelled() else None
            return {"status": "stopped", "error": repr(exc) if exc else None}
        if not worker.ready.is_set() or not await app.state.engine.health():
            response.status_code = 503
            return {"status": "starting"}
        return {"status": "ok", "policy_version": app.state.engine.weight_version}

    return app
