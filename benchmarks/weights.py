"""Publishing a policy version: the disk round trip against the in-memory broadcast, in GB/s.

For each model size (a :mod:`presets` shape with a number of layers; random weights):

* disk (the baseline): the trainer writes the checkpoint (``save_checkpoint``, what
  ``save_weights`` does) and a consumer reloads it into its model (``load_weights_into``, what
  the scorer and the in-process engine do); effective GB/s = checkpoint bytes / (write + reload).
  The reload reads the file the write just left in the page cache: the disk's best case.
* broadcast (ours): ``WeightBroadcaster.publish`` to ``--receivers`` receiver processes, each a
  ``LocalScorer`` behind the weight-update routes (:mod:`services.weights.receiver`); a version is
  in when ``publish`` returns (pause, every bucket received into the receivers' models, continue).
  Effective GB/s = checkpoint bytes / publish seconds, the median over versions 2.. (version 1
  also forms the group and learns the layout; it is printed apart).

Backends: NCCL on CUDA (the trainer on ``cuda:0``, receiver k on ``cuda:k``: NCCL wants a GPU per
rank, so it needs ``--receivers`` + 1 GPUs); gloo otherwise, through host memory. CPU seconds of
the trainer's process are printed beside the wall seconds (shared machines: guide by them).

Goal (issue 26): >= 10 GB/s effective on one GPU node.

Run: ``.venv/bin/python benchmarks/weights.py [--sizes small:4,small:16] [--receivers 1]``
(defaults: on CUDA ``qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-30b-a3b:12`` in bf16, else
``tiny:2,small:4,small:16`` in float32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from presets import build

from services.local_redis import free_port
from services.model.checkpoint import load_weights_into, save_checkpoint
from services.weights.layout import HubLayout
from services.weights.sender import WeightBroadcaster

GOAL_GBPS = 10.0
CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


def _model(preset: str, layers: int, device: str, dtype: torch.dtype):
    return build(preset, layers=layers, device=device, dtype=dtype, max_positions=4096)


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


# -- a receiver process ---------------------------------------------------------------------------
def serve(args) -> None:
    import uvicorn
    from fastapi import FastAPI

    from services.scorer.backends import LocalScorer
    from services.weights.receiver import WeightReceiver, add_weight_routes

    preset, layers = args.serve.split(":")
    scorer = LocalScorer(_model(preset, int(layers), args.device, getattr(torch, args.dtype)))
    app = FastAPI()
    add_weight_routes(app, WeightReceiver(lambda: scorer))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def start_receivers(size: str, n: int, dtype: str) -> tuple[list[subprocess.Popen], list[str]]:
    processes, urls = [], []
    for k in range(n):
        port = free_port()
        device = f"cuda:{k + 1}" if CUDA else "cpu"
        command = [sys.executable, __file__, "--serve", size, "--port", str(port), "--device", device]
        processes.append(subprocess.Popen([*command, "--dtype", dtype], cwd=ROOT))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/model_info", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"receiver {url} did not start")
    return processes, urls


# -- the two ways ---------------------------------------------------------------------------------
def disk_round(model, consumer, directory: Path) -> dict:
    cpu, start = time.process_time(), time.perf_counter()
    path = save_checkpoint(model, directory / "v")
    written, cpu_written = time.perf_counter(), time.process_time()
    load_weights_into(consumer, path)
    _sync()
    done = time.perf_counter()
    shutil.rmtree(path)
    return {
        "write_s": written - start,
        "reload_s": done - written,
        "cpu_write_s": cpu_written - cpu,
        "cpu_reload_s": time.process_time() - cpu_written,
    }


async def broadcast_rounds(model, urls: list[str], backend: str, bucket_mb: int, versions: int) -> list[dict]:
    broadcaster = WeightBroadcaster(
        urls, master_address="127.0.0.1", backend=backend, bucket_bytes=bucket_mb << 20, timeout_s=900
    )
    rounds = []
    try:
        for version in range(1, versions + 1):
            cpu, start = time.process_time(), time.perf_counter()
            left_out = await broadcaster.publish(model, version)
            _sync()
            if left_out:
                raise RuntimeError(f"{left_out} left out of the group")
            rounds.append({"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu})
    finally:
        await broadcaster.aclose()
    return rounds


def measure(size: str, args) -> dict:
    preset, layers = size.split(":")
    dtype = getattr(torch, args.dtype)
    model = _model(preset, int(layers), "cuda:0" if CUDA else "cpu", dtype)
    gb = sum(p.nbytes for p in HubLayout(model).pieces) / 1e9
    consumer = _model(
        preset, int(layers), "cuda:1" if CUDA and torch.cuda.device_count() > 1 else model.device.type, dtype
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        disk = disk_round(model, consumer, Path(tmp))
    del consumer
    backend = "nccl" if CUDA and torch.cuda.device_count() > args.receivers else "gloo"
    processes, urls = start_receivers(size, args.receivers, args.dtype)
    try:
        rounds = asyncio.run(broadcast_rounds(model, urls, backend, args.bucket_mb, args.versions))
    finally:
        for p in processes:
            p.kill()
            p.wait()
    steady = statistics.median(r["s"] for r in rounds[1:]) if len(rounds) > 1 else rounds[0]["s"]
    disk_s = disk["write_s"] + disk["reload_s"]
    return {
        "size": size,
        "gb": gb,
        "backend": backend,
        "receivers": args.receivers,
        **disk,
        "disk_gbps": gb / disk_s,
        "broadcast_first_s": rounds[0]["s"],
        "broadcast_s": steady,
        "broadcast_cpu_s": statistics.median(r["cpu_s"] for r in rounds[1:] or rounds),
        "broadcast_gbps": gb / steady,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_sizes = "qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-30b-a3b:12" if CUDA else "tiny:2,small:4,small:16"
    parser.add_argument("--sizes", default=default_sizes, help="preset:layers, comma-separated")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument(
        "--versions", type=int, default=4, help="broadcast versions per size (the first warms up)"
    )
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16" if CUDA else "float32")
    parser.add_argument("--dir", default=None, help="where the disk baseline writes (default: the temp dir)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    device = torch.cuda.get_device_name() if CUDA else platform.processor() or platform.machine()
    print(
        f"# {device}, torch {torch.__version__}, {args.dtype}, {args.receivers} receiver(s), goal {GOAL_GBPS} GB/s"
    )
    header = (
        f"{'size':>18} {'GB':>7} | {'write s':>8} {'reload s':>8} {'disk GB/s':>9} | "
        f"{'first s':>8} {'bcast s':>8} {'cpu s':>7} {'bcast GB/s':>10} {'backend':>7} | {'x disk':>6} {'goal':>5}"
    )
    print(header)
    for size in args.sizes.split(","):
        r = measure(size, args)
        print(
            f"{r['size']:>18} {r['gb']:7.3f} | {r['write_s']:8.2f} {r['reload_s']:8.2f} {r['disk_gbps']:9.2f} | "
            f"{r['broadcast_first_s']:8.2f} {r['broadcast_s']:8.2f} {r['broadcast_cpu_s']:7.2f} "
            f"{r['broadcast_gbps']:10.2f} {r['backend']:>7} | {r['broadcast_gbps'] / r['disk_gbps']:6.1f} "
            f"{'yes' if r['broadcast_gbps'] >= GOAL_GBPS else 'no':>5}",
            flush=True,
        )
        print(json.dumps(r), file=sys.stderr)


if __name__ == "__main__":
    main()
