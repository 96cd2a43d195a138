"""The harness of the trainer's fault tests: the real executor serving in a task beside
tests/test_trainer_service.FakePipeline (rollout and scorer) on one real redis-server, with a
crash that models a dead process and a clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from agent.chat import ChatTokenizer
from services.bus import REDIS_DOWN, Bus
from services.trainer.executor import RunExecutor
from services.trainer.runs import RunStore
from services.trainer.settings import TrainerSettings
from tests.test_trainer_service import FakePipeline, kill


class Pipeline:
    """The executor (serving in a task) and the fake rollout/scorer, on one Redis."""

    def __init__(self, url, prefix, tiny_checkpoint, tmp_path, *, patience_s=30.0, **fake) -> None:
        self.bus = Bus.from_url(url, prefix=prefix, patience_s=patience_s)
        self.fake_bus = Bus.from_url(url, prefix=prefix, patience_s=30.0)
        self.store = RunStore(self.bus.redis, prefix)
        self.settings = TrainerSettings(
            local_mode=True,
            redis_url=url,
            stream_prefix=prefix,
            runs_dir=tmp_path / "runs",
            heartbeat_s=0.2,
        )
        self.fake = FakePipeline(self.fake_bus, ChatTokenizer.from_pretrained(tiny_checkpoint), **fake)
        self.fake_stop, self.stop = asyncio.Event(), asyncio.Event()
        self.fake_task = asyncio.create_task(self.fake.run(self.fake_stop))
        self.serving: asyncio.Task | None = None

    def serve(self) -> None:
        self.stop = asyncio.Event()
        self.serving = asyncio.create_task(RunExecutor(self.bus, self.store, self.settings).serve(self.stop))

    async def crash(self) -> None:
        """The trainer process dies (see ``kill``), and every task it ran beside the run with it.
        Cancelling the executor can cut its clean-up short (``kill`` cancels again and again), and a
        validation consumer left running would take the next execution's groups for an earlier
        one's and drop them: the resumed run's round would never complete."""
        await kill(self.serving)
        for task in asyncio.all_tasks():
            code = getattr(task.get_coro(), "cr_code", None)
            if task is not asyncio.current_task() and code and "/services/trainer/" in code.co_filename:
                await kill(task)

    async def shutdown(self) -> None:
        """SIGTERM: the run in progress stops cleanly and stays resumable."""
        self.stop.set()
        await asyncio.wait_for(self.serving, 60)

    async def until(self, run_id, done, timeout=90.0):
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(*REDIS_DOWN):
                    record = await self.store.get(run_id)
                    if done(record):
                        return record
                assert not self.serving.done() or self.serving.cancelled(), self.serving.exception()
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.serving is not None and not self.serving.done():
            await self.crash()
        self.fake_stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.fake_task, 15)
        # what did not stop (a cancellation swallowed inside a Redis call, see ``kill``) would hang
        # the event loop's close for good: the fake and every service task are killed
        for task in asyncio.all_tasks():
            code = getattr(task.get_coro(), "cr_code", None)
            if task is not asyncio.current_task() and (
                task is self.fake_task or (code and "/services/" in code.co_filename)
            ):
                await kill(task)
        await _bounded("closing the bus", self.bus.close())
        await _bounded("closing the fake's bus", self.fake_bus.close())


async def _bounded(what: str, awaitable) -> None:
    """Await with a bound: what hangs prints where every task is, and fails."""
    try:
        await asyncio.wait_for(awaitable, 20)
    except TimeoutError:
        print(f"{what} hangs; the tasks:", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        raise


def finished(record):
    return record.state in ("completed", "cancelled", "failed")


async def steps_recorded(store: RunStore, run_id: str) -> list[int]:
    return [int(r["step"]) for r in await store.metrics(run_id)]
