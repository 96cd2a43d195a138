"""The trainer service: the REST API for runs and the run executor in one process.

pbsd serve trainer        (settings from PBSD_TRAINER_* and REDIS_URL)
"""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis
from fastapi import FastAPI, Response

from services.bus import Bus
from services.bus.lag import StreamLagMonitor
from services.telemetry import add_metrics_route, setup_logging
from services.trainer.api import router
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
        client = aioredis.Redis.from_url(settings.redis_url)
        bus = Bus(client, prefix=settings.stream_prefix)
        store = RunStore(client, settings.stream_prefix)
        executor = RunExecutor(bus, store, settings, save_groups=settings.save_groups)
        stop = asyncio.Event()
        task = asyncio.create_task(executor.serve(stop))
        # the trainer is the single replica, so the stream lag series are exported exactly once
        lag = StreamLagMonitor(client, settings.stream_prefix, interval_s=settings.lag_interval_s)
        lag_task = asyncio.create_task(lag.run(stop))
        app.state.settings, app.state.store, app.state.executor, app.state.task = (
            settings,
            store,
            executor,
            task,
        )
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, 120)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag_task
            await client.aclose()

    app = FastAPI(
        title="pbsd trainer",
        version="0.1.0",
        lifespan=lifespan,
        description="Submit and watch RL runs (PBSD or GRPO) for search agents.",
    )
    add_metrics_route(app)
    app.include_router(router)

    @app.get("/health")
    async def health(response: Response) -> dict:
        task = app.state.task
        if task.done():
            response.status_code = 503
            return {"status": "stopped", "error": repr(task.exception()) if not task.cancelled() else None}
        return {"status": "ok", "current_run": app.state.executor.current}

    return app
