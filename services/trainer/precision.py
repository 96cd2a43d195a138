"""Float32 master weights for a policy held in bfloat16 or float16.

AdamW stepping on bfloat16 weights rounds every update onto the weight's own grid. bfloat16
keeps 8 significant bits, so an update smaller than half a unit in the last place, about
2^-9 of the weight, is lost: at the paper's lr of 3e-6 a weight of 0.02 (a unit of 1.2e-4)
never moves (ten AdamW steps at 3e-6 on 4,096 bfloat16 weights of scale 0.02 left 96% of them
unchanged; ``tests/test_trainer_precision.py`` shows the tiny policy's run at 1e-5 agreeing with
a float32 run on 39% of its weights without copies, 81% with). Mixed-precision trainers keep a
float32 copy for the optimiser (Megatron's main params, DeepSpeed's ZeRO partitions, FSDP's
sharded params); so does this one::

    forward and backward in the model's dtype
    each parameter's gradient, as the backward produces it:  master.grad += float32(p.grad)
    clip, AdamW step on the masters;  p <- round(master)          (after every step)

Adding each sequence's gradient into float32 as soon as it exists keeps a step's hundreds of
sequences from summing in bfloat16 too, and frees the low-precision gradient at once. The cost
is 4 bytes a parameter for the copy, and AdamW's two moments in float32 instead of the model's
dtype (``trainer.master_weights: false`` gives that memory back, and the updates with it).
Under DeepSpeed this class is not used: ZeRO keeps float32 partitions, and at stage 0 the trainer
turns on DeepSpeed's bf16 section, whose optimiser wrapper keeps float32 copies
(``services.trainer.distributed``). A float16 model needs loss scaling as well, which only
DeepSpeed's fp16 section gives: the plain trainer refuses one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeights"]


class MasterWeights:
    """The float32 copies of a model's trainable low-precision parameters, paired with them."""

    def __init__(self, model: nn.Module) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._master_of: dict[int, nn.Parameter] = {}
        low = [p for p in model.parameters() if p.requires_grad and p.dtype != torch.float32]
        if not low:
            return
        # the hooks below take each gradient for one set of copies: a second set would get none
        if getattr(model, "_pbsd_master_weights", False):
            raise ValueError("this model already has master weights: one trainer per model")
        model._pbsd_master_weights = True
        for p in low:
            master = nn.Parameter(p.detach().to(torch.float32), requires_grad=False)
            p.register_post_accumulate_grad_hook(self._move_grad(master))
            self.pairs.append((p, master))
            self._master_of[id(p)] = master

    @staticmethod
    def _move_grad(master: nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.to(torch.float32)
            else:
                master.grad.add_(p.grad)  # promoted: the sum stays float32
            p.grad = None

        return hook

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def optimised(self, p: nn.Parameter) -> nn.Parameter:
        """What the optimiser steps on for ``p``: its float32 copy, or ``p`` itself (already float32)."""
        return self._master_of.get(id(p), p)

    @torch.no_grad()
    def write_back(self) -> None:
        """Each parameter takes its copy's value, rounded to the parameter's dtype."""
        for p, master in self.pairs:
            p.copy_(master)

    @torch.no_grad()
    def reset(self) -> None:
        """The copies take the parameters' values (a state saved without copies)."""
        for p, master in self.pairs:
            master.copy_(p)

    def state(self) -> list[torch.Tensor]:
        return [master.detach() for _, master in self.pairs]

    @torch.no_grad()
    def load_state(self, saved: list[Any]) -> None:
        if len(saved) != len(self.pairs):
            raise ValueError(
                f"the saved state has {len(saved)} master weights; this model has {len(self.pairs)}"
            )
        for (_, master), value in zip(self.pairs, saved, strict=True):
            if tuple(value.shape) != tuple(master.shape):
                raise ValueError(
                    f"a saved master weight of shape {tuple(value.shape)} for one of {tuple(master.shape)}"
                )
            master.copy_(value)
        self.write_back()  # the model saved beside them is their rounding already; this is a no-op there
