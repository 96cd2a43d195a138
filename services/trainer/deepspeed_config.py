"""The DeepSpeed config a run trains with: the run's file or inline object, completed from the run
(AdamW with its learning rate, betas and weight decay, gradient clipping, one micro-batch a backward:
the trainer accumulates over its own token budget and marks the boundary itself), and made safe for
the model's precision (:func:`_half_precision`). The engine that uses it is
:mod:`services.trainer.distributed`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from proto.config_files import file_keys
from proto.runs import TrainerSpec, deepspeed_files_refused

__all__ = ["deepspeed_config", "enabled", "weight_decay_of"]


def deepspeed_config(spec: TrainerSpec, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The run's DeepSpeed config, completed from the run and made safe for a model of ``dtype``."""
    config = spec.deepspeed_config or {}
    if isinstance(config, str):
        config = json.loads(Path(config).read_text())
    if keys := file_keys(config):  # a file checked at submission may have changed since
        raise ValueError(deepspeed_files_refused(keys))
    config = json.loads(json.dumps(config))  # a copy: the defaults below must not reach the spec
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config["gradient_accumulation_steps"] = 1
    # DeepSpeed asserts train_batch_size = micro batch x accumulation x world when all three are
    # set; the trainer's batch is the step's groups, not a sample count, so it is left to DeepSpeed
    config.pop("train_batch_size", None)
    # The trainer marks the accumulation boundary itself (set_gradient_accumulation_boundary), so
    # every stage reduces in the boundary's backward and the gradient is whole before the step.
    config.pop("managed_gradient_accumulation", None)
    config.setdefault(
        "optimizer",
        {
            "type": "AdamW",
            "params": {
                "lr": spec.lr,
                "betas": list(spec.betas),
                "weight_decay": spec.weight_decay,
                "torch_adam": True,
            },
        },
    )
    if spec.grad_clip is not None:
        config.setdefault("gradient_clipping", spec.grad_clip)
    config.setdefault("zero_optimization", {"stage": 1})
    _half_precision(config, dtype)
    bf16 = config.get("bf16", config.get("bfloat16"))  # the second, DeepSpeed's older name for it
    if isinstance(bf16, dict) and bf16.get("enabled") and _knows_bf16_overflow_check():
        # ZeRO skips an update whose gradient is not finite in fp16 and fp32; in bf16 only with
        # this check, off by default in DeepSpeed before mid-2026 (deepspeedai/DeepSpeed#8035).
        # Without it a NaN gradient is written into every weight and AdamW moment for good.
        bf16.setdefault("check_grad_overflow", True)
    return config


def enabled(config: dict[str, Any], *names: str) -> bool:
    return any(isinstance(config.get(n), dict) and config[n].get("enabled") for n in names)


def _zero_stage_of(config: dict[str, Any]) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def _half_precision(config: dict[str, Any], dtype: torch.dtype) -> None:
    """A 16-bit model needs the config to say so where DeepSpeed would otherwise train it wrongly.

    * float16 without an ``fp16`` section has no loss scaling: most of an RL batch's gradients
      (each token's share of the loss is about 1/tokens) fall below float16's smallest number.
    * bfloat16 without a ``bf16`` section at stage 0 steps AdamW on the bfloat16 weights themselves,
      which loses the updates below 2^-9 of a weight (:mod:`services.trainer.precision`); with the
      section DeepSpeed's wrapper keeps float32 copies. ZeRO (stages 1 to 3) keeps float32
      partitions either way, and without the section sums the gradients in float32, so there the
      config is left as written (the trainer turns on its overflow check instead, in
      :class:`DeepSpeedPolicyTrainer`)."""
    mixed = enabled(config, "bf16", "bfloat16", "fp16")
    if dtype == torch.float16 and not enabled(config, "fp16"):
        raise ValueError(
            "a float16 policy needs DeepSpeed's fp16 section (its dynamic loss scale): without it most "
            "gradients underflow. Use model.dtype bfloat16, or add fp16: {enabled: true}"
        )
    if dtype == torch.bfloat16 and not mixed and _zero_stage_of(config) == 0:
        config["bf16"] = {"enabled": True}


def weight_decay_of(config: dict[str, Any], default: float) -> float:
    """The decay of the matrices: the config's optimizer's, where it sets one (it wins over the spec)."""
    params = (config.get("optimizer") or {}).get("params") or {}
    return float(params.get("weight_decay", default))


def _knows_bf16_overflow_check() -> bool:
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        return False
    return "check_grad_overflow" in DeepSpeedBF16Config.model_fields
