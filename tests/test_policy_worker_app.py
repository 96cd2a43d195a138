"""worker_app's shutdown (the scorer's and rollout's app): the worker gets its grace, is then
cancelled and awaited, and the resources it uses are closed only after it has ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from proto import examples as ex
from proto.messages import WeightsPublished
from proto.streams import PROMPTS, WEIGHTS
from services.bus import ConsumerOptions
from services.policy_worker import PolicyWorker
from services.worker_app import worker_app
from tests.test_bus import _run_until


class FakeWorker:
    """Runs until told to stop, or (``stubborn``) until cancelled."""

    def __init__(self, stubborn: bool) -> None:
        self.stubborn = stubborn
        self.ready = asyncio.Event()
        self.version = 0
        self.ended = False

    async def run(self, stop: asyncio.Event) -> None:
        self.ready.set()
        try:
            if self.stubborn:
                await asyncio.Event().wait()
            await stop.wait()
        finally:
            self.ended = True


def app_for(worker: FakeWorker, closed: list[bool], grace_s: float):
    async def close() -> None:
        closed.append(worker.ended)  # was the worker over when its resources went?

    async def start():
        return worker, [close]

    return worker_app("test", start, grace_s=grace_s)


@pytest.mark.parametrize("stubborn", [False, True], ids=["stops", "ignores-stop"])
async def test_shutdown_ends_the_worker_before_closing_its_resources(stubborn):
    worker, closed = FakeWorker(stubborn), []
    app = app_for(worker, closed, grace_s=0.5)
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(worker.ready.wait(), 5)
        started = time.monotonic()
    took = time.monotonic() - started
    assert closed == [True]
    # a worker that stops is not kept waiting for the grace; one that does not is cut off after it
    assert (0.4 < took < 3) if stubborn else (took < 0.4)


async def test_a_shutdown_cancelled_during_the_grace_still_ends_the_worker_and_says_so():
    worker, closed = FakeWorker(stubborn=True), []
    app = app_for(worker, closed, grace_s=30)
    entered = asyncio.Event()

    async def serve():
        async with app.router.lifespan_context(app):
            entered.set()

    task = asyncio.create_task(serve())
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.sleep(0.1)  # into the 30 s grace
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert worker.ended and closed == [True]


async def test_liveness_asks_only_whether_the_worker_runs():
    """/health is readiness: 503 while the engine is unhealthy (an SGLang server slow or restarting).
    /livez, the liveness probe's route, stays 200 then, and turns 503 once the worker has stopped."""
    import httpx

    worker, engine_ok = FakeWorker(stubborn=False), [False]

    async def start():
        return worker, []

    async def healthy(_) -> bool:
        return engine_ok[0]

    app = worker_app("test", start, healthy, grace_s=0.5)
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(worker.ready.wait(), 5)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
            assert (await http.get("/health")).status_code == 503
            assert (await http.get("/livez")).json() == {"status": "alive"}
            engine_ok[0] = True
            assert (await http.get("/health")).status_code == 200
            app.state.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await app.state.task
            assert (await http.get("/livez")).status_code == 503
            assert (await http.get("/health")).status_code == 503


async def test_a_worker_that_failed_says_how_by_type_only_and_logs_the_rest(caplog):
    """/health needs no token: a failure's message (addresses, request details) stays in the log."""
    import httpx

    class Failing(FakeWorker):
        async def run(self, stop: asyncio.Event) -> None:
            self.ready.set()
            raise ConnectionError("Error 111 connecting to redis.internal:6379 as pbsd:hunter2")

    worker = Failing(stubborn=False)

    async def start():
        return worker, []

    app = worker_app("pbsd test", start, grace_s=0.5)
    # (the shutdown raises what the worker failed with, as it always has)
    with caplog.at_level("ERROR", logger="services.tasks"), pytest.raises(ConnectionError):
        async with app.router.lifespan_context(app):
            await asyncio.wait({app.state.task}, timeout=5)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
                for route in ("/health", "/livez"):
                    answer = await http.get(route)
                    assert answer.status_code == 503
                    assert answer.json() == {"status": "stopped", "error": "ConnectionError"}
    assert "pbsd test stopped: Error 111 connecting to redis.internal:6379" in caplog.text


class _Waiting(PolicyWorker):
    """A worker whose handler waits for version 2 of the weights, or (``stuck``) for good."""

    stream = PROMPTS

    def __init__(self, bus, stuck: bool) -> None:
        super().__init__(bus, name="leaving", options=ConsumerOptions(block_ms=50, heartbeat_ms=500))
        self._version, self.stuck, self.entered, self.done = 1, stuck, asyncio.Event(), []

    @property
    def version(self) -> int:
        return self._version

    async def load_weights(self, event: WeightsPublished) -> None:
        self._version = event.version

    async def handle(self, message, delivery) -> None:
        self.entered.set()
        while self.stuck or self._version < 2:
            await asyncio.sleep(0.02)
        self.done.append(message.message_id)


async def test_a_stopping_worker_still_sees_weights_and_hands_back_what_it_could_not_finish(bus):
    """During the grace after a stop the worker followed no weights any more: a handler waiting for
    a version waited out the grace. What it still held when cut off waited out the takeover time
    (ten heartbeats) before another worker sampled it again; it is handed back at once now."""
    first, second = ex.example_task(0), ex.example_task(1)
    await bus.publish(PROMPTS, first)
    finishing = _Waiting(bus, stuck=False)
    stop = asyncio.Event()
    running = asyncio.create_task(finishing.run(stop))
    await asyncio.wait_for(finishing.entered.wait(), 10)
    stop.set()
    await bus.publish(WEIGHTS, WeightsPublished(run_id="run-1", version=2, step=2, path="/w/2"))
    await asyncio.wait_for(running, 10)
    assert finishing.done == [first.message_id]

    await bus.publish(PROMPTS, second)
    stuck = _Waiting(bus, stuck=True)
    running = asyncio.create_task(stuck.run(asyncio.Event()))
    await asyncio.wait_for(stuck.entered.wait(), 10)
    running.cancel()  # the grace ran out
    await asyncio.wait({running})
    got = []

    async def handler(message, delivery):
        got.append(message.message_id)

    began = time.monotonic()
    await _run_until(
        bus, PROMPTS, handler, lambda: got, consumer="staying", options=stuck.options, timeout=4.0
    )
    assert got == [second.message_id] and time.monotonic() - began < 2.0  # not the 5 s takeover


async def test_handing_back_is_one_bounded_command_for_all_of_a_workers_consumers(bus, monkeypatch):
    """A release per consumer, each waiting out Redis's patience (60 s) when Redis is gone, would
    have held a 32-slot worker's shutdown for half an hour: one command names them all, and it
    gives up after release_timeout_s (the takeover hands the entries on once Redis is back)."""
    calls = []

    async def gone(stream, consumers, **kwargs):
        calls.append(consumers)
        await asyncio.sleep(3600)  # Redis out of reach, the client reconnecting

    monkeypatch.setattr(bus, "release", gone)
    worker = _Waiting(bus, stuck=True)
    worker.concurrency, worker.release_timeout_s = 3, 0.2
    running = asyncio.create_task(worker.run(asyncio.Event()))
    await asyncio.wait_for(worker.ready.wait(), 10)
    began = time.monotonic()
    running.cancel()
    await asyncio.wait_for(asyncio.wait({running}), 5)
    assert time.monotonic() - began < 2.0
    assert calls == [["leaving-0", "leaving-1", "leaving-2"]]


def _walked(marker: object) -> bool:
    """Whether the garbage collector's full collection walks ``marker``."""
    import gc

    return any(o is marker for o in gc.get_objects())


async def test_what_the_process_held_at_start_is_out_of_the_collectors_walk_while_it_serves():
    """A full collection walks every object the collector tracks, and a started service holds
    hundreds of thousands that live as long as it (torch, pydantic, its model): the app freezes
    them once the worker has started, after collecting what starting left in cycles, and hands
    them back to the collector at shutdown."""
    import gc
    import weakref

    class Cycle:
        pass

    imported: list = []  # made before the service starts, as its imports are
    made_by_start: list = []
    worker = FakeWorker(stubborn=False)

    async def start():
        made_by_start.append([])  # as a worker's model is
        garbage = Cycle()
        garbage.me = garbage  # a cycle that starting leaves behind
        made_by_start.append(weakref.ref(garbage))
        return worker, []

    app = worker_app("test", start, grace_s=0.5)
    gc.disable()  # no collection but the app's own
    try:
        async with app.router.lifespan_context(app):
            assert not _walked(imported) and not _walked(made_by_start[0]) and gc.get_freeze_count() > 0
            assert made_by_start[1]() is None  # collected, not frozen for as long as it serves
            made_after: list = []
            assert _walked(made_after)  # what comes while it serves is collected as ever
    finally:
        gc.enable()
    assert _walked(imported) and gc.get_freeze_count() == 0


def test_the_freeze_is_handed_back_however_serving_ends():
    import gc

    from services.gc_freeze import frozen_while_serving

    with pytest.raises(RuntimeError), frozen_while_serving("test"):
        assert gc.get_freeze_count() > 0
        raise RuntimeError("the service failed")
    assert gc.get_freeze_count() == 0
