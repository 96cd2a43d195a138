"""Trainer speed and memory on this machine, with the tiny Qwen3-MoE policy.

1. Training tokens/s of GRPO and PBSD batches of the same shape (8 groups x 4
   trajectories, 600 to 2,000 tokens each): the loss costs the same, PBSD's per-token
   weights are just different advantages (its extra work belongs to the scorer).
2. Peak memory of one optimiser step on a single 64K-token trajectory, with the
   LM head applied a chunk of rows at a time under activation checkpointing (ours)
   beside full-vocabulary logits for the whole trajectory (the naive baseline). Each
   variant runs in its own process so its peak RSS is its own.

Run: ``.venv/bin/python benchmarks/trainer.py``.
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
from transformers import PreTrainedTokenizerFast

from proto.runs import GrpoSpec, PbsdSpec, TrainerSpec
from services.model.tiny import TinySpec, build_tiny_model, train_tokenizer
from services.trainer.batch import BatchCounts, TrainSample
from services.trainer.policy import PolicyTrainer


def tiny_model():
    tokenizer: PreTrainedTokenizerFast = train_tokenizer(
        ["the quick brown fox jumps over the lazy dog " * 50] * 20, 4096
    )
    return build_tiny_model(tokenizer, TinySpec(vocab_size=4096))


def batch(vocab: int, pbsd: bool, seed: int = 0) -> tuple[list[TrainSample], BatchCounts]:
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(8):
        adv = np.array([1.2, -0.4, -0.4, -0.4])
        for i in range(4):
            n = int(rng.integers(600, 2000))
            ids = rng.integers(0, vocab, n)
            pos = np.arange(n // 3, n - 1)
            a = np.full(pos.size, adv[i], np.float32)
            if pbsd:  # per-turn weights in [0.9, 1.1] on six turns
                a = a * np.repeat(rng.uniform(0.9, 1.1, 6), -(-pos.size // 6))[: pos.size].astype(np.float32)
            samples.append(
                TrainSample(
                    f"{g}/{i}", ids[:-1], pos, ids[pos + 1], np.full(pos.size, -8.3, np.float32), a, None
                )
            )
    return samples, BatchCounts(len(samples), int(sum(s.targets.size for s in samples)))


def throughput(args) -> dict:
    torch.manual_seed(0)
    out = {}
    for name, algo, pbsd in (("grpo", GrpoSpec(), False), ("pbsd", PbsdSpec(), True)):
        trainer = PolicyTrainer(tiny_model(), TrainerSpec(lr=1e-4, warmup_steps=0))
        samples, counts = batch(trainer.model.config.vocab_size, pbsd)
        trainer.train_step(samples[:2], counts, algo)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.train_step(samples, counts, algo)
            times.append(time.perf_counter() - start)
        tokens = sum(s.tokens for s in samples)
        out[name] = {
            "tokens": tokens,
            "loss_tokens": counts.tokens,
            "seconds": float(np.median(times)),
            "tokens_per_s": tokens / float(np.median(times)),
        }
    return out


def memory(variant: str, length: int) -> dict:
    torch.manual_seed(0)
    model = tiny_model()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, length + 1)
    pos = np.arange(length // 4, length)
    sample = TrainSample(
        "long",
        ids[:-1],
        pos,
        ids[pos + 1],
        np.full(pos.size, -8.3, np.float32),
        np.ones(pos.size, np.float32),
        None,
    )
    counts = BatchCounts(1, pos.size)
    start = time.perf_counter()
    if variant == "ours":
        PolicyTrainer(
            model,
            TrainerSpec(lr=1e-4, warmup_steps=0, micro_batch_tokens=16_384),
            gradient_checkpointing=True,
        ).train_step([sample], counts, GrpoSpec())
    else:  # full logits over the whole trajectory, float32 log-softmax, no checkpointing
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        logits = model(input_ids=torch.as_tensor(ids[:-1])[None]).logits[0].float()
        logp = torch.log_softmax(logits, -1)[torch.as_tensor(pos), torch.as_tensor(ids[pos + 1])]
        (-logp.mean()).backward()
        opt.step()
    return {
        "variant": variant,
        "seconds": time.perf_counter() - start,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--memory", choices=("ours", "naive"))
    ap.add_argument("--length", type=int, default=65_536)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.memory:
        print(json.dumps(memory(args.memory, args.length)))
        return
    torch.set_num_threads(os.cpu_count() or 1)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, CPU float32"
    )
    t = throughput(args)
    print(
        f"\n1. one optimiser step, tiny Qwen3-MoE, 8 groups x 4 trajectories ({t['grpo']['tokens']:,} tokens, "
        f"{t['grpo']['loss_tokens']:,} loss tokens)"
    )
    for name in ("grpo", "pbsd"):
        print(
            f"   {name.upper():6} {t[name]['seconds']:7.2f} s   {t[name]['tokens_per_s']:9,.0f} training tokens/s"
        )
    print(f"   PBSD / GRPO step time: {t['pbsd']['seconds'] / t['grpo']['seconds']:.2f}")
    results = {}
    for variant in ("ours", "naive"):
        line = (
            subprocess.run(
                [sys.executable, __file__, "--memory", variant, "--length", str(args.length)],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        results[variant] = json.loads(line)
    print(f"\n2. one optimiser step on a single {args.length:,}-token trajectory")
    print(
        f"   {'chunked LM head + activation checkpointing (ours)':52} peak {results['ours']['peak_mb']:7,.0f} MB"
        f"  {results['ours']['seconds']:6.1f} s"
    )
    print(
        f"   {'full-vocabulary float32 logits (naive)':52} peak {results['naive']['peak_mb']:7,.0f} MB"
        f"  {results['naive']['seconds']:6.1f} s"
    )


if __name__ == "__main__":
    main()
