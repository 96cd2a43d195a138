"""The learning-rate schedule of RL training: the paper's linear warm-up to the peak, then the peak
held, or (``trainer.lr_decay: cosine``) a cosine down to ``min_lr_ratio`` of it at ``max_steps``.
It counts training steps; a step of several updates (``trainer.updates_per_step``) takes them all
at its rate."""

from __future__ import annotations

import math

from proto.runs import TrainerSpec

__all__ = ["lr_factor", "update_schedule", "warmup_factor"]


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up to the peak learning rate over ``warmup_steps`` training steps, then constant."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def lr_factor(step: int, spec: TrainerSpec) -> float:
    """The learning-rate multiplier at training step ``step``: the warm-up, then either constant or
    a cosine from 1 down to ``min_lr_ratio`` at ``max_steps`` (held there if training goes on)."""
    warm = warmup_factor(step, spec.warmup_steps)
    if spec.lr_decay == "constant" or step < spec.warmup_steps:
        return warm
    span = max(1, spec.max_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def update_schedule(spec: TrainerSpec):
    """LambdaLR's factor: the scheduler steps once an update, and the schedule counts training
    steps, so every update of a step has the step's learning rate."""
    return lambda update: lr_factor(update // spec.updates_per_step, spec)
