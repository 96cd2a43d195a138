"""The loops that run beside a run's steps: its watcher (a cancel, the trainer's stop), and how
any of them (the watcher, the dead-letter follower, the validation consumer) is ended."""

from __future__ import annotations

import asyncio
import logging

from services.bus import REDIS_DOWN
from services.tasks import cancel_and_wait
from services.trainer.runs import RunStore

log = logging.getLogger(__name__)

__all__ = ["mirror", "stop_all", "stop_task", "watch_for_cancel"]


async def mirror(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def stop_task(task: asyncio.Task, stop: asyncio.Event) -> None:
    """End a loop that runs beside the run. Setting its ``stop`` event first matters: a task's
    cancellation can be lost inside a Redis call, leaving the watcher polling twice a second for
    good; with the event set its loop ends on the next turn whether or not the cancellation arrives."""
    stop.set()
    await cancel_and_wait(task)


async def stop_all(loops: list[tuple[asyncio.Task, asyncio.Event]]) -> None:
    """:func:`stop_task` each ``(task, stop)``, whatever stopping another raised (a loop left running
    outlives its run); then raise the first failure, a cancellation included."""
    first: BaseException | None = None
    for task, stop in loops:
        try:
            await stop_task(task, stop)
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


async def watch_for_cancel(store: RunStore, run_id: str, cancel: asyncio.Event, stop: asyncio.Event) -> None:
    """Set ``cancel`` when the run is cancelled or the trainer stops; ends once ``cancel`` is set."""
    failing = False
    while not cancel.is_set():
        try:
            record = await store.get(run_id)
            failing = False
        except REDIS_DOWN:
            record = None  # the run's own calls meet the outage too; a cancel waits for Redis
        except Exception:  # a refusal (MASTERDOWN, an ACL): a dead watcher would lose the cancel
            if not failing:  # once a streak, not twice a second for as long as it lasts
                log.exception("run %s: reading its state failed; trying again until it reads", run_id)
            failing, record = True, None
        if stop.is_set() or (record is not None and record.state == "cancelling"):
            cancel.set()
            return
        await asyncio.sleep(0.5)
