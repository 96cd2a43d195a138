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
"""

from __future__ import annotations

import numpy as np

from proto.base import derived_id
from proto.data import QuestionRecord
from proto.messages import PromptTask
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
    ) -> None:
        if not questions:
            raise ValueError("the run has no questions")
        self.bus = bus
        self.run_id = run_id
        self.spec = spec
        self.questions = questions[: spec.data.max_questions] if spec.data.max_questions else questions
        self.next_index = next_index
        self.timeline = timeline
        self._orders: dict[int, np.ndarray] = {}

    @property
    def total(self) -> int:
        return len(self.questions) * self.spec.data.epochs

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng(self.spec.data.shuffle_seed + epoch)
            self._orders[epoch] = rng.permutation(len(self.questions))
        return self._orders[epoch]

    def task(self, index: int, current_step: int = 0) -> PromptTask:
        """Prompt ``index``, labelled with the step meant to train on it: its place in the data order,
        but never beyond what the rollout may sample now (replacements for dropped groups would
        otherwise wait for a policy version that only they could bring)."""
        d = len(self.questions)
        epoch, position = divmod(index, d)
        q = self.questions[int(self.order(epoch)[position])]
        return question_task(
            q,
            message_id=derived_id(
                self.run_id, "prompt", str(index), *([self.timeline] if self.timeline else [])
            ),
            run_id=self.run_id,
            task_id=f"{self.run_id}:{index}",
            epoch=epoch,
            index=index,
            step=min(
                index // self.spec.trainer.prompts_per_step, current_step + self.spec.rollout.max_staleness
            ),
            rollout=self.spec.rollout,
            algorithm=self.spec.algorithm,
            seed=self.spec.trainer.seed,
        )

    def allowed(self, step: int, dropped: int) -> int:
        """How many prompts may be out by the time ``step`` trains."""
        per_step = self.spec.trainer.prompts_per_step
        return min(self.total, (step + 1 + self.spec.rollout.max_staleness) * per_step + dropped)

    async def republish(self, indices: list[int], step: int) -> None:
        """After a crash, the prompts that were out at the checkpoint: groups sampled from them may
        have been trained on in steps the checkpoint lost (and acknowledged), or dropped without
        their replacement surviving. Under the new timeline's message ids the rollout samples them
        again; a group that does arrive twice is the same trajectories, trained once."""
        for index in indices:
            await self.bus.publish(PROMPTS, self.task(index, step))

    async def top_up(self, step: int, dropped: int) -> int:
        """Publish prompts up to the allowance; returns how many were published."""
        published = 0
        while self.next_index < self.allowed(step, dropped):
            await self.bus.publish(PROMPTS, self.task(self.next_index, step))
            self.next_index += 1
            published += 1
        return published
