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

The stream is read from its start each time a run executes, so a prompt dead-lettered while the
trainer was down counts too; one already counted (in the checkpoint's dropped indices) is not
counted twice. Validation questions lost the same way are the evaluator's
(``services.trainer.evaluation``): counted wrong, never replaced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from proto.base import decode
from proto.messages import DeadLetter, PromptTask, ScoredGroup, TrajectoryGroup
from proto.streams import DEAD_LETTERS, PROMPTS, SCORED, TRAJECTORIES
from services.bus import Bus
from services.trainer.checkpoints import prompt_index

log = logging.getLogger(__name__)

__all__ = ["follow_dead_letters", "lost_prompt"]

_TRAINING = {s.name: s.model for s in (PROMPTS, TRAJECTORIES, SCORED)}


def lost_prompt(letter: DeadLetter, run_id: str) -> int | None:
    """The index of run ``run_id``'s training prompt that ``letter`` loses, else None (another run's
    message, a validation prompt, a stream without prompts, or a payload that does not decode)."""
    model = _TRAINING.get(letter.stream)
    if model is None:
        return None
    try:
        message = decode(model, letter.payload)
    except ValueError:
        return None  # undecodable: whose it was cannot be told
    if isinstance(message, PromptTask):
        if message.purpose != "train":
            return None
        task = message
    elif isinstance(message, ScoredGroup):
        task = message.group
    else:
        assert isinstance(message, TrajectoryGroup)
        task = message
    if task.run_id != run_id:
        return None
    return prompt_index(task.task_id)


async def follow_dead_letters(
    bus: Bus, run_id: str, on_lost: Callable[[int, DeadLetter], Awaitable[None]], stop: asyncio.Event
) -> None:
    """Call ``on_lost(index, letter)`` for every dead letter of the run's training prompts, from the
    stream's start, then as they arrive, until ``stop``."""
    async for _entry_id, letter in bus.follow(DEAD_LETTERS, after="0-0", block_ms=500, stop=stop):
        index = lost_prompt(letter, run_id)
        if index is not None:
            await on_lost(index, letter)
