"""The CUDA paths against the CPU ones: the scorer's likelihood passes (packed, as the GPU
scorer runs them) and a trainer step give the CPU's figures to rounding. Marked ``gpu``:
`make test-gpu` on a machine with a CUDA device and a CUDA build of torch; never run in CI
(DeepSpeed over NCCL is in tests/test_deepspeed.py under the same marker)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from proto.runs import TrainerSpec
from services.model.checkpoint import load_model
from services.scorer.logprobs import sequence_logprobs
from services.trainer.policy import PolicyTrainer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (make test-gpu fails instead of skipping)")


def test_scorer_passes_on_cuda_equal_cpu(tiny_checkpoint):
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 900, n).tolist(), np.arange(1, n)) for n in (300, 37, 150, 90, 5)]
    cpu = sequence_logprobs(load_model(tiny_checkpoint), requests)
    gpu = sequence_logprobs(load_model(tiny_checkpoint).cuda(), requests, pack=True, token_budget=400)
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_a_trainer_step_on_cuda_equals_cpu(tiny_checkpoint):
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from deepspeed_dp import ALGORITHM, samples

    spec = TrainerSpec(lr=1e-3, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)
    trainers = [
        PolicyTrainer(load_model(tiny_checkpoint).to(d), spec, reference_path=str(tiny_checkpoint))
        for d in ("cpu", "cuda")
    ]
    batch, counts = samples(trainers[0].model.config.vocab_size)
    cpu, gpu = ([t.train_step(batch, counts, ALGORITHM) for _ in range(2)] for t in trainers)
    for got, want in zip(gpu, cpu, strict=True):
        assert got["trained_tokens"] == want["trained_tokens"]
        for key in ("loss", "grad_norm", "clip_frac", "kl_ref"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), key
    mine = dict(trainers[1].model.named_parameters())
    for name, param in trainers[0].model.named_parameters():
        torch.testing.assert_close(mine[name].detach().cpu(), param.detach(), rtol=1e-3, atol=1e-5, msg=name)
