"""What the rollout workers and the scorer have in common: consume one stream with a few
concurrent consumers while keeping a model at the newest published policy version, and
run as a small FastAPI app with ``/health`` and ``/metrics`` (:mod:`services.worker_app`).

Weights are named by ``(timeline, version)`` (:class:`proto.messages.WeightsPublished`): a
publication of another timeline is loaded even when its version number is the one held, since
after a trainer's resume a number can name other weights. What a piece of work sampled with is
recorded by :meth:`PolicyWorker.holding`. Runs that ended (the ``run-ends`` stream) are
remembered, and their messages dropped on sight, unprocessed.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from proto.messages import RunEnded, WeightsPublished
from proto.streams import RUN_ENDS, WEIGHTS, StreamDef
from services.bus import REDIS_DOWN, Bus, ConsumerOptions, Delivery, entry_order
from services.tasks import cancel_and_wait

log = logging.getLogger(__name__)

__all__ = ["PolicyWorker"]


class PolicyWorker(abc.ABC):
    """Subclasses set ``stream``, and implement ``version``, ``load_weights`` and ``handle``; the
    messages of ``stream`` carry a ``run_id``."""

    stream: StreamDef
    # a failed load is tried again after these, then every load_retry_max_s, until it loads or a
    # newer version is published: a worker that gave up would hold its prompts until the next
    # publication, which a trainer waiting for their groups never makes
    load_retry_delays_s: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0)
    load_retry_max_s: float = 60.0
    remembered_ends: int = 10_000  # the newest run ends read at start (older runs left nothing behind)
    recheck_s: float = 30.0  # how often servers that hold weights of their own are asked for them
    # how long a leaving worker's keeping what it did (keep_begun), then its handing back, may each take
    release_timeout_s: float = 10.0

    def __init__(
        self, bus: Bus, *, name: str, concurrency: int = 1, options: ConsumerOptions | None = None
    ) -> None:
        self.bus = bus
        self.name = name
        self.concurrency = concurrency
        self.options = options or ConsumerOptions()
        self.ready = asyncio.Event()
        self.leaving = False  # set as the consumers are cancelled for good
        # the newest weights event seen (its stream id and the event), loaded or not, and the run and
        # timeline of the weights loaded: a prompt of another run must not be sampled with them
        self.newest: tuple[str, WeightsPublished] | None = None
        self.loaded_run: str | None = None
        self.loaded_timeline: str | None = None
        # runs whose end was announced, the newest remembered_ends of them (oldest first), as a
        # restart would know them: a long-lived worker sees thousands of runs end
        self.ended: dict[str, None] = {}
        self.weights_changed = asyncio.Condition()  # notified on every weights event and run end
        self._loading = asyncio.Lock()  # a publication's load and a recheck, one at a time
        self._holding: list[dict[str, int]] = []

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version the worker's model is at."""

    async def load_weights(self, event: WeightsPublished) -> None:
        """Bring the model to the published weights: the server that holds them loads them."""
        await self.server.update_weights(event.path, event.version, event.timeline)

    @abc.abstractmethod
    async def handle(self, message, delivery: Delivery) -> None:
        """Process one message of ``stream``."""

    async def prepare(self) -> None:  # noqa: B027 - an optional hook, not an abstract step
        """Work to do once before consuming (a subclass hook)."""

    def version_seen(self, version: int) -> None:  # noqa: B027 - an optional hook
        """The model is at ``version`` after a publication, loaded from disk or brought by the
        weight group (a subclass sets its gauge: a broadcast never passes through load_weights)."""

    async def dropped_ended(self, message) -> None:
        """A message of an ended run was dropped unprocessed (a subclass counts it, and removes
        what it may have left in Redis for it)."""
        log.info("%s dropped a message of run %s, which has ended", self.name, message.run_id)

    async def apply_weights(self, event: WeightsPublished) -> None:
        log.info(
            "%s loading policy version %d (timeline %s) from %s",
            self.name,
            event.version,
            event.timeline or "-",
            event.path,
        )
        for held in self._holding:  # before the load: a load that fails halfway may have changed weights
            _see_weights(held, event.timeline, event.version)
        await self.load_weights(event)
        self.loaded_run, self.loaded_timeline = event.run_id, event.timeline

    @contextlib.contextmanager
    def holding(self) -> Iterator[dict[str, int]]:
        """The weights the model holds while the block runs, as ``{timeline: newest version}``
        (``TrajectoryGroup.policy_timelines``): the ones loaded when it starts and every load it sees
        begin. Weights without a timeline are left out."""
        held: dict[str, int] = {}
        if self.loaded_timeline:
            _see_weights(held, self.loaded_timeline, self.version)
        self._holding.append(held)
        try:
            yield held
        finally:
            self._holding.remove(held)

    def holds_newest(self, run_id: str) -> bool:
        """Whether the model holds ``run_id``'s weights of the newest timeline announced (a worker
        holding a timeline a resume abandoned must not sample with it once it knows)."""
        if self.newest is None:
            return True  # nothing published yet: the model the engine started with
        newest = self.newest[1]
        if self.loaded_run != run_id:
            return False
        return newest.run_id != run_id or newest.timeline == self.loaded_timeline

    def label_outdated(self, run_id: str, timeline: str) -> bool:
        """Whether a prompt's step label counts the versions of a timeline other than the newest one
        announced for its run: one a trainer published before it crashed and resumed. Its label
        reaches past where the resumed timeline starts, which gets there only by training the
        groups the prompts out can bring: the resume's own prompts came back stale while these
        waited, the trainer counted them still to come and let no replacement out, and the run
        waited for good. (One of a timeline announced a moment later is sampled with the weights
        held, which the trainer takes or drops by its own checks.)"""
        if not timeline or self.newest is None:
            return False
        newest = self.newest[1]
        return newest.run_id == run_id and newest.timeline != timeline

    def run_is_over(self, run_id: str, published_at: str) -> bool:
        """Whether a message of ``run_id`` published at stream id ``published_at`` belongs to a run that
        has ended: its end was announced, or weights of another run were published after it. Runs
        follow one another and each publishes its weights before its prompts, so a prompt newer than
        the newest weights is still current even when those weights are of the run before."""
        if run_id in self.ended:
            return True
        if self.newest is None or self.newest[1].run_id == run_id:
            return False
        return entry_order(self.newest[0]) > entry_order(published_at)

    @property
    def server(self):
        """The engine or scorer that holds the weights (subclasses): it loads each publication
        (``update_weights``, unless the subclass loads them itself), and one that serves them from
        SGLang servers follows broadcasts itself (``follow_broadcast``: each server that missed one
        loads the disk copy)."""
        return None

    async def follow_broadcast(self, event: WeightsPublished) -> None:
        """``event`` was broadcast to the weight group. A model in the group has it already; one that
        missed it (it was down, or not yet up) loads the newest copy on disk if that is newer than
        what it holds, and takes the next version from the group."""
        follow = getattr(self.server, "follow_broadcast", None)
        if follow is not None:
            # the servers hold the new weights only once this succeeds: until then the worker must
            # not say it holds them (a resume's timeline, say), so it tries again as a load does
            copy = event.disk_copy()
            if await self._until_loaded(
                lambda: follow(event.version, copy.path, copy.version, event.timeline), event.version
            ):
                self._received(event)
            return
        same_weights = (event.run_id, event.timeline) == (self.loaded_run, self.loaded_timeline)
        if same_weights and self.version >= event.version:
            self._received(event)  # the group brought it
            return
        copy = event.disk_copy()
        if not same_weights or copy.version > self.version:
            await self._load(copy)
        else:
            log.warning(
                "%s missed policy version %d and holds %d; the next broadcast brings it up to date",
                self.name,
                event.version,
                self.version,
            )

    def _received(self, event: WeightsPublished) -> None:
        """The broadcast ``event`` reached the model through the weight group, not ``apply_weights``."""
        for held in self._holding:
            _see_weights(held, event.timeline, event.version)
        self.loaded_run, self.loaded_timeline = event.run_id, event.timeline

    async def _see(self, entry_id: str, event: WeightsPublished) -> None:
        """Bring the model to ``event`` if it is another version, run or timeline (a broadcast one:
        see :meth:`follow_broadcast`); a failed load is logged and tried again until it loads or a
        newer version is published (:meth:`_load`), and never ends the following."""
        self.newest = (entry_id, event)
        async with self._loading:
            if event.transport == "broadcast":
                await self.follow_broadcast(event)
            elif (event.version, event.run_id, event.timeline) != (
                self.version,
                self.loaded_run,
                self.loaded_timeline,
            ):
                if await self._superseded(entry_id, 0.0):  # a worker whose loads lag takes the newest only
                    log.info(
                        "%s passes over policy version %d: a newer one is published", self.name, event.version
                    )
                else:
                    await self._load(event, entry_id)
        self.version_seen(self.version)
        async with self.weights_changed:
            self.weights_changed.notify_all()

    async def _load(self, event: WeightsPublished, entry_id: str | None = None) -> None:
        """Load ``event``'s weights (see :meth:`_until_loaded`)."""
        await self._until_loaded(lambda: self.apply_weights(event), event.version, entry_id)

    async def _until_loaded(
        self, load: Callable[[], Awaitable[None]], version: int, entry_id: str | None = None
    ) -> bool:
        """Run ``load`` (policy ``version``), trying again after each failure (``load_retry_delays_s``,
        then every ``load_retry_max_s``) until it succeeds (True) or a newer weights event (after
        ``entry_id``, or the newest one seen when None) supersedes it (False)."""
        entry_id = entry_id or (self.newest[0] if self.newest else None)
        delays = iter(self.load_retry_delays_s)
        for attempt in itertools.count(1):
            try:
                await load()
                return True
            except Exception:
                log.exception(
                    "%s could not load policy version %d (attempt %d); trying again until it loads or a "
                    "newer one is published",
                    self.name,
                    version,
                    attempt,
                )
            if await self._superseded(entry_id, next(delays, self.load_retry_max_s)):
                log.warning("%s passes over policy version %d: a newer one is published", self.name, version)
                return False

    async def _superseded(self, entry_id: str | None, wait_s: float) -> bool:
        """Whether a weights event newer than ``entry_id`` is published, asked at once and then every
        second for up to ``wait_s``: a version that fails to load gives way to the next at once."""
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(*REDIS_DOWN):  # an entry that does not decode supersedes nothing
                newest = await self.bus.latest(WEIGHTS, scan=8)
                if (
                    entry_id is not None
                    and newest is not None
                    and entry_order(newest[0]) > entry_order(entry_id)
                ):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(1.0, left))

    async def _recheck(self) -> None:
        """An SGLang server restarts on its own (a liveness probe, an OOM kill, a node drain) and
        comes back serving the model it started with, and no publication says so: every answer it
        gave was then tagged version 0 and its groups dropped as stale, and where it was the only
        server no batch filled, so no step published the weights that would have reloaded it. Every
        ``recheck_s`` a server that holds weights of its own (``server.recheck``) is asked whether
        it still serves the newest loaded ones (one ``/model_info``), and loads them if not."""
        recheck = getattr(self.server, "recheck", None)
        if recheck is None:
            return
        while True:
            await asyncio.sleep(self.recheck_s)
            async with self._loading:
                if self.newest is None:
                    continue
                event = self.newest[1]
                if (event.run_id, event.timeline) != (self.loaded_run, self.loaded_timeline):
                    continue  # not loaded (yet): the publication's own tries bring it
                try:
                    if event.transport == "broadcast":
                        await self.follow_broadcast(event)  # a server that missed it loads the disk copy
                    else:
                        await recheck(event.path, event.version, event.timeline)
                except Exception:
                    log.warning(
                        "%s could not check its servers' weights; trying again", self.name, exc_info=True
                    )

    def _remember_end(self, run_id: str) -> None:
        self.ended.pop(run_id, None)
        self.ended[run_id] = None
        while len(self.ended) > self.remembered_ends:
            del self.ended[next(iter(self.ended))]

    async def _end(self, entry_id: str, event: RunEnded) -> None:
        self._remember_end(event.run_id)
        async with self.weights_changed:
            self.weights_changed.notify_all()

    async def _unless_ended(self, message, delivery: Delivery) -> None:
        if message.run_id in self.ended:
            await self.dropped_ended(message)
            return
        await self.handle(message, delivery)

    async def run(self, stop: asyncio.Event) -> None:
        self.leaving = False
        await self.prepare()
        # Catch up with what was published while we were away, then follow from there. The heads
        # are read first: where nothing near the top decodes, following from "0-0" instead would
        # replay every weights entry the stream still holds.
        heads = [await self.bus.head(WEIGHTS), await self.bus.head(RUN_ENDS)]
        latest = await self.bus.latest(WEIGHTS)
        if latest:
            await self._see(*latest)
        ends = await self.bus.newest(RUN_ENDS, self.remembered_ends)
        for _, event in ends:
            self._remember_end(event.run_id)
        # the followers go on while the consumers finish what they hold after a stop: a handler
        # waiting for weights would otherwise wait out the grace, and one of an ended run sample on
        following = asyncio.Event()
        followers = [
            asyncio.create_task(
                self.bus.follow_for_good(
                    WEIGHTS, latest[0] if latest else heads[0], self._see, following, reader=self.name
                )
            ),
            asyncio.create_task(
                self.bus.follow_for_good(
                    RUN_ENDS, ends[-1][0] if ends else heads[1], self._end, following, reader=self.name
                )
            ),
            asyncio.create_task(self._recheck()),
        ]
        self.ready.set()
        names = [f"{self.name}-{i}" for i in range(self.concurrency)]
        consumers = [
            asyncio.create_task(
                self.bus.consume(self.stream, name, self._unless_ended, options=self.options, stop=stop)
            )
            for name in names
        ]
        try:
            # not gather: cancelled, it would cancel the consumers before `leaving` is set below
            done, _ = await asyncio.wait(consumers, return_when=asyncio.FIRST_EXCEPTION)
            for consumer in done:
                consumer.result()  # a consumer's failure is the worker's
        finally:
            try:
                self.leaving = True  # from here on, a handler cancelled is cut off by the leaving
                for consumer in consumers:  # the grace ran out, or one failed: the others stop too
                    consumer.cancel()
                await asyncio.wait(consumers)
                await self._hand_back(names)
            finally:  # however the hand-back ended, a second cancel included
                for follower in followers:
                    await cancel_and_wait(follower)

    async def keep_begun(self) -> None:  # noqa: B027 - an optional hook
        """Keep, for whoever takes the messages next, what the handlers the leaving cut off had
        done (a rollout worker's begun groups: :mod:`proto.handback`)."""

    async def _hand_back(self, names: list[str]) -> None:
        """What the consumers still hold goes to another worker now, not once its takeover time
        has passed (a group cut off by a scale-down waited 50 s before anyone sampled it again),
        with what was done of it kept first. Each part bounded, and never raised: with Redis gone
        the takeover hands it on once Redis is back, and the error that stopped the worker, if
        any, is the one to report."""
        await self._bounded(self.keep_begun(), "keep what it had done: its takeover starts it again")
        await self._bounded(self.bus.release(self.stream, names), "hand back what it held: the takeover will")

    async def _bounded(self, work: Awaitable[None], what: str) -> None:
        try:
            async with asyncio.timeout(self.release_timeout_s):
                await work
        except (*REDIS_DOWN, TimeoutError):
            log.warning("%s could not %s", self.name, what)
        except Exception:
            log.exception("%s could not %s", self.name, what)


def _see_weights(held: dict[str, int], timeline: str, version: int) -> None:
    if timeline:
        held[timeline] = max(held.get(timeline, version), version)
