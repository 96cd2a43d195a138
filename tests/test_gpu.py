"""The CUDA paths against the CPU ones: the scorer's likelihood passes (packed with SDPA's dense
mask and with compiled flex attention, as the GPU scorer runs them; the fused LM head) and a
trainer step give the CPU's figures to rounding. Marked ``gpu``:
`make test-gpu` on a machine with a CUDA device and a CUDA build of torch; never run in CI
(DeepSpeed over NCCL is in tests/test_deepspeed.py under the same marker)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from proto.runs import TrainerSpec
from services.model.checkpoint import load_model
from services.model.lm_head import float32_output, fused_head_available, realised_logprobs
from services.model.lse_kernel import logit_and_logsumexp, reference_logit_and_logsumexp
from services.scorer.backends import LocalScorer
from services.scorer.logprobs import kernel_path, scoring_attention, sequence_logprobs
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


def _flex_cuda(path, dtype="float32"):
    model = load_model(path, dtype=dtype, device="cuda")
    model.set_attn_implementation("flex_attention")
    return model


def test_packed_flex_on_cuda_equals_cpu_at_every_packed_length(tiny_checkpoint):
    """Compiled flex attention, several packed lengths per call and across calls (static padded shapes)."""
    rng = np.random.default_rng(1)
    requests = [(rng.integers(0, 900, n).tolist(), np.arange(1, n)) for n in (300, 37, 150, 90, 5, 700, 2)]
    cpu = sequence_logprobs(load_model(tiny_checkpoint), requests)
    model = _flex_cuda(tiny_checkpoint)
    assert kernel_path(model).pack
    for budget in (400, 750, 2000):
        gpu = sequence_logprobs(model, requests, token_budget=budget)
        for a, b in zip(cpu, gpu, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_fused_head_on_cuda_matches_torch():
    assert fused_head_available("cuda")
    torch.manual_seed(0)
    vocab = 151_936  # Qwen3's: not a multiple of the kernel's tile
    logits = (torch.randn(3000, vocab, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (3000,), device="cuda")
    for got, want in zip(
        logit_and_logsumexp(logits, targets), reference_logit_and_logsumexp(logits, targets), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    head = torch.nn.Linear(256, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(2500, 256, device="cuda", dtype=torch.bfloat16)
    fused = realised_logprobs(hidden, head, targets[:2500], 1024, "fused")
    chunked = realised_logprobs(hidden, head, targets[:2500], 1024, "chunked")
    torch.testing.assert_close(fused, chunked, rtol=0, atol=1e-4)


def test_the_bfloat16_head_on_cuda_gives_float32_logits_at_float32_precision():
    """torch.mm's out_dtype: bf16 rows and weight, float32 accumulation and output. The realised
    log-probs match a float64 computation on the same bf16 values, on both reductions."""
    torch.manual_seed(1)
    vocab, width = 151_936, 256
    head = torch.nn.Linear(width, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, 1.5)
    hidden = torch.randn(1000, width, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (1000,), device="cuda")
    exact = torch.log_softmax(hidden.double() @ head.weight.double().T, -1).gather(1, targets[:, None])[:, 0]
    for path in ("chunked", "fused"):
        got = realised_logprobs(hidden, head, targets, 256, path)
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-3)


def test_the_trainers_bfloat16_head_on_cuda_gives_float32_logits_and_bfloat16_gradients():
    """float32_output on CUDA: torch.mm's out_dtype forward, the custom backward equal to autograd's
    for head(rows).float()."""
    torch.manual_seed(2)
    head = torch.nn.Linear(256, 151_936, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, 1.5)
    rows = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    upstream = torch.randn(512, 151_936, device="cuda")

    def run():
        x = rows.clone().requires_grad_(True)
        head.weight.grad = None
        logits = head(x)
        (logits.float() * upstream).sum().backward()
        return logits, x.grad, head.weight.grad

    plain = run()
    float32_output(head)
    logits, rows_grad, weight_grad = run()
    assert logits.dtype == torch.float32
    exact = rows.double() @ head.weight.detach().double().T
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=1e-3)
    torch.testing.assert_close(rows_grad, plain[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(weight_grad, plain[2], rtol=1e-2, atol=1e-2)


def test_the_gpu_scorer_packs_with_flex_and_fuses_the_head(tiny_checkpoint):
    """What a scorer started on CUDA runs, in bf16, against the unpacked chunked path in bf16. On an H100
    with torch 2.11 Inductor built no flex kernel for these 16-wide bf16 heads; the scorer then scores
    with SDPA one sequence per forward (tests/test_scorer_kernels.py), and the figures must agree either way."""
    assert scoring_attention("cuda") in ("flex_attention", "flash_attention_2")
    model = _flex_cuda(tiny_checkpoint, "bfloat16")
    scorer = LocalScorer(model, token_budget=600)
    assert (scorer.path.pack, scorer.path.head, scorer.path.dtype) == (True, "fused", torch.bfloat16)
    rng = np.random.default_rng(2)
    requests = [(rng.integers(0, 900, n).tolist(), np.arange(1, n)) for n in (300, 37, 150, 90, 5, 700)]
    fast = asyncio.run(scorer(requests))
    print(f"the scorer's path: {scorer.path}")
    assert scorer.path.head == "fused" and scorer.path.pack == (scorer.path.attention == "flex_attention")
    plain = sequence_logprobs(model, requests, pack=False, head="chunked")
    diff = np.abs(np.concatenate(fast) - np.concatenate(plain))
    assert diff.mean() < 0.02 and diff.max() < 0.3  # bf16 kernel noise (benchmarks/README.md measures it)


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
