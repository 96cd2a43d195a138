"""DeepSpeed data parallelism (ZeRO-2, two processes on the CPU accelerator) makes exactly the update a
single plain-torch process makes on the whole batch. Slow: DeepSpeed builds its CPU ops on first use."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proto.runs import TrainerSpec
from services.model.checkpoint import load_model
from services.trainer.policy import PolicyTrainer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("stage", "ranks"), [(1, 2), (2, 1)])
def test_deepspeed_equals_one_torch_process(tiny_checkpoint, tmp_path, stage, ranks):
    pytest.importorskip("deepspeed")
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher ships with the package"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    script = Path(__file__).parent / "scripts" / "deepspeed_dp.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run(
        [
            launcher,
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(29533 + stage),
            str(script),
            str(tiny_checkpoint),
            str(tmp_path),
            str(config),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    distributed = torch.load(tmp_path / "params.pt")

    sys.path.insert(0, str(script.parent))
    from deepspeed_dp import ALGORITHM, samples

    reference = PolicyTrainer(
        load_model(tiny_checkpoint),
        TrainerSpec(lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0),
        reference_path=str(tiny_checkpoint),
    )
    batch, counts = samples(reference.model.config.vocab_size)
    for _ in range(2):
        reference.train_step(batch, counts, ALGORITHM)
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(distributed[name], param.detach(), rtol=1e-4, atol=1e-6, msg=name)
    assert (tmp_path / "weights" / "config.json").exists()
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history) == 2 and history[0]["grad_norm"] > 0
    assert history[0]["kl_ref"] < 1e-6 < history[1]["kl_ref"]  # the first step starts at the reference
