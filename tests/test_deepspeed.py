"""DeepSpeed data parallelism (no ZeRO, ZeRO-1 and ZeRO-3 on two processes, ZeRO-1 on three, ZeRO-2
on one and on one started without the launcher, CPU accelerator) makes exactly the update a single
plain-torch process makes on the whole batch, skips an update whose gradient is not finite with
the schedule going on as the plain trainer's does, takes no step on an empty batch, reports the
whole batch's metrics, and resumes every rank's state, its generators included. Slow: DeepSpeed
builds its CPU ops on first use."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import set_seed

from proto.runs import TrainerSpec
from services.local_redis import free_port
from services.model.checkpoint import load_model
from services.trainer.policy import PolicyTrainer

pytestmark = pytest.mark.slow


NCCL = {"backend": "nccl", "rtol": 1e-3, "atol": 1e-5}  # CUDA kernels differ from the CPU's in rounding
# A config as DeepSpeed users write them: a train_batch_size (which DeepSpeed checks against micro
# batch x accumulation x world) and an optimizer whose weight decay wins over the spec's 0.1
CONFIG_OPTIMIZER = {
    "config": {
        "train_batch_size": 32,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.5, "torch_adam": True},
        },
    },
    "weight_decay": 0.5,
}


@pytest.mark.parametrize(
    ("stage", "ranks", "on"),
    [
        (0, 2, {}),
        (1, 2, {}),
        (2, 1, {}),
        (2, 2, {}),
        (3, 2, {}),
        (1, 3, {}),
        (2, 0, {}),
        pytest.param(1, 1, CONFIG_OPTIMIZER, id="1-1-config-optimizer"),
        # on GPUs, over NCCL (`make test-gpu`); never run here: this machine has no GPU
        pytest.param(2, 1, NCCL, marks=pytest.mark.gpu, id="nccl-2-1"),
        pytest.param(2, 2, NCCL, marks=pytest.mark.gpu, id="nccl-2-2"),
        pytest.param(3, 2, NCCL, marks=pytest.mark.gpu, id="nccl-3-2"),
    ],
)
def test_deepspeed_equals_one_torch_process(tiny_checkpoint, tmp_path, stage, ranks, on):
    pytest.importorskip("deepspeed")
    backend, rtol, atol = on.get("backend", "gloo"), on.get("rtol", 1e-4), on.get("atol", 1e-6)
    if backend == "nccl" and torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices")
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher ships with the package"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": stage}, **on.get("config", {})}))
    script = Path(__file__).parent / "scripts" / "deepspeed_dp.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "PBSD_TEST_DIST_BACKEND": backend}
    if backend == "gloo":
        env["DS_ACCELERATOR"] = "cpu"
    # ranks 0: no launcher at all, as `pbsd serve trainer` runs under Compose and Kubernetes
    port = free_port()
    launch = [launcher, "--num_gpus", str(ranks), "--master_port", str(port)] if ranks else [sys.executable]
    result = subprocess.run(
        [*launch, str(script), str(tiny_checkpoint), str(tmp_path), str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # each rank removed the name of DeepSpeed's shared-memory workspace of the CPU all-reduce
    # once every rank had mapped them, so that no exit, however abrupt, leaves them in memory
    assert json.loads((tmp_path / "shm.json").read_text()) == []
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    distributed = load_model(tmp_path / "weights")

    sys.path.insert(0, str(script.parent))
    from deepspeed_dp import ALGORITHM, SPEC, TWO_UPDATES, poisoned, samples, two_updates

    reference = PolicyTrainer(
        load_model(tiny_checkpoint),
        TrainerSpec(**{**SPEC, "weight_decay": on.get("weight_decay", SPEC["weight_decay"])}),
        reference_path=str(tiny_checkpoint),
    )
    batch, counts = samples(reference.model.config.vocab_size)
    expected = [reference.train_step(poisoned(batch), counts, ALGORITHM)]
    expected += [reference.train_step(batch, counts, ALGORITHM) for _ in range(2)]
    reference.train_step([], counts, ALGORITHM)
    expected.append(reference.train_batch(two_updates(batch, counts), TWO_UPDATES))
    mine = dict(distributed.named_parameters())
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(mine[name], param.detach(), rtol=rtol, atol=atol, msg=name)
    history = json.loads((tmp_path / "history.json").read_text())
    assert len(history) == 5 and history[1]["grad_norm"] > 0 and history[3]["grad_norm"] == 0
    assert [h["skipped_update"] for h in history] == [1.0, 0.0, 0.0, 0.0, 0.0] and expected[0][
        "skipped_update"
    ]
    empty = history.pop(3)
    assert [h["lr"] for h in history] == pytest.approx([h["lr"] for h in expected])  # the schedule went on
    assert empty["lr"] == pytest.approx(expected[2]["lr"]) and history[3]["updates"] == 2.0
    assert history[1]["kl_ref"] < 1e-6 < history[2]["kl_ref"]  # the first update starts at the reference
    for got, want in zip(
        history[1:], expected[1:], strict=True
    ):  # the whole batch's figures, every rank's share
        assert got["trained_tokens"] == want["trained_tokens"] == sum(s.targets.size for s in batch)
        # the norm before clipping: a loss scaled by a constant shows here, where AdamW hides it
        for key in ("loss", "clip_frac", "kl_ref", "ratio_mean", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=rtol, abs=atol / 10), key
    # every rank saved its generators beside its partition, and rank 0's drew the same after the load
    placed = tmp_path / "placed" / "state" / "state"
    assert sorted(p.name for p in placed.glob("rng_rank*.pt")) == [
        f"rng_rank{r}.pt" for r in range(max(ranks, 1))
    ]
    before, after = json.loads((tmp_path / "draws.json").read_text())
    assert before == after
    # each rank loaded its own: what it saved again at once is what it had saved
    reloaded = tmp_path / "reloaded" / "state" / "state"
    for rank in range(max(ranks, 1)):
        a, b = (torch.load(d / f"rng_rank{rank}.pt", weights_only=False) for d in (placed, reloaded))
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"], rank
    # and the followers' are seeded from the run's seed, rank k with seed + k (unseeded, a process
    # starts from entropy and a run's dropout would not repeat): they draw nothing in these steps,
    # so each saved where its seed put it
    for rank in range(1, ranks):
        set_seed(TrainerSpec(**SPEC).seed + rank)
        saved = torch.load(placed / f"rng_rank{rank}.pt", weights_only=False)
        assert torch.equal(saved["torch"], torch.get_rng_state()) and saved["python"] == random.getstate()
    # a resumed trainer (every rank loads its own optimiser partition) repeats the same step exactly
    a, b = (dict(load_model(tmp_path / d).named_parameters()) for d in ("resumed-a", "resumed-b"))
    exact = backend == "gloo"  # CUDA's atomics make a repeated step equal only to rounding
    for name, param in a.items():
        torch.testing.assert_close(
            b[name], param, rtol=0 if exact else rtol, atol=0 if exact else atol, msg=name
        )
