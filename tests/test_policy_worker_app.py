"""worker_app's shutdown (the scorer's and rollout's app): the worker gets its grace, is then
cancelled and awaited, and the resources it uses are closed only after it has ended."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.policy_worker import worker_app


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
