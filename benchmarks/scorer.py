"""Evidence-scorer speed: scored tokens/s of the scorer beside a naive implementation and
the bound of two bare forward passes, with peak memory.

The workload: a small Qwen3-MoE-architecture model built from a config (random
weights) and a group of trajectories with a long-tailed length distribution
(log-normal, clipped); each trajectory is scored twice (student and teacher contexts,
the teacher's 24 tokens longer), log-probs wanted at every completion token.

* ours: :func:`services.scorer.logprobs.sequence_logprobs`, student and teacher in one
  procedure, no padding, chunked log-softmax over the needed rows only
  (packed into one forward per token budget when attention has varlen kernels, i.e.
  on GPU with flash attention; one sequence per forward otherwise);
* naive: padded batches (``batch`` sequences), full float32 log-softmax over the whole
  vocabulary for every position, student and teacher in separate padded batches;
* bound: two bare forward passes over the same tokens (the decoder over every token, the
  LM head over the rows that predict a scored token, no log-softmax): what any scorer
  must at least spend.

Each method runs in its own process so that its peak memory is its own. Picks CUDA
when present and then also reports MFU. Run: ``.venv/bin/python benchmarks/scorer.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from services.scorer.logprobs import sequence_logprobs

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16


def build_model(device: str, dtype: torch.dtype, vocab: int) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=32_768,
        use_sliding_window=False,
        sliding_window=None,
        attn_implementation="flash_attention_2" if device == "cuda" and _has_flash() else "sdpa",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype).eval()


def _has_flash() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def workload(n: int, seed: int, vocab: int, min_len: int, max_len: int) -> list[tuple[list[int], np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1200), 0.8, size=n), min_len, max_len).astype(int)
    requests = []
    for n_tok in lengths:
        prompt = int(n_tok * 0.3)
        student = rng.integers(0, vocab, n_tok).tolist()
        teacher = student[:prompt] + rng.integers(0, vocab, 24).tolist() + student[prompt:]
        requests.append((student, np.arange(prompt, n_tok)))
        requests.append((teacher, np.arange(prompt + 24, n_tok + 24)))
    return requests


def run_ours(model, requests, pack: bool, budget: int) -> None:
    sequence_logprobs(model, requests, token_budget=budget, chunk_size=1024, pack=pack)


@torch.no_grad()
def run_naive(model, requests, batch: int) -> None:
    device = next(model.parameters()).device
    for kind in (0, 1):  # students, then teachers, in separate padded batches
        reqs = requests[kind::2]
        for b in range(0, len(reqs), batch):
            part = reqs[b : b + batch]
            width = max(len(ids) for ids, _ in part)
            ids = torch.zeros((len(part), width), dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for i, (seq, _) in enumerate(part):
                ids[i, : len(seq)] = torch.tensor(seq, device=device)
                mask[i, : len(seq)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits, dim=-1)  # [batch, width, vocab] in float32
            for i, (_seq, positions) in enumerate(part):
                p = torch.as_tensor(positions, device=device)
                logp[i, p - 1].gather(1, ids[i, p][:, None])
            del logits, logp


@torch.no_grad()
def run_bound(model, requests) -> None:
    """The irreducible work: the decoder over every token and the LM head over the rows that predict a
    scored token, with no log-softmax, no gather, no bookkeeping."""
    device = next(model.parameters()).device
    for ids, positions in requests:
        x = torch.tensor([ids], device=device)
        hidden = model.model(
            input_ids=x, position_ids=torch.arange(len(ids), device=device)[None], use_cache=False
        )
        rows = hidden.last_hidden_state[0, torch.as_tensor(positions - 1, device=device)]
        for start in range(0, rows.shape[0], 1024):
            model.lm_head(rows[start : start + 1024])


def active_params(model) -> int:
    """Parameters touched per token: everything but the experts not routed to, and the LM head."""
    c = model.config
    total = sum(p.numel() for p in model.model.parameters())
    experts = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    return total - experts + experts * c.num_experts_per_tok // c.num_experts


def one(method: str, args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_model(device, dtype, args.vocab)
    requests = workload(args.trajectories, args.seed, args.vocab, args.min_len, args.max_len)
    small = workload(2, args.seed + 1, args.vocab, 64, 128)
    run = {
        "ours": lambda r: run_ours(model, r, pack=device == "cuda", budget=args.budget),
        "ours-packed": lambda r: run_ours(model, r, pack=True, budget=args.budget),
        "naive": lambda r: run_naive(model, r, args.batch),
        "bound": lambda r: run_bound(model, r),
    }[method]
    run(small)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run(requests)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(ids) for ids, _ in requests)
    out = {
        "method": method,
        "device": device,
        "seconds": elapsed,
        "tokens": tokens,
        "scored_tokens": int(sum(len(p) for _, p in requests)),
    }
    if device == "cuda":
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak:
            out["mfu"] = 2 * active_params(model) * tokens / elapsed / (peak * 1e12)
        out["gpu"] = name
    else:
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", choices=("ours", "ours-packed", "naive", "bound"))
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32_768)
    ap.add_argument("--batch", type=int, default=4, help="naive: sequences per padded batch")
    ap.add_argument("--budget", type=int, default=16_384, help="ours: tokens per packed forward")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.method:
        print(json.dumps(one(args.method, args)))
        return
    passthrough = [a for a in sys.argv[1:]]
    results = {}
    methods = ["ours", "naive", "bound"] + ([] if torch.cuda.is_available() else ["ours-packed"])
    for m in methods:
        line = (
            subprocess.run(
                [sys.executable, __file__, "--method", m, *passthrough],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        results[m] = json.loads(line)
    r = results["ours"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, device {r['device']}"
        + (f" ({r.get('gpu')})" if r.get("gpu") else "")
        + f", Python {platform.python_version()}"
    )
    print(
        f"workload: {args.trajectories} trajectories x (student + teacher), {r['tokens']:,} tokens, "
        f"{r['scored_tokens']:,} scored; vocabulary {args.vocab:,}; 4-layer Qwen3-MoE, 16 experts, top-2"
    )
    print(
        f"{'method':36} {'seconds':>8} {'scored tok/s':>13} {'peak MB':>9}" + ("  MFU" if "mfu" in r else "")
    )
    labels = {
        "ours": "ours (scorer)",
        "ours-packed": "ours, packed on CPU (not used there)",
        "naive": "naive (padded, full log-softmax)",
        "bound": "bound (2 bare forwards)",
    }
    for m in methods:
        x = results[m]
        mfu = f"  {x['mfu'] * 100:.1f}%" if "mfu" in x else ""
        print(
            f"{labels[m]:36} {x['seconds']:8.2f} {x['scored_tokens'] / x['seconds']:13,.0f} {x['peak_mb']:9.0f}{mfu}"
        )
    print(
        f"ours vs naive: {results['naive']['seconds'] / r['seconds']:.2f}x faster, "
        f"{results['naive']['peak_mb'] / r['peak_mb']:.2f}x less peak memory; "
        f"ours vs bound: {results['bound']['seconds'] / r['seconds']:.2f} of the bound's speed"
    )


if __name__ == "__main__":
    main()
