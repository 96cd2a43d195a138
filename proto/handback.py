"""What a rollout worker keeps of a group it has begun: the trajectories it finished, and the
turns of the others, so the worker that takes the prompt next goes on from there.

A group at the paper's settings is G trajectories of up to hundreds of turns and 64K tokens: a
scale-down or a rolling restart that dropped it would throw away minutes of every GPU that
sampled it. The worker stores a :class:`HandedBack` under the prompt task's message id
(:func:`handback_key`) for a while, as it leaves and every so often as it samples (so a worker
killed outright leaves its last keep), and the next delivery of that task reads it and goes on
from there; the group's publication removes it. An unfinished trajectory is cut at the end of
its last whole exchange, a turn and the tool results after it: the turn the engine was
generating, or the tool calls it was waiting on, are done again.

Coordinates are those of :class:`proto.messages.Trajectory`, except ``routed_experts``, which
covers the positions the engine has routed so far: up to the last turn's last token, whose
tool results are routed as the next turn is generated.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from proto.arrays import Float32Array, Int32Array, RoutedExpertsArray, Uint8Array
from proto.base import Contract, Message
from proto.messages import NonNegInt, ToolCall, Trajectory, check_turns

__all__ = ["HandedBack", "UnfinishedTrajectory", "handback_key"]


class UnfinishedTrajectory(Contract):
    trajectory_id: str = Field(min_length=1)
    sample_index: NonNegInt
    prompt_ids: Int32Array
    completion_ids: Int32Array
    loss_mask: Uint8Array
    rollout_logprobs: Float32Array
    turn_spans: tuple[tuple[NonNegInt, NonNegInt], ...] = Field(min_length=1)
    routed_experts: RoutedExpertsArray | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    versions: tuple[NonNegInt, ...] = Field(
        min_length=1, description="the policy version each turn was generated with, in turn order"
    )
    attempt: str = Field(
        min_length=1, description="the tool gateway's budget id: the calls made so far count against it"
    )
    generation_s: Annotated[float, Field(ge=0)] = 0.0

    @model_validator(mode="after")
    def _aligned(self):
        if len(self.versions) != len(self.turn_spans):
            raise ValueError(f"{len(self.versions)} versions for {len(self.turn_spans)} turns")
        last_end = check_turns(self)
        if last_end == self.completion_ids.size:
            raise ValueError("an unfinished trajectory ends with the tool results of its last turn")
        # the engine routed every position it was fed or wrote but its last turn's last token
        routed = self.prompt_ids.size + last_end - 1
        if self.routed_experts is not None and self.routed_experts.shape[0] != routed:
            raise ValueError(
                f"routed_experts covers {self.routed_experts.shape[0]} positions, expected {routed}"
            )
        return self

    @property
    def policy_version(self) -> int:
        return min(self.versions)

    num_tokens = Trajectory.num_tokens  # prompt and completion, as a finished one counts them


class HandedBack(Message):
    """A group's sampling as a leaving worker left it: one entry per trajectory it had begun."""

    run_id: str = Field(min_length=1)
    task_message_id: str = Field(min_length=1)
    policy_timelines: dict[str, NonNegInt] = Field(
        default_factory=dict, description="as TrajectoryGroup.policy_timelines, of the work kept here"
    )
    finished: tuple[Trajectory, ...] = ()
    unfinished: tuple[UnfinishedTrajectory, ...] = ()

    @model_validator(mode="after")
    def _distinct(self):
        indices = [t.sample_index for t in (*self.finished, *self.unfinished)]
        if len(set(indices)) != len(indices):
            raise ValueError("each sample index is handed back at most once")
        return self

    def of(self, sample_index: int) -> Trajectory | UnfinishedTrajectory | None:
        """What is kept of sample ``sample_index``, finished or not; None: nothing."""
        return next((t for t in (*self.finished, *self.unfinished) if t.sample_index == sample_index), None)

    @property
    def tokens(self) -> int:
        """Tokens kept, prompts and completions: what the value's size grows with."""
        return sum(t.num_tokens for t in (*self.finished, *self.unfinished))

    @property
    def policy_version(self) -> int | None:
        """The oldest version any of the kept work was sampled with (None: nothing is kept)."""
        versions = [t.policy_version for t in (*self.finished, *self.unfinished)]
        return min(versions, default=None)


def handback_key(task_message_id: str) -> str:
    """The name, under the bus's prefix, a task's handed-back sampling is kept under."""
    return f"handback:{task_message_id}"
