"""services.tasks.cancel_and_wait: a child task is ended, and the caller's own cancellation is never lost."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.tasks import cancel_and_wait


async def _slow_to_end():
    """A child that takes a moment to wind down once cancelled (a Redis call in flight, say)."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)
        raise


async def _parent(child, ending) -> str:
    await ending(child)
    return "went on"


async def _suppressing(child):  # what the services did before
    child.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await child


@pytest.mark.parametrize(("ending", "cancelled"), [(cancel_and_wait, True), (_suppressing, False)])
async def test_the_callers_cancellation_is_not_swallowed(ending, cancelled):
    child = asyncio.create_task(_slow_to_end())
    await asyncio.sleep(0)
    parent = asyncio.create_task(_parent(child, ending))
    await asyncio.sleep(0.05)  # the parent now waits for the child to end
    parent.cancel()
    await asyncio.wait({parent})
    assert parent.cancelled() is cancelled  # the old way: the parent went on as if never cancelled
    await asyncio.wait({child})  # it winds down on its own either way
    assert child.cancelled()


async def test_the_child_is_ended_and_its_failure_raised():
    child = asyncio.create_task(_slow_to_end())
    await asyncio.sleep(0)
    await cancel_and_wait(child)
    assert child.cancelled()

    async def fails_on_cancel():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    child = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(child)


async def test_a_failure_among_gathered_work_ends_the_rest_before_it_is_raised():
    """With asyncio.gather the others ran on, detached (a group's trajectories on the engine)."""
    from services.tasks import gather_or_cancel

    ended = []

    async def long(i):
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # winding down
            ended.append(i)

    async def broken():
        await asyncio.sleep(0.01)
        raise RuntimeError("a bug in one trajectory")

    with pytest.raises(RuntimeError, match="a bug"):
        await gather_or_cancel(long(0), broken(), long(2))
    assert sorted(ended) == [0, 2]
    assert await gather_or_cancel(asyncio.sleep(0, 1), asyncio.sleep(0, 2)) == [1, 2]
    assert await gather_or_cancel() == []
