"""Validation during a run: the rollout workers sample the held-out questions, the trainer counts.

A round evaluates one policy version ``v``: one prompt task per validation question, with
``purpose="eval"``, ``rollout.eval_samples`` samples at ``rollout.eval_top_p``, and step ``v``
with no staleness allowed (so no worker samples it with a policy older than ``v``; a worker
already past ``v`` uses its newer one, and the record says which versions answered). The
groups come back on the evals stream, unscored. When every question of a round is back, its
record goes to ``evals.jsonl`` in the run's folder, the run store (``GET /runs/{id}/evals``)
and Prometheus: mean@k and pass@k overall and per difficulty, exactly as ``pbsd eval``
reports them (:func:`pbsd.accuracy.summarise`), failed samples counted wrong.

Rounds: before the first step (version 0), every ``trainer.eval_every`` steps, and after the
last step; the run completes once the last round is in. Task ids carry a per-execution
nonce: a resumed run evaluates afresh instead of colliding with what an earlier execution
published (evaluation has no side effect worth deduplicating).

A question whose prompt or group a consumer dead-letters (``services.bus``) never comes back:
the evaluator follows the dead-letter stream beside the evals stream, and counts such a
question as lost, its samples failed (so wrong), instead of leaving the round, and with the
last round the run, waiting for it. The record lists the lost questions.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from pbsd.accuracy import summarise
from proto.base import derived_id
from proto.data import QuestionRecord
from proto.messages import DeadLetter, Trajectory, TrajectoryGroup
from proto.runs import RunSpec
from proto.streams import EVALS, PROMPTS
from services.bus import Bus, ConsumerOptions, Delivery
from services.tasks import within
from services.trainer import metrics as m
from services.trainer.beside import stop_task
from services.trainer.controller import question_task
from services.trainer.dead_letters import follow_dead_letters, lost_task
from services.trainer.run_groups import evals_group
from services.trainer.runs import RunStore
from services.trainer.timelines import lost_weights

log = logging.getLogger(__name__)

__all__ = ["Evaluator", "lost_question"]


def lost_question(letter: DeadLetter, prefix: str) -> tuple[int, int] | None:
    """``(version, question index)`` of the validation question ``letter`` loses, if its message
    was one of the tasks whose ids start with ``prefix`` (a run's execution), else None."""
    task = lost_task(letter)
    if task is None or not task.task_id.startswith(prefix):
        return None
    return _position(task.task_id, prefix)


class _Sample(NamedTuple):
    """What a round's record takes of one validation trajectory."""

    reward: float
    finish_reason: str
    num_turns: int
    policy_version: int

    @classmethod
    def of(cls, t: Trajectory) -> _Sample:
        return cls(t.reward, t.finish_reason, t.num_turns, t.policy_version)


def _position(task_id: str, prefix: str) -> tuple[int, int]:
    """``(version, question index)`` from a validation task id ``{prefix}{version}:{index}``."""
    version, index = (int(x) for x in task_id[len(prefix) :].split(":"))
    return version, index


class Evaluator:
    def __init__(
        self,
        bus: Bus,
        store: RunStore,
        run_id: str,
        spec: RunSpec,
        questions: list[QuestionRecord],
        out: Path,
        *,
        nonce: str,
        letters_after: str = "0-0",
        timeline: str = "",
        lineage: dict[str, int] | None = None,
    ) -> None:
        """``letters_after``: where the run's dead letters begin (RunStore.letters_after);
        ``timeline``, ``lineage``: the execution's weights timeline, whose versions the rounds name,
        and the versions of earlier ones it goes on from (services.trainer.timelines)."""
        if not questions:
            raise ValueError("the run's validation file has no questions")
        self.bus = bus
        self.store = store
        self.run_id = run_id
        self.spec = spec
        self.questions = questions[: spec.data.max_validation_questions]
        self.out = out
        self.nonce = nonce
        self.letters_after = letters_after
        self.timeline = timeline
        self.lineage = lineage or {}
        self.rollout = spec.rollout.model_copy(
            update={
                "group_size": spec.rollout.eval_samples,
                "top_p": spec.rollout.eval_top_p,
                "max_staleness": 0,
            }
        )
        # version -> question index -> its samples, or None for a question lost to the dead letters
        self.pending: dict[int, dict[int, tuple[_Sample, ...] | None]] = {}
        self.steps: dict[int, int] = {}  # version -> the step it was taken after
        self.recording: set[int] = set()  # complete rounds being stored (still pending)
        self.stored: set[int] = set()  # rounds in the run's store
        self.done = asyncio.Event()  # set when a round is recorded
        self.recorded: list[dict[str, Any]] = []
        self.task: asyncio.Task | None = None
        self.stop = asyncio.Event()  # ends the collecting task (see start)

    def due(self, step: int) -> bool:
        every = self.spec.trainer.eval_every
        return every > 0 and step % every == 0

    def unrecorded(self, step: int) -> list[int]:
        """The steps up to ``step`` whose rounds are due (before the first step, and every
        ``eval_every``) and not recorded. An opening starts them all: besides its own step's round
        (cut short by a stop or a crash), a round still out when the checkpoint was taken went with
        the execution that published it (its task ids carry that execution's nonce)."""
        every = self.spec.trainer.eval_every
        due = [0, *range(every, step + 1, every)] if every > 0 else [0]
        done = {r["step"] for r in self.recorded}
        return [s for s in due if s not in done]

    async def start_round(self, version: int, step: int) -> None:
        if version in self.pending or any(r["version"] == version for r in self.recorded):
            return
        self.pending[version] = {}
        self.steps[version] = step
        for i in range(len(self.questions)):
            await self.bus.publish(PROMPTS, self._task(version, i))
        log.info("run %s: evaluating version %d on %d questions", self.run_id, version, len(self.questions))

    def _task(self, version: int, i: int, *again: str):
        """Question ``i`` of round ``version``; ``again``: what makes a copy's message id its own."""
        return question_task(
            self.questions[i],
            message_id=derived_id(self.run_id, "eval", self.nonce, str(version), str(i), *again),
            run_id=self.run_id,
            task_id=f"{self.run_id}:eval:{self.nonce}:{version}:{i}",
            index=i,  # with the run's seed: each round samples question i with the same seeds
            seed=self.spec.trainer.seed,
            step=version,
            timeline=self.timeline,
            rollout=self.rollout,
            algorithm=self.spec.algorithm,
            purpose="eval",
        )

    @property
    def prefix(self) -> str:
        """The task ids of this execution's validation questions start with it."""
        return f"{self.run_id}:eval:{self.nonce}:"

    def start(self, options: ConsumerOptions) -> None:
        """Collect validation groups, and the questions lost to dead letters, in ``self.task``,
        beside the training loop, until ``self.stop``."""
        self.task = asyncio.create_task(self._collect(options))

    async def close(self) -> None:
        """End the collecting task; raise what it failed with, if anything."""
        if self.task is not None:
            await stop_task(self.task, self.stop)

    async def _collect(self, options: ConsumerOptions) -> None:
        consume = self.bus.consume(
            EVALS, "trainer", self._handle, group=evals_group(self.run_id), options=options, stop=self.stop
        )
        pick = functools.partial(lost_question, prefix=self.prefix)
        follow = follow_dead_letters(self.bus, pick, self._lost, self.stop, after=self.letters_after)
        await asyncio.gather(consume, follow)

    async def _lost(self, position: tuple[int, int], letter: DeadLetter) -> None:
        version, index = position
        log.warning(
            "run %s: validation question %d of version %d was dead-lettered on %s (%s); counted wrong",
            self.run_id,
            index,
            version,
            letter.stream,
            letter.cause[:200],
        )
        await self._arrived(version, index, None)

    async def _handle(self, group: TrajectoryGroup, delivery: Delivery) -> None:
        if not group.task_id.startswith(self.prefix):
            return  # another run's, or an earlier execution's: acknowledged and forgotten
        version, index = _position(group.task_id, self.prefix)
        lost = lost_weights(group.policy_timelines, current=self.timeline, lineage=self.lineage)
        if lost is not None and version in self.pending and index not in self.pending[version]:
            # sampled with weights a resume discarded (a worker that had not yet heard of it): the
            # question is asked again, as the trainer asks a training prompt's again
            log.warning(
                "run %s: validation question %d of version %d was answered by version %d of timeline %s, "
                "which a resume discarded; asking it again",
                self.run_id,
                index,
                version,
                lost[1],
                lost[0],
            )
            await self.bus.publish(PROMPTS, self._task(version, index, "again", group.message_id))
            return
        await self._arrived(version, index, group)

    async def _arrived(self, version: int, index: int, group: TrajectoryGroup | None) -> None:
        round_ = self.pending.get(version)
        if round_ is None:
            return  # a round recorded already
        if group is not None or index not in round_:  # a question's group came before its copy died
            # by position: a validation file may repeat an id. What the record needs of each sample
            # only: a round of hundreds of groups with their routes held tens of GB until it was in
            round_[index] = None if group is None else tuple(map(_Sample.of, group.trajectories))
        # complete, it is stored here; an arrival tried again after storing failed stores it then
        await self._complete(version)

    async def _complete(self, version: int) -> None:
        """Store round ``version`` if every question of it is in (and no one is storing it now)."""
        round_ = self.pending.get(version)
        if round_ is not None and len(round_) == len(self.questions) and version not in self.recording:
            # the round stays pending until it is stored: ``wait`` returning on a round still being
            # written let the run stop the consumer mid-write, and the last round was lost
            self.recording.add(version)
            try:
                await self._record(version, round_)
                del self.pending[version], self.steps[version]
            finally:
                self.recording.discard(version)

    async def _record(self, version: int, groups: dict[int, tuple[_Sample, ...] | None]) -> None:
        k = self.spec.rollout.eval_samples
        # a lost question's k samples count as failed, as an error trajectory's does
        results = {str(i): [t.reward > 0 for t in g] if g else [False] * k for i, g in groups.items()}
        trajectories = [t for g in groups.values() if g is not None for t in g]
        lost = sorted(i for i, g in groups.items() if g is None)
        record = {
            "version": version,
            "step": self.steps[version],
            "versions_used": sorted({t.policy_version for t in trajectories}),
            "samples": k,
            "questions": len(groups),
            "accuracy": summarise(results, {str(i): q.difficulty for i, q in enumerate(self.questions)}, k),
            "failed": sum(t.finish_reason == "error" for t in trajectories) + k * len(lost),
            "lost": lost,
            "mean_turns": statistics.fmean(t.num_turns for t in trajectories) if trajectories else 0.0,
        }
        if version not in self.stored:  # its file write failed after it: not listed twice
            await self.store.add_eval(self.run_id, record)
            self.stored.add(version)
        with (self.out / "evals.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.recorded.append(record)
        m.VAL_ACCURACY.set(record["accuracy"]["all"][f"mean@{k}"])
        log.info(
            "run %s: version %d scores mean@%d %.3f on %d questions",
            self.run_id,
            version,
            k,
            record["accuracy"]["all"][f"mean@{k}"],
            len(groups),
        )
        self.done.set()

    async def wait(self, cancel: asyncio.Event) -> bool:
        """Until every started round is recorded (True), or ``cancel`` is set first (False). Raises
        what ended the collecting task, if it died (a run must not wait for groups nobody reads)."""
        while self.pending:
            if cancel.is_set():
                return False
            if self.task is not None and self.task.done():
                error = None if self.task.cancelled() else self.task.exception()
                raise RuntimeError("the validation consumer stopped with rounds outstanding") from error
            await within(0.5, self.done.wait())
            self.done.clear()
            # a complete round whose storing failed as often as its arrival was tried (a long outage,
            # a full disk) has nothing left to arrive and try again: it is tried from here
            for version in list(self.pending):
                try:
                    await self._complete(version)
                except Exception:
                    log.warning(
                        "run %s: storing round %d failed; trying again", self.run_id, version, exc_info=True
                    )
        return True
