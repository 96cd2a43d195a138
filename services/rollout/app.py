"""The rollout service: a worker loop plus ``/health`` and ``/metrics``.

pbsd serve rollout        (settings from PBSD_ROLLOUT_* and REDIS_URL)
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI

from agent.chat import ChatTokenizer
from services.rollout.engine import Engine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.sglang_control import Guard, shared_guard, unguarded
from services.telemetry import setup_logging
from services.tools.client import GatewayClient
from services.weights.receiver import WeightReceiver, add_weight_routes
from services.worker_app import worker_app


def build_engine(settings: RolloutSettings, guard: Guard = unguarded) -> Engine:
    """``guard``: held while a server is checked and loaded (replicas share servers)."""
    if settings.engine == "sglang":
        from services.rollout.sglang import SglangEngine

        config = json.loads((Path(settings.model) / "config.json").read_text())
        return SglangEngine(
            settings.sglang_urls,
            layers=config.get("num_hidden_layers"),
            top_k=config.get("num_experts_per_tok"),
            guard=guard,
        )
    from services.model.checkpoint import load_model
    from services.rollout.inprocess import InProcessEngine

    return InProcessEngine(load_model(settings.model, dtype=settings.dtype, device=settings.device))


def create_app(settings: RolloutSettings | None = None) -> FastAPI:
    settings = settings or RolloutSettings()

    async def start():
        setup_logging(settings.log_level)
        bus = settings.bus()
        engine = build_engine(settings, shared_guard(bus.exclusive))
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
            options=settings.consumer_options(),
            keep_every_s=settings.keep_every_s,
            keep_growth=settings.keep_growth,
        )
        return worker, [tools.aclose, engine.aclose, bus.close]

    async def healthy(worker: RolloutWorker) -> bool:
        return await worker.engine.health()

    app = worker_app("pbsd rollout", start, healthy, grace_s=settings.shutdown_grace_s)
    if settings.accept_broadcast:
        add_weight_routes(app, WeightReceiver(lambda: app.state.worker.engine))
    return app
