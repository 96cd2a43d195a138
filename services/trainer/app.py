"""The trainer service: the REST API for runs and the run executor in one process.

pbsd serve trainer        (settings from PBSD_TRAINER_* and REDIS_URL)
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from services.bus import REDIS_DOWN, Bus, redis_client
from services.bus.lag import StreamLagMonitor
from services.gc_freeze import frozen_while_serving
from services.http_guard import BodyLimit, install_validation_handler
from services.tasks import main_task, stopped
from services.telemetry import add_metrics_route, setup_logging
from services.trainer.api import AuthenticateFirst, ViewerPages, router
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings


def create_app(settings: TrainerSettings | None = None) -> FastAPI:
    settings = settings or TrainerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        setup_logging(
            settings.log_level, [settings.api_token.get_secret_value()] if settings.api_token else []
        )
        # the executor's commands wait out an outage; the API's answer 503 after a short one
        client = redis_client(settings.redis_url, patience_s=settings.redis_patience_s)
        api_client = redis_client(settings.redis_url, patience_s=min(2.0, settings.redis_patience_s))
        bus = Bus(client, prefix=settings.stream_prefix, max_message_bytes=settings.bus_max_message_bytes)
        executor = RunExecutor(
            bus, RunStore(client, settings.stream_prefix), settings, save_groups=settings.save_groups
        )
        store = RunStore(api_client, settings.stream_prefix)
        stop = asyncio.Event()
        task = main_task(executor.serve(stop), "the trainer's run executor")
        # the trainer is the single replica, so the stream lag series are exported exactly once
        lag = StreamLagMonitor(client, settings.stream_prefix, interval_s=settings.lag_interval_s)
        lag_task = asyncio.create_task(lag.run(stop))
        app.state.settings, app.state.store, app.state.executor, app.state.task = (
            settings,
            store,
            executor,
            task,
        )
        app.state.viewer_pages = ViewerPages()
        try:
            with frozen_while_serving("the trainer"):
                yield
        finally:
            stop.set()
            # the run in progress finishes its step and checkpoints (the orchestrator's grace
            # period must be longer: deploy/ gives 10 minutes)
            done, _ = await asyncio.wait({task}, timeout=settings.shutdown_grace_s)
            if not done:
                task.cancel()
            lag_task.cancel()
            await asyncio.wait({task, lag_task}, timeout=30)  # bounded: the process is leaving
            await client.aclose()
            await api_client.aclose()

    app = FastAPI(
        title="pbsd trainer",
        version="0.1.0",
        lifespan=lifespan,
        description="Submit and watch RL runs (PBSD or GRPO) for search agents.",
    )
    add_metrics_route(app)
    app.include_router(router)
    install_validation_handler(app)
    # the outermost first: a request without the token is refused before its size is even looked at
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthenticateFirst, settings=settings)

    async def redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"Redis is unreachable: {exc}"}, status_code=503)

    for error in REDIS_DOWN:
        app.add_exception_handler(error, redis_unreachable)

    @app.get("/health")
    async def health(response: Response) -> dict:
        if (gone := stopped(app.state.task)) is not None:
            response.status_code = 503
            return gone
        return {"status": "ok", "current_run": app.state.executor.current}

    return app
