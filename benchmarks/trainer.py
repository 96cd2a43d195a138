"""Trainer speed and memory, on a preset's Qwen3-MoE shape (:mod:`presets`; default ``tiny``,
the project's tiny policy; ``qwen3-30b-a3b`` is Qwen3-30B-A3B's shape with 4 layers unless
``--layers`` says otherwise, 3.1B parameters, for one GPU).

1. Training tokens/s of GRPO and PBSD batches of the same shape (8 groups x 4
   trajectories, 600 to 2,000 tokens each): the loss costs the same, PBSD's per-token
   weights are just different advantages (its extra work belongs to the scorer). On a GPU
   also the MFU (model FLOPs: 3x the forward's, recomputation not counted).
2. Peak memory of one optimiser step on a single 64K-token trajectory, with the
   LM head applied a chunk of rows at a time under activation checkpointing (ours)
   beside full-vocabulary logits for the whole trajectory (the naive baseline). Each
   variant runs in its own process so its peak memory is its own (RSS on CPU,
   ``max_memory_allocated`` on CUDA).

CPU: float32; CUDA: bf16. Run: ``.venv/bin/python benchmarks/trainer.py [--preset qwen3-30b-a3b]``.
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
from presets import PRESETS, build, flops_per_pass, peak_tflops

from proto.runs import GrpoSpec, PbsdSpec, TrainerSpec
from services.trainer.batch import BatchCounts, TrainSample
from services.trainer.policy import PolicyTrainer

DEFAULT_LAYERS = {"qwen3-30b-a3b": 4}  # 3.1B parameters: weights, gradients and AdamW state fit one GPU
CUDA = torch.cuda.is_available()


def preset_model(args):
    return build(
        args.preset,
        layers=args.layers or DEFAULT_LAYERS.get(args.preset),
        device="cuda" if CUDA else "cpu",
        dtype=torch.bfloat16 if CUDA else torch.float32,
        max_positions=max(16_384, args.length + 64),
    )


def peak_mb() -> float:
    if CUDA:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


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
        trainer = PolicyTrainer(preset_model(args), TrainerSpec(lr=1e-4, warmup_steps=0))
        samples, counts = batch(trainer.model.config.vocab_size, pbsd)
        trainer.train_step(samples[:2], counts, algo)  # warm-up
        times = []
        for _ in range(args.repeats):
            synchronize()
            start = time.perf_counter()
            trainer.train_step(samples, counts, algo)
            synchronize()
            times.append(time.perf_counter() - start)
        tokens = sum(s.tokens for s in samples)
        seconds = float(np.median(times))
        out[name] = {
            "tokens": tokens,
            "loss_tokens": counts.tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }
        peak = peak_tflops()
        if peak:
            flops = flops_per_pass(
                trainer.model.config, [s.tokens for s in samples], counts.tokens, training=True
            )
            out[name]["mfu"] = flops / seconds / (peak * 1e12)
        del trainer
    return out


def memory(variant: str, args) -> dict:
    length = args.length
    torch.manual_seed(0)
    model = preset_model(args)
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
    device = next(model.parameters()).device
    start = time.perf_counter()
    try:
        if variant == "ours":
            PolicyTrainer(
                model,
                TrainerSpec(lr=1e-4, warmup_steps=0, micro_batch_tokens=16_384),
                gradient_checkpointing=True,
            ).train_step([sample], counts, GrpoSpec())
        else:  # full logits over the whole trajectory, float32 log-softmax, no checkpointing
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            logits = model(input_ids=torch.as_tensor(ids[:-1], device=device)[None]).logits[0].float()
            logp = torch.log_softmax(logits, -1)[
                torch.as_tensor(pos, device=device), torch.as_tensor(ids[pos + 1], device=device)
            ]
            (-logp.mean()).backward()
            opt.step()
        synchronize()
    except torch.OutOfMemoryError:
        return {"variant": variant, "error": f"out of memory (peak {peak_mb():,.0f} MB before it failed)"}
    return {"variant": variant, "seconds": time.perf_counter() - start, "peak_mb": peak_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--layers", type=int, help="override the preset's number of layers")
    ap.add_argument("--memory", choices=("ours", "naive"))
    ap.add_argument("--length", type=int, default=65_536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--parts",
        default="1,2",
        help="which parts to run (1: step time, 2: 64K memory); a GPU session splits them",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(os.cpu_count() or 1)
    if args.memory:
        print(json.dumps(memory(args.memory, args)))
        return
    layers = args.layers or DEFAULT_LAYERS.get(args.preset) or PRESETS[args.preset]["num_hidden_layers"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, "
        + (f"{torch.cuda.get_device_name()} bf16" if CUDA else "CPU float32")
        + f"; preset {args.preset}, {layers} layers"
    )
    if "1" in parts:
        one_step(args)
    if "2" in parts:
        long_trajectory(args)


def one_step(args) -> None:
    t = throughput(args)
    print(
        f"\n1. one optimiser step, 8 groups x 4 trajectories ({t['grpo']['tokens']:,} tokens, "
        f"{t['grpo']['loss_tokens']:,} loss tokens)"
    )
    for name in ("grpo", "pbsd"):
        mfu = f"   MFU {t[name]['mfu'] * 100:.1f}%" if "mfu" in t[name] else ""
        print(
            f"   {name.upper():6} {t[name]['seconds']:7.2f} s   {t[name]['tokens_per_s']:9,.0f} training tokens/s{mfu}"
        )
    print(f"   PBSD / GRPO step time: {t['pbsd']['seconds'] / t['grpo']['seconds']:.2f}")


def long_trajectory(args) -> None:
    """Each variant in a process of its own, its line printed as it ends: a session's time limit that
    cuts the naive variant keeps ours' figure."""
    passthrough = ["--preset", args.preset, "--length", str(args.length)]
    passthrough += ["--layers", str(args.layers)] if args.layers else []
    print(f"\n2. one optimiser step on a single {args.length:,}-token trajectory", flush=True)
    for variant, label in (
        ("ours", "chunked LM head + activation checkpointing (ours)"),
        ("naive", "full-vocabulary float32 logits (naive)"),
    ):
        done = subprocess.run(
            [sys.executable, __file__, "--memory", variant, *passthrough], capture_output=True, text=True
        )
        lines = done.stdout.strip().splitlines()
        r = json.loads(lines[-1]) if done.returncode == 0 and lines else {}
        if "peak_mb" in r:
            print(f"   {label:52} peak {r['peak_mb']:7,.0f} MB  {r['seconds']:6.1f} s", flush=True)
        elif "error" in r:  # out of memory: the figure is that it does not fit
            print(f"   {label:52} {r['error']}", flush=True)
        else:  # a crash: the child's last words
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"   {label:52} failed (rc {done.returncode}): {last[:100]}", flush=True)


if __name__ == "__main__":
    main()
