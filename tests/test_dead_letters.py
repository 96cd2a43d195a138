"""Which dead letters lose a run's training prompt (services/trainer/dead_letters.py)."""

from __future__ import annotations

import numpy as np
import pytest

from proto.base import encode
from proto.messages import DeadLetter, PromptTask, ScoredGroup, Trajectory, TrajectoryGroup
from proto.runs import GrpoSpec
from services.trainer.dead_letters import lost_prompt


def _task(run_id: str = "run-a", index: int = 7, purpose: str = "train") -> PromptTask:
    return PromptTask(
        run_id=run_id,
        task_id=f"{run_id}:{index}",
        question_id="q",
        question="Which river flows through Vienna?",
        answer="Danube",
        index=index,
        algorithm=GrpoSpec(),
        purpose=purpose,
    )


def _group(run_id: str = "run-a", index: int = 7) -> TrajectoryGroup:
    task = _task(run_id, index)
    return TrajectoryGroup(
        run_id=run_id,
        task_id=task.task_id,
        question_id=task.question_id,
        question=task.question,
        answer=task.answer,
        policy_version=0,
        algorithm=task.algorithm,
        trajectories=(
            Trajectory(
                trajectory_id=f"{task.task_id}/0",
                sample_index=0,
                policy_version=0,
                prompt_ids=np.array([1, 2], np.int32),
                completion_ids=np.array([3], np.int32),
                loss_mask=np.ones(1, np.uint8),
                rollout_logprobs=np.zeros(1, np.float32),
                turn_spans=((0, 1),),
                reward=0.0,
                finish_reason="answer",
            ),
        ),
    )


def _scored() -> ScoredGroup:
    one = (np.zeros(1, np.float32),)
    return ScoredGroup(
        group=_group(), advantages=np.zeros(1, np.float32), turn_evidence=one, turn_weights=one, scored=False
    )


def _letter(stream: str, message) -> DeadLetter:
    payload = message if isinstance(message, bytes) else encode(message)
    return DeadLetter(stream=stream, group="g", entry_id="1-0", cause="x", deliveries=6, payload=payload)


@pytest.mark.parametrize(
    ("letter", "index"),
    [
        (_letter("prompts", _task()), 7),
        (_letter("trajectories", _group()), 7),
        (_letter("scored", _scored()), 7),
        (_letter("prompts", _task(run_id="run-b")), None),  # another run's
        (_letter("prompts", _task(purpose="eval")), None),  # a validation prompt: no training group
        (_letter("evals", _group()), None),  # validation groups
        (_letter("weights", b"\x80"), None),  # a stream without prompts
        (_letter("prompts", b"\xc1not msgpack"), None),  # whose it was cannot be told
    ],
    ids=["prompt", "trajectories", "scored", "other-run", "eval-prompt", "evals", "weights", "undecodable"],
)
def test_a_dead_letter_loses_the_runs_training_prompt_and_nothing_else(letter, index):
    lost = lost_prompt(letter, "run-a")
    assert (lost and lost.index) == index
