"""CPU-bound tool work off the event loop: BM25 search and snippets, HTML to text, extraction.

The event loop answers ``/health``, cache hits and every socket; a millisecond of search on it
delays all of them. Here the work runs on ``workers`` threads and at most that many calls
run at once: the rest wait their turn in the event loop, where a call past its deadline is
cancelled before it ever starts, instead of in an executor queue nobody can withdraw from.
A started job runs to its end (a thread cannot be stopped), so every job here is linear in
its input and its input is capped.

One worker by default: on a small machine a second thread mostly waits for the GIL, and
while a worker holds it the event loop waits too. Python hands the GIL to a waiting thread
after ``sys.getswitchinterval()`` (5 ms by default); :func:`responsive_switching` shortens
that, so the event loop gets it back within a fraction of a millisecond. The workers also
run at a lower OS priority (``nice``, Linux): when the cores are busy the scheduler runs the
event loop first, and the workers take whatever CPU it leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["CpuPool", "responsive_switching"]

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.0005


def responsive_switching(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Let a thread waiting for the GIL (the event loop) have it after ``interval_s`` of another
    thread's bytecode, instead of 5 ms. Process-wide: call it in the gateway's process only."""
    sys.setswitchinterval(interval_s)


def _lower_priority(nice: int) -> None:
    """In a worker thread: raise its own nice value (Linux schedules threads apart)."""
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


class CpuPool:
    def __init__(self, workers: int = 1, *, nice: int = 5) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self._executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="pbsd-tools-cpu",
            initializer=_lower_priority,
            initargs=(nice,),
        )
        self._slots: asyncio.Semaphore | None = None  # made in the running loop, on first use

    async def run(self, fn: Callable[..., T], *args) -> T:
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        await self._slots.acquire()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        answer = loop.create_future()

        def settled(_job: Future) -> None:  # in the worker thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(self._settle, answer, job)

        job.add_done_callback(settled)
        try:
            return await answer
        except asyncio.CancelledError:
            job.cancel()  # withdrawn if it has not started; a started job frees its slot when it ends
            raise

    def _settle(self, answer: asyncio.Future, job: Future) -> None:
        self._slots.release()
        if answer.done():
            return
        if job.cancelled():
            answer.cancel()
        elif job.exception() is not None:
            answer.set_exception(job.exception())
        else:
            answer.set_result(job.result())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
