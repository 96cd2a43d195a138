"""What a consumer's read of a large stream entry costs, with and without claims
(services/bus/claims.py).

The paper's largest group (G = 8 trajectories of 64,500 completion tokens, a 48-layer top-8
model's routes: about 200 MB) and the same group without routes (about 5 MB), published to the
trajectories stream of a private redis-server on loopback and read back by a consumer of its
group (``Bus.collect`` of one, then ``Bus.commit``, as the trainer reads). Ours: the entry names
a claim, which the consumer reads a few MiB at a time and decodes from its slices. Baseline: the
same bus with claims off (``claim_bytes=None``), the payload in the entry, which XREADGROUP
returns in one reply. For each: the publish and the read, their times and the event loop's
longest stall (a 5 ms sleep timed over and over), median and longest of the repeats. Goal: a
read that stalls the consumer's loop for no longer than one slice's decoding, tens of ms, where
the whole entry held it for the length of its reply.

Run: ``.venv/bin/python benchmarks/claims.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import time
import uuid
from collections import defaultdict
from statistics import median

from loop_stalls import Stalls, cells  # benchmarks/, on the path when run as a script

from proto.base import encode
from proto.examples import example_group
from proto.streams import TRAJECTORIES
from services.bus import Bus, ConsumerOptions
from services.local_redis import LocalRedis

G, TOKENS, TURNS, PROMPT = 8, 64_500, 150, 500
LAYERS, TOP_K = 48, 8
OPTIONS = ConsumerOptions(block_ms=100, trim_interval_s=0.0)


async def _read_one(bus: Bus) -> list:
    """One group, as the trainer reads: collected, then committed; its (entry id, message)."""
    held = await bus.collect(TRAJECTORIES, "bench", 1, _accept, options=OPTIONS)
    items = list(held.items)
    await bus.commit(held)
    return items


async def _accept(message) -> bool:
    return True


async def _measure(url: str, routes: bool, repeats: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """The group's size in MB, and for each step the median of its times and the longest loop
    stall of its repeats (seconds)."""
    group = example_group(
        G,
        tokens=TOKENS,
        turns=TURNS,
        prompt_tokens=PROMPT,
        routed_experts=(LAYERS, TOP_K) if routes else None,
    )
    buses = {
        "claimed": Bus.from_url(url, prefix="claimed"),
        "inline": Bus.from_url(url, prefix="inline", claim_bytes=None),
    }
    timed: dict[str, list[Stalls]] = defaultdict(list)
    for _ in range(repeats):
        for name, bus in buses.items():  # alternating, so a drift of the machine hits both
            await bus.ensure_group(TRAJECTORIES)
            sent = group.model_copy(update={"message_id": uuid.uuid4().hex})  # not a duplicate
            async with Stalls() as stalls:
                await bus.publish(TRAJECTORIES, sent)
            timed[f"publish_{name}"].append(stalls)
            async with Stalls() as stalls:
                [(_entry_id, read)] = await _read_one(bus)
            timed[f"read_{name}"].append(stalls)
            assert read == sent
            # freed here, not as the next repeat's read replaces it: the 200 MB group took 14-19 ms
            # to free, which the read's stall counted
            del read
            await bus.trim_acked(TRAJECTORIES)
            assert await bus.stream_length(TRAJECTORIES) == 0
            assert not await bus.redis.keys(f"{bus.key(TRAJECTORIES)}:claim:*")  # gone with its entry
    for bus in buses.values():
        await bus.close()
    steps = {k: (median(s.took for s in v), max(s.longest for s in v)) for k, v in timed.items()}
    return len(encode(group)) / 1e6, steps


async def main(repeats: int) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit.strip()}, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    print(f"\none group of G = {G} x {TOKENS:,} tokens through the trajectories stream (median of {repeats})")
    print(
        "| routes | MB | read, claimed (ours): ms / longest loop stall ms | baseline: read whole from the entry "
        "| publish, claimed (ours) | baseline: publish into the entry |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    with LocalRedis() as redis:
        for routes in (False, True):
            mb, r = await _measure(redis.url, routes, repeats)
            name = f"{LAYERS} layers x top-{TOP_K}" if routes else "none"
            row = cells(r, "read_claimed", "read_inline", "publish_claimed", "publish_inline")
            print(f"| {name} | {mb:.1f} | {row} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args().repeats))
