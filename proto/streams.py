"""Every Redis stream and consumer group of the pipeline, defined once.

    prompts       trainer (run controller) -> rollout workers      group "rollout"
    trajectories  rollout workers -> evidence scorers              group "scorer"
    scored        evidence scorers -> trainer                      group "trainer-<run id>"
    evals         rollout workers -> trainer (validation groups)   group "trainer-<run id>-evals"
    weights       trainer -> every rollout worker and scorer       broadcast (no group)
    run-ends      trainer -> every rollout worker and scorer       broadcast (no group)
    dead-letters  any consumer -> operators                        read by hand / dashboards

Keys are ``{prefix}:{name}`` so that several deployments can share one Redis. The trainer reads
``scored`` and ``evals`` through groups of each run's own (``services.trainer.run_groups``); the
group named here is the one runs shared before, which the trainer's start destroys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from proto.messages import (
    DeadLetter,
    PromptTask,
    RunEnded,
    ScoredGroup,
    TrajectoryGroup,
    WeightsPublished,
)

__all__ = [
    "ALL_STREAMS",
    "DEAD_LETTERS",
    "EVALS",
    "PROMPTS",
    "RUN_ENDS",
    "SCORED",
    "TRAJECTORIES",
    "WEIGHTS",
    "StreamDef",
]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class StreamDef(Generic[M]):
    name: str
    model: type[M]
    group: str | None  # the consumer group that works this stream; None for broadcast streams

    def key(self, prefix: str) -> str:
        return f"{prefix}:{self.name}"


PROMPTS = StreamDef("prompts", PromptTask, group="rollout")
TRAJECTORIES = StreamDef("trajectories", TrajectoryGroup, group="scorer")
SCORED = StreamDef("scored", ScoredGroup, group="trainer")
EVALS = StreamDef("evals", TrajectoryGroup, group="trainer")
WEIGHTS = StreamDef("weights", WeightsPublished, group=None)
RUN_ENDS = StreamDef("run-ends", RunEnded, group=None)
DEAD_LETTERS = StreamDef("dead-letters", DeadLetter, group=None)

ALL_STREAMS: tuple[StreamDef, ...] = (PROMPTS, TRAJECTORIES, SCORED, EVALS, WEIGHTS, RUN_ENDS, DEAD_LETTERS)
