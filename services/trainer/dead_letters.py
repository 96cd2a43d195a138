"""Prompts whose groups will never come: the run's messages a consumer dead-lettered.

A consumer gives up on an entry it cannot process (undecodable, or delivered
``max_deliveries`` times without an acknowledgement: a prompt that crashes its rollout worker
each time, a group that kills the scorer) and moves it to the dead-letter stream with the cause
(``services.bus``). For the run that published it, that prompt's group is now missing for good:
the step that counts on it would wait forever, and the run's last step always does, since it
waits for every prompt still out. So the executor follows the dead-letter stream for the run's
training messages (its prompts, their trajectory groups and scored groups) and treats each as a
dropped group: counted (``drops["dead_lettered"]``), marked in the run's dropped set, and
replaced by the next prompt of the data. Replaced, not retried: a message that failed five
times is likely to fail again.

Each execution of a run reads the stream from where it stood as the run first opened, before its
first prompt went out (``RunStore.letters_after``), so a prompt dead-lettered while the trainer was
down counts too, and the letters of every run before it are not read again; one already counted
(in the checkpoint's dropped indices) is not counted twice. Validation questions lost the same way
are the evaluator's (``services.trainer.evaluation``): counted wrong, never replaced. Both follow the stream with
:func:`follow_dead_letters` and tell whose a letter is from :func:`lost_task`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from proto.base import decode
from proto.handback import handback_key
from proto.messages import DeadLetter, TaskRef
from proto.streams import DEAD_LETTERS, EVALS, PROMPTS, SCORED, TRAJECTORIES
from services.bus import Bus
from services.bus.dead_lettering import DECODE_INLINE_BYTES
from services.trainer.checkpoints import prompt_index

K = TypeVar("K")  # what a letter is lost as: a prompt index, a validation question's position

__all__ = ["LostPrompt", "follow_dead_letters", "lost_prompt", "lost_task"]

# the streams whose messages carry a prompt task (a ScoredGroup carries it in its group): where a
# letter an older pbsd made does not name its task, the payload tells
_CARRIERS = {s.name: s.model for s in (PROMPTS, TRAJECTORIES, SCORED, EVALS)}
_TRAINING = {PROMPTS.name, TRAJECTORIES.name, SCORED.name}  # EVALS carries validation groups only


def lost_task(letter: DeadLetter) -> TaskRef | None:
    """The prompt task whose message ``letter`` holds (the task's copy, or a group that answers
    it), else None (a stream without prompts, or a payload that did not decode: whose it was
    cannot be told)."""
    model = _CARRIERS.get(letter.stream)
    if model is None:
        return None
    if letter.task is not None:
        return letter.task
    try:
        return decode(model, letter.payload).task_ref()
    except ValueError:
        return None


class LostPrompt(NamedTuple):
    index: int  # the prompt's place in the run's data order
    message_id: str  # of the message lost: the prompt's copy, or the group that answers it


def lost_prompt(letter: DeadLetter, run_id: str) -> LostPrompt | None:
    """Run ``run_id``'s training prompt that ``letter`` loses, else None (another run's message, a
    validation prompt or group, a stream without prompts, or an undecodable payload)."""
    task = lost_task(letter) if letter.stream in _TRAINING else None
    if task is None or task.run_id != run_id:
        return None
    if task.purpose not in (None, "train"):
        return None
    index = prompt_index(task.task_id)
    return None if index is None else LostPrompt(index, task.message_id)


async def follow_dead_letters(
    bus: Bus,
    pick: Callable[[DeadLetter], K | None],
    on_lost: Callable[[K, DeadLetter], Awaitable[None]],
    stop: asyncio.Event,
    *,
    after: str,
) -> None:
    """Call ``on_lost(key, letter)`` for every dead letter that ``pick`` gives a key (not None), from
    entry ``after`` on, then as they arrive, until ``stop``; through lost connections (a follower
    that died would leave the run waiting for good for a prompt it never replaced). A lost prompt's
    copy takes with it what a rollout worker kept of its group (:mod:`proto.handback`): a worker
    that died sampling it, each time it was delivered, left a keep nobody goes on with, of up to
    the group's size (hundreds of MB with routes), which would otherwise stay for its hour."""

    async def see(_entry_id: str, letter: DeadLetter) -> None:
        # a letter an older pbsd made is decoded, a large one off the event loop
        slow = letter.task is None and len(letter.payload) > DECODE_INLINE_BYTES
        key = await asyncio.to_thread(pick, letter) if slow else pick(letter)
        if key is not None:
            await on_lost(key, letter)
            if letter.stream == PROMPTS.name and letter.task is not None:  # a group's letter: it was out
                await bus.forget(handback_key(letter.task.message_id))  # never raises

    await bus.follow_for_good(DEAD_LETTERS, after, see, stop, reader="the trainer", block_ms=500)
