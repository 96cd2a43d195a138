"""The scorer's kernel paths against each other in bf16: the per-token log-prob difference, and how far
it moves a turn's mean evidence against the deadband (eps+ 0.001, eps- 0.003), for turns of 16, 64,
256 and 1,024 tokens (:mod:`services.scorer.numerics` states the arithmetic).

The workload is the scorer benchmark's (:mod:`scorer`): student and teacher contexts, the teacher
24 tokens longer, every completion token scored, on a preset's model in bf16. The reference path is
one sequence per forward with SDPA and the chunked float32 reduction; each other path is compared
with it:

* packed, flex attention (compiled on CUDA; on CPU its unfused implementation, since compiling
  it for a second packed length fails with torch 2.13);
* packed, SDPA with a dense block-diagonal mask;
* fused LM head (the Triton reduction; CUDA only);
* the scorer's GPU path (flex packed + fused head; CUDA only);
* float32 unpacked, for scale: the size of bf16 rounding itself.

Run: ``.venv/bin/python benchmarks/scorer_numerics.py [--preset small] [--trajectories 8]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform

import numpy as np
import torch
from presets import PRESETS, build
from scorer import MODEL_OF, WORKLOADS, workload

from services.model.lm_head import fused_head_available
from services.scorer.logprobs import sequence_logprobs
from services.scorer.numerics import token_differences, turn_shifts

TURNS = (16, 64, 256, 1024)


def paths(cuda: bool) -> dict[str, dict]:
    """name: (attention, pack, head, dtype) of each compared path."""
    out = {
        "packed, flex attention": dict(attention="flex_attention", pack=True, head="chunked"),
        "packed, SDPA dense mask": dict(attention="sdpa", pack=True, head="chunked"),
    }
    if cuda and fused_head_available("cuda"):
        out["fused LM head"] = dict(attention="sdpa", pack=False, head="fused")
        out["the GPU scorer's path (flex packed, fused)"] = dict(
            attention="flex_attention", pack=True, head="fused"
        )
    out["float32, unpacked (bf16 rounding itself)"] = dict(
        attention="sdpa", pack=False, head="chunked", float32=True
    )
    return out


def score(model, requests, spec: dict, budget: int, cuda: bool) -> list[np.ndarray]:
    model.set_attn_implementation(spec["attention"])
    eager = spec["attention"] == "flex_attention" and not cuda
    with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
        return sequence_logprobs(model, requests, token_budget=budget, pack=spec["pack"], head=spec["head"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(WORKLOADS), default="small")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=3072)
    ap.add_argument(
        "--budget", type=int, help="tokens per packed forward (default 16,384 on CUDA, 4,096 on CPU)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.set_num_threads(os.cpu_count() or 1)
    # on CPU the unfused flex attention holds the packed square of scores: keep packs small there
    budget = args.budget or (16_384 if cuda else 4096)
    preset = MODEL_OF[args.preset]
    model = build(preset, layers=args.layers, device=device, dtype=torch.bfloat16, attention="sdpa")
    _, lo, median, _ = WORKLOADS[args.preset]
    requests = workload(args.seed, model.config.vocab_size, args.trajectories, lo, median, args.max_len)
    reference = score(model, requests, dict(attention="sdpa", pack=False, head="chunked"), budget, cuda)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {torch.cuda.get_device_name() if cuda else 'CPU'}, "
        f"torch {torch.__version__}; preset {args.preset} ({PRESETS[preset]['vocab_size']:,}-token vocabulary), bf16, "
        f"{len(requests)} sequences, {sum(len(p) for _, p in requests):,} scored tokens"
    )
    print("reference: bf16, one sequence per forward, SDPA, chunked float32 reduction")
    for name, spec in paths(cuda).items():
        if spec.get("float32"):
            model.float()
        other = score(model, requests, spec, budget, cuda)
        model.to(torch.bfloat16)
        d = token_differences(reference, other)
        print(
            f"\n{name}: per-token |difference| max {d['max_abs']:.4f}, mean {d['mean_abs']:.5f} nats "
            f"(mean signed {d['mean']:+.6f}) over {d['tokens']:,} tokens"
        )
        student = [o - r for o, r in zip(other[0::2], reference[0::2], strict=True)]
        teacher = [o - r for o, r in zip(other[1::2], reference[1::2], strict=True)]
        print(
            f"  {'turn shift':40} {'turns':>6} {'median':>9} {'p99':>9} {'max':>9} {'>eps+':>7} {'>eps-':>7}"
        )
        for mixed, label in ((False, "same path for both"), (True, "teacher only (mixed paths)")):
            for s in turn_shifts(student, teacher, TURNS, mixed=mixed):
                print(
                    f"  {label + f', {s.turn_tokens} tokens':40} {s.turns:6d} {s.median_abs:9.5f} {s.p99_abs:9.5f} "
                    f"{s.max_abs:9.5f} {s.over_eps_pos:7.1%} {s.over_eps_neg:7.1%}"
                )


if __name__ == "__main__":
    main()
