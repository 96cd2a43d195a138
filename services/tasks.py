"""Ending asyncio tasks a service started beside its main work (heartbeats, followers, watchers)."""

from __future__ import annotations

import asyncio

__all__ = ["cancel_and_wait", "within"]


async def within(seconds: float, awaitable) -> bool:
    """Await ``awaitable`` for at most ``seconds`` (then it is cancelled): True if it finished.

    With ``asyncio.wait``, which never cancels the caller itself to end the wait: both
    ``asyncio.wait_for`` and ``asyncio.timeout`` do, and on Python 3.11, when the caller is
    cancelled just as the time runs out, the one cancellation can stand for both and the
    caller's is lost (seen: a cancelled trainer's serve loop, polling for queued runs, that
    never ended)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    finally:
        task.cancel()  # a no-op once it has finished
    return bool(done)


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has ended; raise what it failed with, if anything but its
    cancellation. A cancellation of the caller that arrives meanwhile is raised too: the usual
    ``with suppress(CancelledError): await task`` cannot tell the two apart and swallows both,
    which once left a cancelled trainer running on (and its shutdown waiting for it for good)."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
