"""The DeepSpeed config a run trains with: the run's file or inline object, completed from the run
(AdamW with its learning rate, betas and weight decay, gradient clipping, one micro-batch a backward:
the trainer accumulates over its own token budget and marks the boundary itself), and made safe for
the model's precision (:func:`_half_precision`). The engine that uses it is
:mod:`services.trainer.distributed`.

DeepSpeed writes where its config says: the flops profiler's ``output_file`` (opened for writing,
truncating what is there), the monitors' ``output_path`` and the ``job_name`` under it, NVMe
offload's ``nvme_path``, autotuning's ``results_dir``, Nebula's ``persistent_storage_path``. A spec
comes from a client of the REST API, and the trainer writes only under its runs folder, so a
config that names a file or folder (:func:`file_keys`) is refused, at submission and again as the
run opens (a file may have changed), unless the operator lets run specs name them
(``PBSD_TRAINER_DEEPSPEED_PATHS``: every holder of the API token may then write where the trainer
can). A config file is read by :func:`read_config_file` in both places."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from proto.runs import TrainerSpec

__all__ = [
    "MAX_CONFIG_FILE_BYTES",
    "checked_config",
    "deepspeed_config",
    "enabled",
    "file_keys",
    "read_config_file",
    "weight_decay_of",
]

MAX_CONFIG_FILE_BYTES = 1 << 20  # a DeepSpeed config is a few KB

# a key that names a file or folder (output_file, output_path, nvme_path, results_dir, ...), and one
# whose value is joined under such a path (job_name)
_PATH_KEY = re.compile(r"(path|paths|file|files|dir|dirs|directory|folder)$", re.IGNORECASE)
_NAME_KEY = re.compile(r"name$", re.IGNORECASE)


def file_keys(config: Any) -> list[str]:
    """The dotted keys of ``config`` that name a file or folder: a ``*_path``, ``*_file``, ``*_dir``
    or ``*_folder`` that is set, or a ``*name`` that holds a path separator or ``..``."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str) and value.strip():
            last = key.rsplit(".", 1)[-1]
            if _PATH_KEY.search(last) or (
                _NAME_KEY.search(last) and ("/" in value or "\\" in value or ".." in value)
            ):
                found.append(key)
    return sorted(found)


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file, held to an inline config's rules (a JSON object of finite numbers, nested at
    most MAX_CONFIG_DEPTH), at most MAX_CONFIG_FILE_BYTES; ValueError says what is wrong."""
    try:
        if path.stat().st_size > MAX_CONFIG_FILE_BYTES:
            raise ValueError(f"{path.name} is larger than {MAX_CONFIG_FILE_BYTES} bytes")
        config = json.loads(path.read_bytes())
    except (OSError, RecursionError, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path.name} is not a readable JSON file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    try:
        TrainerSpec(deepspeed_config=config)
    except ValidationError as exc:
        raise ValueError(f"{path.name}: {exc.errors()[0]['msg']}") from None
    return config


def checked_config(spec: TrainerSpec, *, allow_paths: bool) -> TrainerSpec:
    """``spec`` with its DeepSpeed config read (a file's, inline from now on: every rank trains
    with what was checked) and refused where it names a file or folder and ``allow_paths`` is off."""
    config = spec.deepspeed_config
    if config is None:
        return spec
    if isinstance(config, str):
        config = read_config_file(Path(config))
    if not allow_paths and (keys := file_keys(config)):
        raise ValueError(
            f"deepspeed_config names files or folders ({', '.join(keys[:5])}), where DeepSpeed would "
            "write outside the run's folder: leave them out, or let run specs name them "
            "(PBSD_TRAINER_DEEPSPEED_PATHS)"
        )
    return spec.model_copy(update={"deepspeed_config": config})


def deepspeed_config(spec: TrainerSpec, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The run's DeepSpeed config, completed from the run and made safe for a model of ``dtype``."""
    config = spec.deepspeed_config or {}
    if isinstance(config, str):
        config = read_config_file(Path(config))
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
