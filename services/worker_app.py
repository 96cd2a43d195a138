"""The app a :class:`~services.policy_worker.PolicyWorker` runs in (the rollout's and the
scorer's): the worker in the background, ``/livez``, ``/health`` and ``/metrics``, and a shutdown
that lets the worker finish before its resources close."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Response

from services.gc_freeze import frozen_while_serving
from services.http_guard import BodyLimit
from services.policy_worker import PolicyWorker
from services.tasks import cancel_and_wait, main_task, stopped
from services.telemetry import add_metrics_route

__all__ = ["worker_app"]


def worker_app(
    title: str,
    start: Callable[[], Awaitable[tuple[PolicyWorker, list[Callable[[], Awaitable[None]]]]]],
    healthy: Callable[[PolicyWorker], Awaitable[bool]] | None = None,
    grace_s: float = 30.0,
) -> FastAPI:
    """An app that runs ``start()``'s worker in the background and closes its resources on shutdown.

    On shutdown the worker is told to stop and given ``grace_s`` to finish what it holds; then it
    is cancelled and awaited, so its resources are closed only once nothing uses them.

    ``/health`` is 200 with the policy version once the worker consumes (and ``healthy`` agrees),
    503 while it starts, and 503 with the type of the error if it stopped (its message is logged).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker, closers = await start()
        stop = asyncio.Event()
        task = main_task(worker.run(stop), title)
        app.state.worker, app.state.task = worker, task
        try:
            with frozen_while_serving(title):
                yield
        finally:
            stop.set()
            try:
                await asyncio.wait({task}, timeout=grace_s)  # never cancels the task itself
            finally:  # also when this shutdown is itself cancelled during the grace
                try:
                    await cancel_and_wait(task)
                finally:
                    for close in closers:
                        await close()

    app = FastAPI(title=title, version="0.1.0", lifespan=lifespan)
    add_metrics_route(app)
    # its routes take no body but the weight receiver's, whose largest (a bucket's tensor names,
    # dtypes and shapes) the sender keeps under this (weights.sender.MAX_BUCKET_TENSORS)
    app.add_middleware(BodyLimit, max_bytes=64 * 1024)

    @app.get("/livez")
    async def live(response: Response) -> dict:
        """Alive while the worker runs, whatever the engine's health: a liveness probe that asked
        /health would restart a worker whenever its SGLang server is slow or restarting."""
        if (gone := stopped(app.state.task)) is not None:
            response.status_code = 503
            return gone
        return {"status": "alive"}

    @app.get("/health")
    async def health(response: Response) -> dict:
        if (gone := stopped(app.state.task)) is not None:
            response.status_code = 503
            return gone
        worker = app.state.worker
        if not worker.ready.is_set() or (healthy is not None and not await healthy(worker)):
            response.status_code = 503
            return {"status": "starting"}
        return {"status": "ok", "policy_version": worker.version}

    return app
