"""The consumer groups a run reads through on the bus, and their removal once the run is over.

Each run reads the scored groups, and its validation groups, through consumer groups of its own.
A new run makes them as it opens, before its first prompt goes out, at the streams' ends: nothing
of its own can be in them yet, and what a run before it left (acknowledged groups not yet trimmed,
up to a batch) is then never read and counted as foreign. A resumed run's groups hold its place;
one that has none (a crash before they were made, groups an older pbsd named otherwise) reads from
the streams' beginning, where its groups in flight may be.

Redis keeps a group until it is destroyed, and a stream is trimmed only below the slowest group's
position (:mod:`services.bus.trimming`): an ended run's group would keep every later entry of
``scored`` and ``evals`` in Redis for good, and with routing replay's routes a scored group is up
to hundreds of MB. So a run's groups are destroyed when it ends, and the
trainer, as it starts, destroys those of runs that ended while it could not (a crash between the
end and the destruction, a run deleted, groups an older pbsd left).
"""

from __future__ import annotations

import logging

from proto.base import derived_id
from proto.messages import RunEnded
from proto.streams import EVALS, RUN_ENDS, SCORED
from services.bus import Bus
from services.trainer.runs import FINISHED, RunStore

log = logging.getLogger(__name__)

__all__ = ["announce_end", "evals_group", "forget_ended_runs", "forget_run", "open_groups", "scored_group"]

_PREFIX, _EVALS_SUFFIX = "trainer-", "-evals"


def scored_group(run_id: str) -> str:
    return f"{_PREFIX}{run_id}"


def evals_group(run_id: str) -> str:
    return f"{_PREFIX}{run_id}{_EVALS_SUFFIX}"


async def open_groups(bus: Bus, run_id: str) -> None:
    """Make a new run's groups at the streams' ends (before anything of the run is published)."""
    await bus.ensure_group(SCORED, scored_group(run_id), start="$")
    await bus.ensure_group(EVALS, evals_group(run_id), start="$")


async def announce_end(bus: Bus, run_id: str, state: str, step: int = 0) -> None:
    """Tell the workers the run is over (its prompts and groups still on the bus are dropped on
    sight), then destroy its groups. Announced again, it is the same message (one id a run)."""
    ended = RunEnded(message_id=derived_id(run_id, "ended"), run_id=run_id, state=state, step=step)
    await bus.publish(RUN_ENDS, ended)
    await forget_run(bus, run_id)


async def forget_run(bus: Bus, run_id: str) -> None:
    """Destroy the run's consumer groups (what they held pending is dropped with them)."""
    await bus.destroy_group(SCORED, scored_group(run_id))
    await bus.destroy_group(EVALS, evals_group(run_id))


async def forget_ended_runs(bus: Bus, store: RunStore) -> list[str]:
    """Destroy the groups of every run that has ended or no longer exists, and the one group every
    run read through before runs had their own (named as the stream's, "trainer"; a run resumed
    now reads its entries again through a group of its own); returns their names. A run that
    ended is announced again: its groups are left only where its end could not be announced
    (Redis out of reach as it failed, a crash between), and workers would sample, call tools for
    and score its leftover prompts for no one."""
    gone, ended = [], {}
    for stream, suffix in ((SCORED, ""), (EVALS, _EVALS_SUFFIX)):
        for group in await bus.group_names(stream):
            if group == stream.group:
                await bus.destroy_group(stream, group)
                gone.append(group)
                continue
            if not (group.startswith(_PREFIX) and group.endswith(suffix)):
                continue
            run_id = group[len(_PREFIX) : len(group) - len(suffix)]
            # the summary, not the record: a spec an older pbsd stored may not validate any more
            record = await store.summary(run_id)
            if record is not None and record.state in FINISHED:
                ended[run_id] = record  # its groups go once its end is announced, below
                gone.append(group)
            elif record is None:
                await bus.destroy_group(stream, group)
                gone.append(group)
    for run_id, record in ended.items():
        # announced before its groups go: they are the only mark that the end may not have been
        await announce_end(bus, run_id, record.state, record.step)
    if gone:
        log.info("destroyed %d consumer groups of runs that have ended: %s", len(gone), ", ".join(gone[:10]))
    return gone
