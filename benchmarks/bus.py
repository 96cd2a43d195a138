"""Bus throughput: trajectory groups (G = 8, 64K tokens each, with log-probs) from a
producer to an acknowledging consumer through a private redis-server.

Baseline: the same messages as naive JSON (token ids and log-probs as lists of
numbers) through the same Redis calls. Run: ``.venv/bin/python benchmarks/bus.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

import numpy as np
import redis.asyncio as aioredis

from proto import decode, encode
from proto.examples import example_group
from proto.messages import TrajectoryGroup
from proto.streams import TRAJECTORIES
from services.bus import Bus, ConsumerOptions
from services.local_redis import LocalRedis


def naive_json(group: TrajectoryGroup) -> bytes:
    """What a JSON-everything design would put on the wire."""
    data = group.model_dump(mode="python")
    for t in data["trajectories"]:
        for key in ("prompt_ids", "completion_ids", "loss_mask", "rollout_logprobs"):
            arr = np.frombuffer(t[key]["data"], dtype=t[key]["dtype"])
            t[key] = arr.tolist()
    return json.dumps(data).encode()


async def run_bus(url: str, groups: list[TrajectoryGroup]) -> float:
    bus = Bus.from_url(url, prefix="bench-bin")
    await bus.ensure_group(TRAJECTORIES)
    done = asyncio.Event()
    count = 0

    async def handler(msg, delivery):
        nonlocal count
        count += 1
        if count == len(groups):
            done.set()

    stop = asyncio.Event()
    opts = ConsumerOptions(block_ms=100, trim_interval_s=0.5)
    consumer = asyncio.create_task(bus.consume(TRAJECTORIES, "bench", handler, options=opts, stop=stop))
    start = time.perf_counter()
    for g in groups:
        await bus.publish(TRAJECTORIES, g)
    await done.wait()
    elapsed = time.perf_counter() - start
    stop.set()
    await consumer
    await bus.close()
    return elapsed


async def run_naive(url: str, payloads: list[bytes]) -> float:
    r = aioredis.Redis.from_url(url)
    key = "bench-json:trajectories"
    await r.xgroup_create(key, "g", id="0", mkstream=True)

    async def consume():
        seen = 0
        while seen < len(payloads):
            reply = await r.xreadgroup("g", "c", {key: ">"}, count=1, block=100)
            for _k, entries in reply or []:
                for entry_id, fields in entries:
                    TrajectoryGroup.model_validate(json.loads(fields[b"data"]))
                    await r.xack(key, "g", entry_id)
                    await r.xdel(key, entry_id)
                    seen += 1

    start = time.perf_counter()
    consumer = asyncio.create_task(consume())
    for p in payloads:
        await r.xadd(key, {b"data": p})
    await consumer
    elapsed = time.perf_counter() - start
    await r.aclose()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65_536)
    args = ap.parse_args()

    groups = [
        example_group(args.group_size, tokens=args.tokens, turns=40, seed=i) for i in range(args.groups)
    ]
    binary = encode(groups[0])
    naive = naive_json(groups[0])
    assert decode(TrajectoryGroup, binary) == groups[0]
    naive_payloads = [naive_json(g) for g in groups]
    tokens = args.group_size * (args.tokens + 16)

    with LocalRedis() as server:
        t_bin = asyncio.run(run_bus(server.url, groups))
        t_json = asyncio.run(run_naive(server.url, naive_payloads))

    mb_bin = len(binary) * args.groups / 1e6
    mb_json = sum(len(p) for p in naive_payloads) / 1e6
    print(
        f"machine: {platform.machine()}, {platform.processor() or platform.platform()}, Python {platform.python_version()}"
    )
    print(
        f"message: G={args.group_size} x {args.tokens} completion tokens ({tokens:,} tokens with prompts), ids + mask + log-probs"
    )
    print(f"{'':24}{'binary (ours)':>16}{'naive JSON':>16}")
    print(f"{'message size (MB)':24}{len(binary) / 1e6:>16.2f}{len(naive) / 1e6:>16.2f}")
    print(f"{'groups/s':24}{args.groups / t_bin:>16.2f}{args.groups / t_json:>16.2f}")
    print(f"{'MB/s (payload)':24}{mb_bin / t_bin:>16.1f}{mb_json / t_json:>16.1f}")
    print(f"{'tokens/s':24}{tokens * args.groups / t_bin:>16,.0f}{tokens * args.groups / t_json:>16,.0f}")
    print(f"binary is {len(naive) / len(binary):.1f}x smaller and {t_json / t_bin:.1f}x faster end to end")


if __name__ == "__main__":
    main()
