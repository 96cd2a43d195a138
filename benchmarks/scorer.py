"""Evidence-scorer speed: scored tokens/s of the scorer beside a naive implementation and
the bound of two bare forward passes, with peak memory (and MFU on a GPU).

The workload: a Qwen3-MoE-architecture model built from a preset's config (random
weights, :mod:`presets`) and a group of trajectories with a long-tailed length
distribution (log-normal, clipped); each trajectory is scored twice (student and teacher
contexts, the teacher's 24 tokens longer), log-probs wanted at every completion token.
Presets: ``small`` (default: 16 trajectories of 256..4,096 tokens on the 4-layer model),
``short`` (256 trajectories of 32..512 tokens on the same model: where one forward per
sequence is launch-bound on a GPU), ``qwen3-30b-a3b`` (Qwen3-30B-A3B's shape, 12 layers,
16 trajectories of 1K..17K tokens: the issue's 8B measurement; ``--layers`` to shrink).

* ours: :func:`services.scorer.logprobs.sequence_logprobs` on the path the scorer picks for
  the device (:func:`~services.scorer.logprobs.kernel_path`): on CUDA flex attention packing
  sequences by token budget with a document mask and the fused Triton LM-head reduction, in
  bf16; on CPU one sequence per forward (SDPA) and the chunked reduction, in float32;
* ours, chunked head (CUDA): the same packing with the torch reduction (the fused head's share);
* ours, unpacked (CUDA): one sequence per forward with SDPA and the chunked head (what the
  scorer ran on GPUs before flex packing);
* ours, packed with SDPA (CPU): a dense block-diagonal mask (not what the scorer does there);
* naive: padded batches (``--batch`` sequences), full float32 log-softmax over the whole
  vocabulary for every position, student and teacher in separate padded batches;
* bound: two bare forward passes over the same tokens (the decoder over every token, the
  LM head's logits over the rows that predict a scored token; no reduction), one sequence
  per forward; on CUDA also packed like ours (``bound, packed``). The faster of the two is
  what any scorer must at least spend.

Each method runs in its own process so that its peak memory is its own; on CUDA each runs
the whole workload once untimed first (flex attention compiles per packed length). Run:
``.venv/bin/python benchmarks/scorer.py [--preset short]``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from presets import PRESETS, build, flops_per_pass, peak_tflops

from services.scorer.logprobs import decoder_hidden_states, kernel_path, packed_batches, sequence_logprobs

WORKLOADS = {  # trajectories, min, median, max tokens
    "small": (16, 256, 1200, 4096),
    "short": (256, 32, 160, 512),
    "qwen3-30b-a3b": (16, 1024, 4096, 17_408),
}
MODEL_OF = {"small": "small", "short": "small", "qwen3-30b-a3b": "qwen3-30b-a3b"}
GOAL_VS_NAIVE, GOAL_VS_BOUND = 3.0, 0.95  # on a GPU (issue 26)


def sizes(args) -> tuple[int, int, int, int]:
    n, lo, median, hi = WORKLOADS[args.preset]
    return args.trajectories or n, args.min_len or lo, median, args.max_len or hi


def workload(seed: int, vocab: int, n: int, min_len: int, median: int, max_len: int):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, size=n), min_len, max_len).astype(int)
    requests = []
    for n_tok in lengths:
        prompt = int(n_tok * 0.3)
        student = rng.integers(0, vocab, n_tok).tolist()
        teacher = student[:prompt] + rng.integers(0, vocab, 24).tolist() + student[prompt:]
        requests.append((student, np.arange(prompt, n_tok)))
        requests.append((teacher, np.arange(prompt + 24, n_tok + 24)))
    return requests


def run_ours(model, requests, *, pack: bool | None, head: str | None, budget: int) -> None:
    sequence_logprobs(model, requests, token_budget=budget, chunk_size=1024, pack=pack, head=head)


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
def run_bound(model, requests, *, packed: bool, budget: int) -> None:
    """The irreducible work: the decoder over every token and the LM head over the rows that predict a
    scored token, with no reduction, no gather, no bookkeeping."""
    device = next(model.parameters()).device
    path = kernel_path(model, pack=packed, head="chunked")
    lengths = [len(ids) for ids, _ in requests]
    groups = packed_batches(lengths, budget) if packed else [[i] for i in range(len(requests))]
    for group in groups:
        ids = torch.tensor([t for i in group for t in requests[i][0]], device=device)
        hidden = decoder_hidden_states(model.model, ids, [lengths[i] for i in group], path)
        offsets = np.cumsum([0] + [lengths[i] for i in group])
        rows = np.concatenate([requests[i][1] - 1 + offsets[j] for j, i in enumerate(group)])
        rows = hidden[torch.as_tensor(rows, device=device)]
        for start in range(0, rows.shape[0], 1024):
            model.lm_head(rows[start : start + 1024])


METHODS = {  # name: (label, attention on CUDA, runner)
    "ours": (
        "ours (the scorer's path)",
        "flex_attention",
        lambda m, r, a: run_ours(m, r, pack=None, head=None, budget=a.budget),
    ),
    "ours-chunked": (
        "ours, chunked LM head",
        "flex_attention",
        lambda m, r, a: run_ours(m, r, pack=None, head="chunked", budget=a.budget),
    ),
    "ours-unpacked": (
        "ours, unpacked (SDPA, chunked head)",
        "sdpa",
        lambda m, r, a: run_ours(m, r, pack=False, head="chunked", budget=a.budget),
    ),
    "ours-packed-sdpa": (
        "ours, packed with SDPA's dense mask",
        "sdpa",
        lambda m, r, a: run_ours(m, r, pack=True, head="chunked", budget=a.budget),
    ),
    "naive": ("naive (padded, full log-softmax)", "sdpa", lambda m, r, a: run_naive(m, r, a.batch)),
    "bound": (
        "bound (2 bare forwards)",
        "sdpa",
        lambda m, r, a: run_bound(m, r, packed=False, budget=a.budget),
    ),
    "bound-packed": (
        "bound, packed like ours",
        "flex_attention",
        lambda m, r, a: run_bound(m, r, packed=True, budget=a.budget),
    ),
}
GPU_METHODS = ["ours", "ours-chunked", "ours-unpacked", "naive", "bound", "bound-packed"]
CPU_METHODS = ["ours", "naive", "bound", "ours-packed-sdpa"]


def progress(begun: float, what: str) -> None:
    """A line on stderr per stage, so a method stopped by --method-timeout says where its time went."""
    print(f"{what} at {time.perf_counter() - begun:.1f} s", file=sys.stderr, flush=True)


def one(method: str, args) -> dict:
    begun = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.set_num_threads(os.cpu_count() or 1)
    _, attention, run = METHODS[method]
    model = build(
        MODEL_OF[args.preset],
        layers=args.layers,
        device=device,
        dtype=dtype,
        attention=attention if cuda else "sdpa",
        max_positions=max(32_768, (args.max_len or WORKLOADS[args.preset][3]) + 64),
    )
    requests = workload(args.seed, model.config.vocab_size, *sizes(args))
    progress(begun, "model built")
    out = {
        "method": method,
        "device": device,
        "attention": model.config._attn_implementation,
        # transformers picks the MoE experts' kernels (a per-expert loop, or grouped_mm where it dispatches)
        "experts": getattr(model.config, "_experts_implementation", None) or "eager",
    }
    if method.startswith("ours"):
        path = kernel_path(
            model,
            pack={"ours-unpacked": False, "ours-packed-sdpa": True}.get(method),
            head="chunked" if method != "ours" else None,
        )
        out["path"] = f"{path.attention}, {'packed' if path.pack else 'one per forward'}, {path.head} head"
    warmup = requests if cuda else workload(args.seed + 1, model.config.vocab_size, 2, 64, 96, 128)
    try:
        run(model, warmup, args)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        progress(begun, "warm-up done")
        start = time.perf_counter()
        run(model, requests, args)
        if cuda:
            torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - start
    except torch.OutOfMemoryError:
        out["error"] = "out of memory"
        return out
    lengths = [len(ids) for ids, _ in requests]
    out["tokens"] = sum(lengths)
    out["scored_tokens"] = int(sum(len(p) for _, p in requests))
    out["params"] = sum(p.numel() for p in model.parameters())
    if cuda:
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
        peak = peak_tflops()
        if peak:
            flops = flops_per_pass(model.config, lengths, out["scored_tokens"])
            out["mfu"] = flops / out["seconds"] / (peak * 1e12)
    else:
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.profile:  # after the timed run's figures are read: the profiler's buffers count in a peak RSS
        profile(run, model, requests, args, cuda)
    return out


def profile(run, model, requests, args, cuda: bool) -> None:
    """One more untimed run under torch's profiler: on stderr, the ops that took the most device (or CPU)
    time, and how much of the wall time the device was busy. A device busy for a small share of the
    wall is waiting on the host (kernel launches, syncs), and fewer, larger kernels are the cure."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profiler(activities=activities) as prof:
        start = time.perf_counter()
        run(model, requests, args)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=args.profile), file=sys.stderr)
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6  # device_time is in microseconds
        print(
            f"profile: {len(kernels):,} device kernels, busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms wall "
            f"({busy / wall:.0%}; the profiler adds host time)",
            file=sys.stderr,
        )


def run_method(method: str, passthrough: list[str], timeout: float | None, logs: Path | None) -> dict:
    """One method in a process of its own: its result, or ``{"method", "error"}``. The child's whole
    stderr (stage lines, compile logs, a stack dump just before a timeout) goes to
    ``logs/<method>.log``, or to a scratch file without ``logs``."""
    if timeout:  # the child dumps its stacks shortly before the kill, so a stuck method says where
        passthrough = [*passthrough, f"--stack-dump-after={max(1.0, timeout - 5)}"]
    with tempfile.TemporaryDirectory() as scratch:
        path = (logs or Path(scratch)) / f"{method}.log"
        with path.open("w") as log:
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--method", method, *passthrough],
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                done = None
        lines = path.read_text(errors="replace").splitlines()
    if done is None:
        stages = [line for line in lines if " at " in line and line.endswith(" s")]
        last = f" (last: {stages[-1][:80]})" if stages else ""
        return {"method": method, "error": f"timed out after {timeout:g} s{last}"}
    if done.returncode != 0:
        return {"method": method, "error": (lines or ["failed"])[-1][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(WORKLOADS), default="small")
    ap.add_argument("--layers", type=int, help="override the preset's number of layers")
    ap.add_argument(
        "--method", choices=sorted(METHODS), help="run one method (the parent runs each in a child)"
    )
    ap.add_argument("--methods", help="comma-separated subset of the device's methods")
    ap.add_argument("--trajectories", type=int)
    ap.add_argument("--min-len", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--batch", type=int, default=4, help="naive: sequences per padded batch")
    ap.add_argument("--budget", type=int, default=16_384, help="ours: tokens per packed forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--method-timeout", type=float, help="seconds a method may take (its build, warm-up and timed run)"
    )
    ap.add_argument("--logs", type=Path, help="a folder for each method's whole stderr (<method>.log)")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after the timed run, a profiled one: the top ROWS ops",
    )
    ap.add_argument("--stack-dump-after", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.method:
        if args.stack_dump_after:
            faulthandler.dump_traceback_later(args.stack_dump_after, file=sys.stderr)
        print(json.dumps(one(args.method, args)))
        return
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    methods = args.methods.split(",") if args.methods else (GPU_METHODS if cuda else CPU_METHODS)
    passthrough = [
        f"--preset={args.preset}",
        f"--batch={args.batch}",
        f"--budget={args.budget}",
        f"--seed={args.seed}",
        f"--profile={args.profile}",
    ]
    for name in ("layers", "trajectories", "min_len", "max_len"):
        if getattr(args, name) is not None:
            passthrough.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    results = {}
    for m in methods:
        results[m] = run_method(m, passthrough, args.method_timeout, args.logs)
        print(json.dumps(results[m]), file=sys.stderr, flush=True)  # survives a kill before the table
    report(args, methods, results)


def report(args, methods: list[str], results: dict) -> None:
    done = {m: r for m, r in results.items() if "seconds" in r}
    any_r = next(iter(done.values()), None)
    if any_r is None:
        print(json.dumps(results, indent=1))
        return
    config = PRESETS[MODEL_OF[args.preset]]
    layers = args.layers or config["num_hidden_layers"]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, device {any_r['device']}"
        + (f" ({any_r.get('gpu')})" if any_r.get("gpu") else "")
        + f", Python {platform.python_version()}, torch {torch.__version__}"
        + (", bf16" if any_r["device"] == "cuda" else ", float32")
    )
    print(
        f"preset {args.preset}: {2 * sizes(args)[0]} sequences (student + teacher), {any_r['tokens']:,} tokens, "
        f"{any_r['scored_tokens']:,} scored; Qwen3-MoE {layers} layers, {config['num_experts']} experts top-"
        f"{config['num_experts_per_tok']}, hidden {config['hidden_size']}, vocabulary {config['vocab_size']:,}, "
        f"{any_r['params'] / 1e9:.2f}B parameters"
    )
    mfu = any("mfu" in r for r in done.values())
    print(f"{'method':40} {'seconds':>8} {'scored tok/s':>13} {'peak MB':>9}" + ("    MFU" if mfu else ""))
    for m in methods:
        x = results[m]
        label = METHODS[m][0]
        if "seconds" not in x:
            print(f"{label:40} {x.get('error', 'failed')}")
            continue
        tail = f"  {x['mfu'] * 100:5.1f}%" if "mfu" in x else ""
        print(
            f"{label:40} {x['seconds']:8.2f} {x['scored_tokens'] / x['seconds']:13,.0f} {x['peak_mb']:9,.0f}{tail}"
        )
    if "ours" in done:
        print(f"ours' path: {done['ours']['path']}; MoE experts: {done['ours'].get('experts')}")
        ours = done["ours"]["seconds"]
        if "naive" in done:
            print(
                f"ours vs naive: {done['naive']['seconds'] / ours:.2f}x faster "
                f"(goal on a GPU >= {GOAL_VS_NAIVE:.0f}x), {done['naive']['peak_mb'] / done['ours']['peak_mb']:.2f}x less peak memory"
            )
        bounds = [done[b]["seconds"] for b in ("bound", "bound-packed") if b in done]
        if bounds:
            print(
                f"ours vs bound: {min(bounds) / ours:.2f} of the bound's speed (goal on a GPU >= {GOAL_VS_BOUND})"
            )


if __name__ == "__main__":
    main()
