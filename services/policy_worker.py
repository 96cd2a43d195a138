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
from services.tasks import cancel_and_wait
from services.telemetry import add_metrics_route

log = logging.getLogger(__name__)

__all__ = ["PolicyWorker", "worker_app"]


class PolicyWorker(abc.ABC):
    """Subclasses set ``stream``, and implement ``version``, ``load_weights`` and ``handle``."""

    stream: StreamDef
    load_retry_delays_s: tuple[float, ...] = (2.0, 4.0)  # a failed load is tried again after these

    def __init__(
        self, bus: Bus, *, name: str, concurrency: int = 1, options: ConsumerOptions | None = None
    ) -> None:
        self.bus = bus
        self.name = name
        self.concurrency = concurrency
        self.options = options or ConsumerOptions()
        self.ready = asyncio.Event()
        # the newest weights event seen (its stream id and run), loaded or not, and the run of the
        # weights loaded: a prompt of another run must not be sampled with them
        self.newest: tuple[str, str] | None = None
        self.loaded_run: str | None = None
        self.weights_changed = asyncio.Condition()

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
        self.loaded_run = event.run_id

    def run_is_over(self, run_id: str, published_at: str) -> bool:
        """Whether a message of ``run_id`` published at stream id ``published_at`` belongs to a run that
        has ended: weights of another run were published after it. Runs follow one another and each
        publishes its weights before its prompts, so a prompt newer than the newest weights is still
        current even when those weights are of the run before."""
        if self.newest is None or self.newest[1] == run_id:
            return False
        return _stream_id(self.newest[0]) > _stream_id(published_at)

    async def _see(self, entry_id: str, event: WeightsPublished) -> None:
        """Bring the model to ``event`` if it is another version or run; a failed load is logged and
        retried a few times, and never ends the following (the next publication is taken as usual)."""
        self.newest = (entry_id, event.run_id)
        if event.version != self.version or event.run_id != self.loaded_run:
            attempts = 1 + len(self.load_retry_delays_s)
            for attempt, delay in enumerate((*self.load_retry_delays_s, None), start=1):
                try:
                    await self.apply_weights(event)
                    break
                except Exception:
                    log.exception(
                        "%s could not load policy version %d (attempt %d of %d)",
                        self.name,
                        event.version,
                        attempt,
                        attempts,
                    )
                    if delay is not None:
                        await asyncio.sleep(delay)
        async with self.weights_changed:
            self.weights_changed.notify_all()

    async def run(self, stop: asyncio.Event) -> None:
        await self.prepare()
        latest = await self.bus.latest(WEIGHTS)  # catch up with what was published while we were away
        cursor = latest[0] if latest else "0-0"
        if latest:
            await self._see(*latest)
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
            await cancel_and_wait(follower)

    async def _follow(self, cursor: str, stop: asyncio.Event) -> None:
        """Every publication, for the worker's whole life: a lost connection is retried, not fatal
        (a follower that died would leave the worker at its old version for good)."""
        while not stop.is_set():
            try:
                async for entry, event in self.bus.follow(WEIGHTS, after=cursor, stop=stop):
                    await self._see(entry, event)
                    cursor = entry
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s lost the weights stream; following again in 1 s", self.name)
                await asyncio.sleep(1.0)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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
                await asyncio.wait({task}, timeout=grace_s)  # never cancels the task itself
            finally:  # also when this shutdown is itself cancelled during the grace
                try:
                    await cancel_and_wait(task)
                finally:
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
