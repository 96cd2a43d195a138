"""The loops beside a run's steps (services/trainer/beside.py): the watcher ends even when its
cancellation is lost, and each loop is stopped whatever stopping another raised."""

from __future__ import annotations

import asyncio

import pytest


def test_the_run_watcher_ends_even_when_its_cancellation_is_lost():
    """After the last step the executor stops its watcher; once, a demo run hung there for good
    with the watcher still polling, its cancellation lost inside a Redis call. Here a store that
    swallows the cancellation stands in for that call."""
    import contextlib

    from services.trainer.beside import stop_task, watch_for_cancel

    class SwallowingStore:
        calls = 0

        async def get(self, run_id):
            SwallowingStore.calls += 1
            with contextlib.suppress(asyncio.CancelledError):  # lost: goes on as if never cancelled
                await asyncio.sleep(0.2)
            return None

    async def scenario():
        cancel, stop = asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(watch_for_cancel(SwallowingStore(), "run", cancel, stop))
        await asyncio.sleep(0.05)  # the watcher is inside store.get
        await asyncio.wait_for(stop_task(watcher, cancel), timeout=5)
        assert watcher.done() and cancel.is_set() and SwallowingStore.calls == 1

    asyncio.run(scenario())


def test_the_loops_beside_a_run_are_each_stopped_whatever_stopping_another_raised():
    from services.trainer.beside import stop_all

    async def broken():
        raise RuntimeError("a refusal the loop did not survive")

    async def scenario():
        failed = asyncio.create_task(broken())
        await asyncio.sleep(0)
        others = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(2)]
        stops = [asyncio.Event() for _ in range(3)]
        with pytest.raises(RuntimeError, match="refusal"):
            await stop_all(list(zip([failed, *others], stops, strict=True)))
        assert all(t.cancelled() for t in others) and all(e.is_set() for e in stops)

    asyncio.run(scenario())
