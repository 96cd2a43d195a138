"""The run controller: turns the run's question set into prompt tasks on the bus.

The data order is fixed by the run: epoch e visits the questions in a permutation
seeded by ``shuffle_seed + e``; prompt ``index`` is position ``index mod D`` of epoch
``index div D``. A prompt is meant for training step ``index div prompts_per_step``
(what the rollout's staleness check reads), and the controller keeps the stream
bounded: it only publishes up to the prompts the next ``max_staleness + 1`` steps
need, plus one for every group the trainer had to drop.

Task ids depend only on the run and the index (trajectory ids, and so the trainer's
"trained once" check, follow from them), so publishing a prompt twice is harmless:
consumers process each message id once. Message ids also carry the run's timeline, a
nonce that a resume after a crash starts anew (see :meth:`PromptController.republish`).
A prompt published once more (after a crash, or because its group was sampled with weights a
resume discarded) goes ahead of every prompt still queued, labelled for the step training now,
so that it is sampled next and with current weights, not after the queue and stale.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from proto.base import derived_id
from proto.data import QuestionRecord
from proto.messages import PromptTask, group_message_id
from proto.runs import RunSpec
from proto.streams import PROMPTS
from services.bus import Bus

__all__ = ["PromptController", "question_task"]


def question_task(q: QuestionRecord, **fields) -> PromptTask:
    """The prompt task that asks ``q`` (training or validation: ``fields`` say which and when)."""
    return PromptTask(
        question_id=q.id, question=q.question, answer=q.answer, aliases=q.aliases, support=q.support, **fields
    )


class PromptController:
    def __init__(
        self,
        bus: Bus,
        run_id: str,
        spec: RunSpec,
        questions: list[QuestionRecord],
        *,
        next_index: int = 0,
        timeline: str = "",
        weights_timeline: str = "",
        on_published: Callable[[int], Awaitable[None]] | None = None,
        on_ahead: Callable[[dict[str, int]], Awaitable[None]] | None = None,
        copies: dict[str, int] | None = None,
    ) -> None:
        """``on_published(n)``: told after every publication that the first ``n`` prompts are out;
        ``on_ahead(copies)``: told before copies go out ahead of the queue (message id -> index);
        ``copies``: those an earlier execution of the run published."""
        if not questions:
            raise ValueError("the run has no questions")
        self.bus = bus
        self.run_id = run_id
        self.spec = spec
        self.questions = questions[: spec.data.max_questions] if spec.data.max_questions else questions
        self.next_index = next_index
        self.timeline = timeline
        self.weights_timeline = weights_timeline  # the versions its step labels count (PromptTask.timeline)
        self.on_published = on_published
        self.on_ahead = on_ahead
        # the message ids of the copies published ahead of the queue, and of their groups, in this
        # execution of the run and the ones before it, each with the prompt it is a copy of: a dead
        # letter about any other copy of such a prompt lost a copy that one replaced, and does not
        # say the prompt's group will never come (see RunExecutor._dead_lettered)
        self.copies: dict[str, int] = dict(copies or {})
        self._orders: dict[int, np.ndarray] = {}

    @property
    def total(self) -> int:
        return len(self.questions) * self.spec.data.epochs

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng(self.spec.data.shuffle_seed + epoch)
            self._orders[epoch] = rng.permutation(len(self.questions))
        return self._orders[epoch]

    def task(
        self, index: int, current_step: int = 0, *, again: str | None = None, place: int = 0
    ) -> PromptTask:
        """Prompt ``index``, labelled with the step meant to train on it: its place in the data order,
        but never beyond what the rollout may sample now (replacements for dropped groups would
        otherwise wait for a policy version that only they could bring). ``again``: the prompt is
        published once more, ahead of the queue, ``place`` prompts from its front: labelled with the
        step that place reaches from ``current_step``; its message id is derived from ``again`` too."""
        d = len(self.questions)
        epoch, position = divmod(index, d)
        q = self.questions[int(self.order(epoch)[position])]
        per_step, slack = self.spec.trainer.prompts_per_step, self.spec.rollout.max_staleness
        step = index // per_step if again is None else current_step + place // per_step
        parts = [p for p in (self.timeline, again) if p]
        return question_task(
            q,
            message_id=derived_id(self.run_id, "prompt", str(index), *parts),
            run_id=self.run_id,
            task_id=f"{self.run_id}:{index}",
            epoch=epoch,
            index=index,
            step=min(step, current_step + slack),
            timeline=self.weights_timeline,
            rollout=self.spec.rollout,
            algorithm=self.spec.algorithm,
            seed=self.spec.trainer.seed,
        )

    def allowed(self, step: int, dropped: int) -> int:
        """How many prompts may be out by the time ``step`` trains: never more than the run's
        last step trains on (the rollout would sample them for nothing as the run ends)."""
        per_step = self.spec.trainer.prompts_per_step
        ahead = min(step + 1 + self.spec.rollout.max_staleness, self.spec.trainer.max_steps)
        return min(self.total, ahead * per_step + dropped)

    async def republish(self, indices: list[int], step: int) -> None:
        """After a crash, the prompts whose groups the lost steps consumed (trained on or dropped, and
        acknowledged), ahead of the queue: under the new timeline's message ids the rollout samples
        them again; a group that does arrive twice is the same trajectories, trained once."""
        await self._ahead([self.task(index, step, again="", place=k) for k, index in enumerate(indices)])

    async def again(self, index: int, cause: str, step: int) -> None:
        """Prompt ``index`` once more, ahead of the queue: its group (message id ``cause``) was sampled
        with weights a resume discarded. The message id follows from the group's, so a redelivered
        group does not have its prompt sampled twice."""
        await self._ahead([self.task(index, step, again=cause)])

    async def _ahead(self, tasks: list[PromptTask]) -> None:
        copies = {i: t.index for t in tasks for i in (t.message_id, group_message_id(t.message_id))}
        if self.on_ahead is not None:  # before they go out: a crash after must find them
            await self.on_ahead(copies)
        self.copies.update(copies)
        await self.bus.publish_ahead(PROMPTS, tasks)

    async def top_up(self, step: int, dropped: int) -> int:
        """Publish prompts up to the allowance; returns how many were published."""
        published = 0
        while self.next_index < self.allowed(step, dropped):
            await self.bus.publish(PROMPTS, self.task(self.next_index, step))
            self.next_index += 1
            published += 1
            if self.on_published is not None:
                await self.on_published(self.next_index)
        return published
