"""Messages that travel between the services on the bus.

Coordinates. A trajectory is ``prompt_ids`` (the system prompt and question up to
where the first assistant message begins) followed by ``completion_ids``. Every
per-token array of a trajectory (``loss_mask``, ``rollout_logprobs``) is aligned with
``completion_ids``. ``turn_spans`` are half-open ``[start, end)`` ranges of
``completion_ids``, one per assistant turn, covering exactly the tokens the policy
generated (``loss_mask == 1``); tool results and template glue between them have
``loss_mask == 0``. ``routed_experts[j]`` are the experts that routed position j of
``prompt_ids + completion_ids`` (all but the last token, as SGLang reports them).
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from proto.arrays import Float32Array, Int32Array, RoutedExpertsArray, Uint8Array
from proto.base import Contract, Message, derived_id
from proto.runs import AlgorithmSpec, RolloutSpec, Seed
from proto.sanity import NoiseFloor, TeacherSanity

__all__ = [
    "FINISH_REASONS",
    "DeadLetter",
    "PromptTask",
    "RunEnded",
    "ScoreDiagnostics",
    "ScoredGroup",
    "TaskRef",
    "ToolCall",
    "Trajectory",
    "TrajectoryGroup",
    "WeightsPublished",
    "check_turns",
    "group_message_id",
]

NonNegInt = Annotated[int, Field(ge=0)]

# Why a trajectory ended: a final \boxed{} answer; the turn limit; one turn hit the
# per-turn token budget; the context limit; or an error (engine or gateway down), with
# the cause in ``Trajectory.error``.
FINISH_REASONS = ("answer", "max_turns", "max_tokens", "max_context", "error")
FinishReason = Literal["answer", "max_turns", "max_tokens", "max_context", "error"]


def _now() -> float:
    return time.time()


class TaskRef(Contract):
    """Whose work a message is: the prompt task it carries (a PromptTask) or answers (a group)."""

    run_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1)
    message_id: str = Field(min_length=1, description="the message's own id: the task's copy, or the group")
    purpose: Literal["train", "eval"] | None = Field(
        default=None, description="a PromptTask's; None for a group (its stream tells)"
    )


class PromptTask(Message):
    """One prompt for the rollout workers: sample ``rollout.group_size`` trajectories."""

    run_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1, description="unique per (run, epoch, position in the data order)")
    question_id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    answer: str = Field(
        min_length=1, description="the verified answer y*, used by the verifier and the teacher only"
    )
    aliases: tuple[str, ...] = ()
    support: tuple[str, ...] = Field(
        default=(), description="the question's supporting facts, for a teacher template with {support}"
    )
    epoch: NonNegInt = 0
    index: NonNegInt = Field(default=0, description="position in the epoch's shuffled order")
    step: NonNegInt = Field(
        default=0,
        description="the training step that will consume this prompt's group; "
        "rollout waits for policy version >= step - rollout.max_staleness",
    )
    timeline: str = Field(
        default="",
        max_length=64,
        description="the weights timeline of the trainer execution that published it, whose versions "
        "``step`` counts: once a newer timeline of the run is announced (a resume), the label no longer "
        "holds the prompt back",
    )
    rollout: RolloutSpec = RolloutSpec()
    algorithm: AlgorithmSpec
    seed: Seed | None = Field(
        default=None,
        description="the run's sampling seed (trainer.seed): sample i of this prompt is seeded from "
        "seed + i + 1000 * index, whichever worker takes it; None: the worker's own setting",
    )
    purpose: Literal["train", "eval"] = Field(
        default="train",
        description="eval: a validation prompt, sampled with policy version >= step; its group goes to "
        "the evals stream (to the trainer, unscored) instead of the trajectories stream",
    )
    created_at: float = Field(default_factory=_now)

    def task_ref(self) -> TaskRef:
        return TaskRef(
            run_id=self.run_id, task_id=self.task_id, message_id=self.message_id, purpose=self.purpose
        )


class ToolCall(Contract):
    turn: NonNegInt
    server_name: str
    tool_name: str
    arguments: dict[str, Any]
    ok: bool
    error: str | None = None
    latency_s: Annotated[float, Field(ge=0)] = 0.0
    # False: the agent did not send it (malformed, or past a message's call limit), so it holds no
    # place in the tool gateway's call budget
    sent: bool = True


class Trajectory(Contract):
    trajectory_id: str = Field(min_length=1)
    sample_index: NonNegInt
    policy_version: NonNegInt
    prompt_ids: Int32Array
    completion_ids: Int32Array
    loss_mask: Uint8Array
    rollout_logprobs: Float32Array
    turn_spans: tuple[tuple[NonNegInt, NonNegInt], ...]
    routed_experts: RoutedExpertsArray | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    final_answer: str | None = None
    reward: float = 0.0
    finish_reason: FinishReason
    error: str | None = None
    generation_s: Annotated[float, Field(ge=0)] = 0.0

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.size + self.completion_ids.size)

    def token_turns(self) -> np.ndarray:
        """Turn index of every loss token, in completion order."""
        lengths = [end - start for start, end in self.turn_spans]
        return np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be finite")
        return v

    @model_validator(mode="after")
    def _aligned(self):
        check_turns(self)
        if self.routed_experts is not None:
            want = self.prompt_ids.size + self.completion_ids.size - 1
            if self.routed_experts.shape[0] != want:
                raise ValueError(
                    f"routed_experts covers {self.routed_experts.shape[0]} positions, expected {want} (all tokens but the last)"
                )
        if self.finish_reason == "error" and not self.error:
            raise ValueError("a trajectory that ended in error must say why in `error`")
        return self


def check_turns(t: Any) -> int:
    """Raise ValueError unless ``t``'s per-token arrays align with its ``completion_ids`` and its
    ``turn_spans`` are ordered, non-empty and exactly where ``loss_mask`` is 1 (a finished or an
    unfinished trajectory, :mod:`proto.handback`); the end of its last turn."""
    n = t.completion_ids.size
    for name in ("loss_mask", "rollout_logprobs"):
        if getattr(t, name).size != n:
            raise ValueError(f"{name} has {getattr(t, name).size} entries but completion_ids has {n}")
    if t.loss_mask.size and t.loss_mask.max() > 1:
        raise ValueError("loss_mask must be 0 or 1")
    expected = np.zeros(n, dtype=np.uint8)
    prev_end = 0
    for i, (start, end) in enumerate(t.turn_spans):
        if not (prev_end <= start < end <= n):
            raise ValueError(
                f"turn_spans[{i}]={start, end} must be non-empty, ordered and inside the completion (length {n})"
            )
        expected[start:end] = 1
        prev_end = end
    if not np.array_equal(expected, t.loss_mask):
        raise ValueError("loss_mask must be 1 exactly on the tokens of turn_spans")
    return prev_end


def group_message_id(task_message_id: str) -> str:
    """The message id of the group that answers the prompt task ``task_message_id``: every
    delivery of one task publishes its group under one id, so a consumer processes it once, and
    whoever published the task can tell its group's messages (a dead letter's, say) from another
    copy's."""
    return derived_id(task_message_id, "group")


class TrajectoryGroup(Message):
    """The G trajectories of one prompt, with what the scorer and trainer need to know about it."""

    run_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1)
    question_id: str = Field(min_length=1)
    question: str
    answer: str
    aliases: tuple[str, ...] = ()
    support: tuple[str, ...] = ()
    policy_version: NonNegInt = Field(
        description="the oldest policy version any of the trajectories was sampled with"
    )
    policy_timelines: dict[str, NonNegInt] = Field(
        default_factory=dict,
        description="every weights timeline (WeightsPublished.timeline) the sampling worker held while it "
        "sampled the group, with the newest version of it held; the trainer drops the group when any of "
        "them is a version a resume discarded. Empty: the sender does not say (version rules only)",
    )
    algorithm: AlgorithmSpec
    trajectories: tuple[Trajectory, ...] = Field(min_length=1)
    created_at: float = Field(default_factory=_now)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([t.reward for t in self.trajectories], dtype=np.float64)

    def without_bulk(self) -> TrajectoryGroup:
        if all(t.routed_experts is None for t in self.trajectories):
            return self
        trajectories = tuple(t.model_copy(update={"routed_experts": None}) for t in self.trajectories)
        return self.model_copy(update={"trajectories": trajectories})

    def task_ref(self) -> TaskRef:
        return TaskRef(run_id=self.run_id, task_id=self.task_id, message_id=self.message_id)

    @model_validator(mode="after")
    def _unique(self):
        ids = [t.trajectory_id for t in self.trajectories]
        if len(set(ids)) != len(ids):
            raise ValueError("trajectory ids within a group must be unique")
        if min(t.policy_version for t in self.trajectories) != self.policy_version:
            raise ValueError("policy_version must be the oldest version among the trajectories")
        return self


class ScoreDiagnostics(Contract):
    """What the paper plots about the credit signal (figure 3), for one group."""

    turns: NonNegInt = 0
    scored_turns: NonNegInt = Field(default=0, description="turns with at least one aligned token")
    teacher_higher_frac: Annotated[float, Field(ge=0, le=1)] = 0.0
    mean_abs_gap: Annotated[float, Field(ge=0)] = 0.0
    filtered_frac: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.0, description="scored turns inside the deadband"
    )
    unaligned_tokens: NonNegInt = Field(
        default=0, description="loss tokens without a teacher position (truncated x*)"
    )
    evidence: Float32Array = Field(
        default_factory=lambda: np.zeros(0, np.float32), description="every scored turn's s"
    )
    sanity: TeacherSanity = Field(
        default=TeacherSanity(), description="does the teacher read x*: scored turns by kind (proto.sanity)"
    )
    noise: NoiseFloor = Field(
        default=NoiseFloor(), description="the null pass: the evidence's numerical noise floor (proto.sanity)"
    )


class ScoredGroup(Message):
    """A trajectory group with advantages and, for PBSD, per-turn evidence and weights."""

    group: TrajectoryGroup
    advantages: Float32Array = Field(description="A_i per trajectory")
    turn_evidence: tuple[Float32Array, ...] = Field(
        description="s_{i,t} per trajectory and turn; NaN where unscored"
    )
    turn_weights: tuple[Float32Array, ...] = Field(description="w_{i,t}; all ones for GRPO")
    scored: bool = Field(description="False when the group passed through without likelihood passes (GRPO)")
    scorer_policy_version: NonNegInt | None = None
    diagnostics: ScoreDiagnostics = ScoreDiagnostics()
    scoring_s: Annotated[float, Field(ge=0)] = 0.0

    def without_bulk(self) -> ScoredGroup:
        slim = self.group.without_bulk()
        return self if slim is self.group else self.model_copy(update={"group": slim})

    def task_ref(self) -> TaskRef:
        return self.group.task_ref()

    @model_validator(mode="after")
    def _shapes(self):
        trajs = self.group.trajectories
        if self.advantages.size != len(trajs):
            raise ValueError(f"advantages has {self.advantages.size} entries for {len(trajs)} trajectories")
        for name in ("turn_evidence", "turn_weights"):
            arrays = getattr(self, name)
            if len(arrays) != len(trajs):
                raise ValueError(f"{name} has {len(arrays)} entries for {len(trajs)} trajectories")
            for i, (arr, traj) in enumerate(zip(arrays, trajs, strict=True)):
                if arr.size != traj.num_turns:
                    raise ValueError(f"{name}[{i}] has {arr.size} entries for {traj.num_turns} turns")
        return self

    def scored_turns(self) -> tuple[np.ndarray, np.ndarray]:
        """Evidence and token count of every scored turn (s not NaN), over all trajectories: what a
        noise floor judges (``NoiseFloor.within``). A turn's tokens are its span's (where x* was cut,
        its aligned tokens are fewer)."""
        s = (
            np.concatenate([np.asarray(e, np.float64) for e in self.turn_evidence])
            if self.turn_evidence
            else np.zeros(0)
        )
        n = np.array(
            [end - start for t in self.group.trajectories for start, end in t.turn_spans], np.float64
        )
        keep = ~np.isnan(s)
        return s[keep], n[keep]

    def token_advantages(self, index: int) -> np.ndarray:
        """Per-completion-token advantage of trajectory ``index`` (0 outside the loss mask)."""
        traj = self.group.trajectories[index]
        out = np.zeros(traj.completion_ids.size, dtype=np.float32)
        weights = self.turn_weights[index]
        for turn, (start, end) in enumerate(traj.turn_spans):
            out[start:end] = weights[turn] * self.advantages[index]
        return out


class WeightsPublished(Message):
    """A new policy version. ``transport`` "disk": it is at ``path``, and every consumer reloads from
    there. "broadcast": the trainer has already sent it over a ``torch.distributed`` group to the
    consumers in that group (SGLang's distributed weight update); a consumer still behind it missed
    the broadcast and falls back to the newest copy on disk, ``path``, which holds ``path_version``.

    ``(timeline, version)`` names the weights: a trainer that resumes a run from a checkpoint
    starts a new timeline, and the versions an earlier timeline published after that checkpoint
    are lost (its version numbers come again, with other weights). Within the timeline a resume
    starts, the versions up to the checkpoint's are the same weights as before."""

    run_id: str = Field(min_length=1)
    version: NonNegInt
    step: NonNegInt
    path: str = Field(min_length=1, description="Hugging Face checkpoint directory (safetensors)")
    format: Literal["safetensors"] = "safetensors"
    timeline: str = Field(
        default="",
        max_length=64,
        description="the publishing trainer's timeline, a nonce each opening of the run (start or resume) "
        "draws; empty from a publisher that does not say",
    )
    created_at: float = Field(default_factory=_now)
    transport: Literal["disk", "broadcast"] = "disk"
    path_version: NonNegInt | None = Field(
        default=None,
        description="the version the checkpoint at path holds when it is not version (a broadcast "
        "whose newest disk copy is an older full checkpoint); None: version",
    )

    @model_validator(mode="after")
    def _disk_copy_is_not_newer(self):
        if self.path_version is not None and self.path_version > self.version:
            raise ValueError(f"path_version {self.path_version} is newer than version {self.version}")
        if self.transport == "disk" and self.path_version not in (None, self.version):
            raise ValueError("a disk publication holds its own version at path")
        return self

    def disk_copy(self) -> WeightsPublished:
        """The publication of the copy at ``path`` alone: what a consumer that missed a broadcast loads."""
        version = self.version if self.path_version is None else self.path_version
        return self.model_copy(update={"version": version, "transport": "disk", "path_version": None})


class RunEnded(Message):
    """A run has ended (completed, cancelled or failed): its prompts and groups still on the bus are
    work for no one, and workers drop them on sight."""

    run_id: str = Field(min_length=1)
    state: Literal["completed", "cancelled", "failed"]
    step: NonNegInt = 0
    created_at: float = Field(default_factory=_now)


class DeadLetter(Message):
    """An entry a consumer could not process, kept with the cause for an operator."""

    stream: str
    group: str
    entry_id: str
    cause: str
    deliveries: NonNegInt
    task: TaskRef | None = Field(
        default=None,
        description="the prompt task the message carries or answers, where it decodes to one: a "
        "trainer tells its run's lost prompts by this, without decoding the payload",
    )
    payload: bytes = Field(
        description="the original payload, or past the bus's DEAD_LETTER_PAYLOAD_BYTES what payload_kept says"
    )
    payload_kept: Literal["whole", "without_bulk", "head"] = Field(
        default="whole",
        description="without_bulk: the message without a group's routed experts (Message.without_bulk), "
        "which brought it under the limit; head: the payload's first DEAD_LETTER_PAYLOAD_BYTES",
    )
    payload_bytes: NonNegInt | None = Field(
        default=None, description="the original payload's size, where the payload kept is not whole"
    )
    created_at: float = Field(default_factory=_now)
