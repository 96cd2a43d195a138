"""Ending asyncio tasks a service started beside its main work (heartbeats, followers, watchers),
saying how a service's main task ended, and work in a thread that a cancellation cannot end."""

from __future__ import annotations

import asyncio
import logging

__all__ = ["cancel_and_wait", "gather_or_cancel", "main_task", "stopped", "thread_to_the_end", "within"]

log = logging.getLogger(__name__)


def main_task(work, what: str) -> asyncio.Task:
    """Start a service's main work; should it end with an exception, the traceback is logged."""
    task = asyncio.create_task(work)

    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.error("%s stopped: %s", what, exc, exc_info=exc)

    task.add_done_callback(done)
    return task


def stopped(task: asyncio.Task) -> dict | None:
    """What ``/health`` answers once the service's main task has ended (None while it runs). The route
    needs no token, so it names the exception's type only; its message, which can hold addresses
    and request details, is in the log (:func:`main_task`)."""
    if not task.done():
        return None
    exc = None if task.cancelled() else task.exception()
    return {"status": "stopped", "error": type(exc).__name__ if exc is not None else None}


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


async def gather_or_cancel(*awaitables):
    """``asyncio.gather(*awaitables)``, but the first failure cancels the others and waits for them
    to end before it is raised, as it does when the caller is cancelled. With gather they ran on,
    detached: a group whose one trajectory hit a bug went on sampling the rest on the engine while
    its prompt was retried."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a no-op on one that is done
        if tasks:
            await asyncio.wait(tasks)


async def thread_to_the_end(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a worker thread, which no cancellation stops. So a caller cancelled
    meanwhile (its consumer stopped, or another took its work over), once or more, still waits for
    the thread before it raises: what the caller holds while the thread uses the model (a scorer's
    lock, a held engine) is let go only once the model is free, and no second pass runs beside
    this one (twice the memory), no weights are loaded under it and no engine resumes on weights
    still being written."""
    thread = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    cancelled = None
    while not thread.done():
        try:
            await asyncio.wait({thread})
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        thread.exception()  # retrieved: its result goes nowhere now
        raise cancelled
    return thread.result()
