"""A bfloat16 policy under DeepSpeed, with a config that does not mention precision: a gradient that
is not finite is skipped at every ZeRO stage, and the small updates of RL reach the weights (float32
copies at stage 0 too); a float16 policy without loss scaling is refused, under DeepSpeed and in plain
torch. Slow: DeepSpeed builds its CPU ops on first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proto.runs import GrpoSpec, TrainerSpec
from services.model.checkpoint import load_model
from services.trainer import deepspeed_config
from services.trainer.policy import PolicyTrainer

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_precision.py"


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    """The plain trainer's bfloat16 run with float32 master weights: what DeepSpeed should match."""
    sys.path.insert(0, str(SCRIPT.parents[2]))
    from tests.scripts.deepspeed_precision import LR, STEPS, on_policy

    batch, counts = on_policy(tiny_checkpoint)
    trainer = PolicyTrainer(
        load_model(tiny_checkpoint, dtype="bfloat16"), TrainerSpec(lr=LR, warmup_steps=0, weight_decay=0.0)
    )
    for _ in range(STEPS):
        trainer.train_step(batch, counts, GrpoSpec())
    return trainer.model


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_bfloat16_policy_under_deepspeed_skips_nan_and_keeps_small_updates(
    tiny_checkpoint, tmp_path, stage, plain
):
    """Before: at stages 1 and 2 the poisoned step was reported taken and every weight became NaN;
    at stage 0 AdamW stepped on the bfloat16 weights and lost most of the updates."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2]), "DS_ACCELERATOR": "cpu"}
    config = json.dumps({"zero_optimization": {"stage": stage}})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_checkpoint), str(tmp_path), config],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    history = json.loads((tmp_path / "history.json").read_text())
    assert history[0]["skipped_update"] == 1.0 and history[1] == {"finite": True}
    assert [h["skipped_update"] for h in history[2:]] == [0.0] * (len(history) - 2)
    start, ours, theirs = (
        _flat(m)
        for m in (load_model(tiny_checkpoint, dtype="bfloat16"), load_model(tmp_path / "weights"), plain)
    )
    moved, moved_plain = float((ours != start).float().mean()), float((theirs != start).float().mean())
    agree = float((ours == theirs).float().mean())
    print(
        f"stage {stage}: moved {moved:.3f} (plain with copies {moved_plain:.3f}), equal to plain {agree:.3f}"
    )
    assert moved > 0.8 * moved_plain and agree > 0.8


def test_a_float16_policy_without_loss_scaling_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="float16 policy needs loss scaling"):
        PolicyTrainer(load_model(tiny_checkpoint, dtype="float16"), TrainerSpec())
    with pytest.raises(ValueError, match="needs DeepSpeed's fp16 section"):
        deepspeed_config.deepspeed_config(
            TrainerSpec(deepspeed_config={"bf16": {"enabled": True}}), torch.float16
        )
    config = deepspeed_config.deepspeed_config(
        TrainerSpec(deepspeed_config={"fp16": {"enabled": True}}), torch.float16
    )
    assert config["fp16"] == {"enabled": True}  # with its loss scale, as written


def test_only_stage_0_gets_a_bf16_section_added():
    for stage, added in ((0, True), (1, False), (2, False), (3, False)):
        config = deepspeed_config.deepspeed_config(
            TrainerSpec(deepspeed_config={"zero_optimization": {"stage": stage}}), torch.bfloat16
        )
        assert ("bf16" in config) == added, stage
    assert "bf16" not in deepspeed_config.deepspeed_config(
        TrainerSpec(deepspeed_config={"zero_optimization": {"stage": 0}})
    )
