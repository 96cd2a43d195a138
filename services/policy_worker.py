"""What the rollout workers and the scorer have in common: consume one stream with a few
concurrent consumers while keeping a model at the newest published policy version, and
run as a small FastAPI app with ``/health`` and ``/metrics``."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Response

from proto.messages import WeightsPublished
from proto.streams import WEIGHTS, StreamDef
from services.bus import Bus, ConsumerOptions, Delivery
from services.telemetry import add_metrics_route

log = logging.getLogger(__name__)

__all__ = ["PolicyWorker", "worker_app"]


class PolicyWorker(abc.ABC):
    """Subclasses set ``stream``, and implement ``version``, ``load_weights`` and ``handle``."""

    stream: StreamDef

    def __init__(
        self, bus: Bus, *, name: str, concurrency: int = 1, options: ConsumerOptions | None = None
    ) -> None:
        self.bus = bus
        self.name = name
        self.concurrency = concurrency
        self.options = options or ConsumerOptions(claim_idle_ms=600_000)
        self.ready = asyncio.Event()

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version the worker's model is at."""

    @abc.abstractmethod
    async def load_weights(self, event: WeightsPublished) -> None:
        """Bring the model to the published weights."""

    @abc.abstractmethod
    async def handle(self, message, delivery: Delivery) -> None:
        """Process one message of ``stream``."""

    async def prepare(self) -> None:  # noqa: B027 - an optional hook, not an abstract step
        """Work to do once before consuming (a subclass hook)."""

    async def apply_weights(self, event: WeightsPublished) -> None:
        log.info("%s loading policy version %d from %s", self.name, event.version, event.path)
        await self.load_weights(event)

    async def run(self, stop: asyncio.Event) -> None:
        await self.prepare()
        latest = await self.bus.latest(WEIGHTS)  # catch up with what was published while we were away
        cursor = latest[0] if latest else "0-0"
        if latest and latest[1].version != self.version:
            await self.apply_weights(latest[1])
        follower = asyncio.create_task(self._follow(cursor, stop))
        self.ready.set()
        try:
            await asyncio.gather(
                *(
                    self.bus.consume(
                        self.stream, f"{self.name}-{i}", self.handle, options=self.options, stop=stop
                    )
                    for i in range(self.concurrency)
                )
            )
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def _follow(self, cursor: str, stop: asyncio.Event) -> None:
        async for _entry, event in self.bus.follow(WEIGHTS, after=cursor, stop=stop):
            if event.version != self.version:
                await self.apply_weights(event)


def worker_app(
    title: str,
    start: Callable[[], Awaitable[tuple[PolicyWorker, list[Callable[[], Awaitable[None]]]]]],
    healthy: Callable[[PolicyWorker], Awaitable[bool]] | None = None,
) -> FastAPI:
    """An app that runs ``start()``'s worker in the background and closes its resources on shutdown.

    ``/health`` is 200 with the policy version once the worker consumes (and ``healthy`` agrees),
    503 while it starts, and 503 with the error if it stopped.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker, closers = await start()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        app.state.worker, app.state.task = worker, task
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, 30)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            for close in closers:
                await close()

    app = FastAPI(title=title, version="0.1.0", lifespan=lifespan)
    add_metrics_route(app)

    @app.get("/health")
    async def health(response: Response) -> dict:
        worker, task = app.state.worker, app.state.task
        if task.done():
            response.status_code = 503
            return {"status": "stopped", "error": repr(task.exception()) if not task.cancelled() else None}
        if not worker.ready.is_set() or (healthy is not None and not await healthy(worker)):
            response.status_code = 503
            return {"status": "starting"}
        return {"status": "ok", "policy_version": worker.version}

    return app
