"""What a rollout worker's keeps of a group cost (services/rollout/begun.py).

A worker keeps each group it samples every PBSD_ROLLOUT_KEEP_EVERY_S, once the group has grown
by PBSD_ROLLOUT_KEEP_GROWTH of its tokens, so a worker killed outright leaves its last keep.

1. One keep of the paper's largest group (G = 8 trajectories of 64,500 completion tokens: a
   500-token prompt, then 150 exchanges of a 200-token turn and a 230-token tool result),
   without routes and with a 48-layer top-8 model's routes: copying it out of the trajectories
   (in a thread, as the worker does), encoding it, and storing it in a private Redis, with the
   event loop's longest stall meanwhile. Baseline: publishing a finished group of the same
   shape once, as every group is (``proto.examples.example_group``, as benchmarks/bus.py makes it).
   The bus writes a large command a MiB slice at a time (services/bus/connection.py); baseline:
   the same SET through redis-py's own connection, which writes it whole. Then the next worker's
   read of the keep (``Bus.kept``: GETRANGE a few MiB at a time, services/bus/slices.py, and the
   decoding, in a thread past 64 KiB as every read of the bus decodes) and its stall; baselines:
   one GET of the whole value and the same decoding (the read before the slices), and decoding it
   on the loop. The decoding alone, in a thread, from the slices a piece at a time (ours) beside
   joining them and unpacking the whole (the baseline).
2. What the keeps write over the group's life: the group grows one exchange per trajectory at a
   time, and a keep round follows every exchange (the worst case: keep_every_s shorter than a
   turn). Figure: tokens written by the keeps (prompts and completions, which the bytes follow)
   over the group's final size, with the growth rule (ours) and without it (a keep at every
   round that moved, the baseline). Goal: 1 + 1/growth.

The process sets what it imported aside from the garbage collector, as the rollout worker does
while it serves (services/gc_freeze.py): a full collection of it otherwise held the loop for
about 110 ms during whichever step it fell in.

Run: ``.venv/bin/python benchmarks/keeps.py [--repeats 3] [--no-routes]``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import time
from collections import defaultdict
from statistics import median

import numpy as np
import redis.asyncio as aioredis
from loop_stalls import Stalls, cells, ms  # benchmarks/, on the path when run as a script

from proto.base import decode, encode
from proto.examples import example_group, example_task
from proto.handback import HandedBack
from proto.messages import PromptTask
from proto.runs import RolloutSpec
from proto.streams import TRAJECTORIES
from services.bus import Bus
from services.bus.decoding import decoded
from services.bus.slices import READ_SLICE_BYTES
from services.gc_freeze import frozen_while_serving
from services.local_redis import LocalRedis
from services.rollout.agent import _Builder
from services.rollout.begun import Begun, KeepsBegun, handed_back

G, PROMPT, EXCHANGES, TURN, GLUE = 8, 500, 150, 200, 230
LAYERS, TOP_K = 48, 8


def _task() -> PromptTask:
    return example_task().model_copy(
        update={"rollout": RolloutSpec(group_size=G, return_routed_experts=True)}
    )


class _Group:
    """A begun group whose trajectories grow an exchange at a time, as the agent loop grows them."""

    def __init__(self, routes: bool) -> None:
        self.routes = routes
        self.begun = Begun(_task())
        self.begun.take_up(None)
        self.builders, self.versions = [], []
        for i, progress in enumerate(self.begun.slots):
            b, versions = _Builder(list(range(PROMPT))), []
            progress.follow(b, [], versions, (f"bench:0/{i}", i, f"bench:0/{i}#b"))
            self.builders.append(b)
            self.versions.append(versions)

    def exchange(self) -> None:
        for b, versions, progress in zip(self.builders, self.versions, self.begun.slots, strict=True):
            first = not b.spans
            b.generated([7] * TURN, [-0.5] * TURN)
            versions.append(0)
            if self.routes:  # the engine routes what it was fed since last time and what it wrote
                rows = PROMPT + TURN - 1 if first else GLUE + TURN
                b.routes.append(np.full((rows, LAYERS, TOP_K), 3, dtype=np.uint8))
                b.routed += rows
            b.glue([9] * GLUE)
            progress.mark(0.0)


class _Recording:
    """A bus that notes the tokens of each keep (prompts and completions) instead of storing it."""

    def __init__(self) -> None:
        self.written = 0

    async def keep(self, name, message, *, ttl_s) -> None:
        self.written += message.tokens

    async def prolong(self, name, *, ttl_s) -> None:
        return None


class _Keeper(KeepsBegun):
    def __init__(self, bus, growth: float) -> None:
        self.bus, self.begun, self.keep_every_s, self.keep_growth = bus, {}, 1.0, growth


async def _written_over_life(growth: float) -> float:
    group, bus = _Group(routes=False), _Recording()
    keeper = _Keeper(bus, growth)
    for _ in range(EXCHANGES):
        group.exchange()
        await keeper._keep(group.begun, growth)
    return bus.written / group.begun.tokens()


async def _on_loop(fn, *args):
    return fn(*args)


def _joined_decode(slices: list[bytes]) -> HandedBack:
    return decode(HandedBack, b"".join(slices))


async def _read_whole(bus: Bus, name: str) -> HandedBack:
    """The read of a keep before the slices: one GET, then the bus's decoding."""
    return await decoded(HandedBack, await bus.redis.get(f"{bus.prefix}:{name}"))


async def _one_keep(url: str, routes: bool, repeats: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """The keep's size in MB, and for each step the median of its times and the longest loop stall
    of its repeats (seconds)."""
    group = _Group(routes)
    for _ in range(EXCHANGES):
        group.exchange()
    # the baseline: the same group finished, as the bus benchmark makes it
    finished = example_group(
        G,
        tokens=EXCHANGES * (TURN + GLUE),
        turns=EXCHANGES,
        prompt_tokens=PROMPT,
        routed_experts=(LAYERS, TOP_K) if routes else None,
    )
    bus = Bus.from_url(url, prefix="bench")
    plain = aioredis.Redis.from_url(url)  # redis-py's own connection: the command written whole
    timed: dict[str, list[Stalls]] = defaultdict(list)

    async def measure(step: str, work):
        async with Stalls() as stalls:
            result = await work
        timed[step].append(stalls)
        return result

    for _ in range(repeats):
        kept = await measure("copy", asyncio.to_thread(handed_back, group.begun))
        payload = await measure("encode", asyncio.to_thread(encode, kept))
        await measure("keep", bus.keep("handback:bench", kept, ttl_s=60))  # encodes again, then SET
        back = await measure("read", bus.kept("handback:bench", HandedBack))
        whole = await measure("read_whole", _read_whole(bus, "handback:bench"))
        assert whole == back
        # the decoding alone, in a thread: from the slices as read (ours) and from them joined
        slices = [payload[i : i + READ_SLICE_BYTES] for i in range(0, len(payload), READ_SLICE_BYTES)]
        assert await measure("decode_slices", asyncio.to_thread(decode, HandedBack, slices)) == back
        assert await measure("decode_joined", asyncio.to_thread(_joined_decode, slices)) == back
        # on the loop: what the read did before
        assert await measure("decode_inline", _on_loop(decode, HandedBack, payload)) == back
        await measure("set_whole", plain.set("handback:bench-whole", payload, px=60_000))
        await measure("set_sliced", bus.redis.set("handback:bench-sliced", payload, px=60_000))
        await measure("publish", bus.publish(TRAJECTORIES, finished))
        await bus.redis.delete(bus.key(TRAJECTORIES))
    await bus.close()
    await plain.aclose()
    steps = {k: (median(s.took for s in v), max(s.longest for s in v)) for k, v in timed.items()}
    return len(payload) / 1e6, steps


async def main(repeats: int, routes: bool) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit.strip()}, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    print(f"\n1. one keep of G = {G} x {EXCHANGES * (TURN + GLUE):,} tokens (median of {repeats})")
    print(
        "| routes | MB | copy ms | encode ms | keep (encode + SET) ms | baseline: publish the group once, ms | longest loop stall, copy / keep / publish ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    with LocalRedis() as redis:
        for with_routes in (False, True) if routes else (False,):
            mb, r = await _one_keep(redis.url, with_routes, repeats)
            name = f"{LAYERS} layers x top-{TOP_K}" if with_routes else "none"
            rows.append((name, r))
            times = " | ".join(ms(r[step][0]) for step in ("copy", "encode", "keep", "publish"))
            stalls = " / ".join(ms(r[step][1]) for step in ("copy", "keep", "publish"))
            print(f"| {name} | {mb:.1f} | {times} | {stalls} |")
    print("\n   the SET of the encoded keep alone (goal: a loop stall of a few ms at most)")
    print(
        "| routes | ours, in slices: ms / loop stall ms | baseline: redis-py writing it whole, ms / stall ms |"
    )
    print("|---|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {cells(r, 'set_sliced', 'set_whole')} |")
    print("\n   the next worker reads the keep back (goal: no stall longer than decoding on the loop)")
    print(
        "| routes | ours, in slices + decode: ms / loop stall ms | baseline: one GET + decode | baseline: decode on the loop |"
    )
    print("|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {cells(r, 'read', 'read_whole', 'decode_inline')} |")
    print(
        "\n   decoding the keep in a thread: from its slices, a piece at a time (ours), and from them joined"
    )
    print("| routes | ours: ms / loop stall ms | baseline: joined, then one unpackb: ms / stall ms |")
    print("|---|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {cells(r, 'decode_slices', 'decode_joined')} |")
    print(f"\n2. tokens the keeps write over the group's life ({EXCHANGES} exchanges, a round after each)")
    print("| rule | written / final size | goal |")
    print("|---|---:|---:|")
    for growth in (0.25, 0.1):
        print(f"| ours, growth {growth} | {await _written_over_life(growth):.2f} | <= {1 + 1 / growth:.0f} |")
    print(f"| baseline: every round that moved | {await _written_over_life(0.0):.2f} | |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-routes", action="store_true", help="skip the group with routes (200 MB)")
    args = parser.parse_args()
    with frozen_while_serving("the benchmark"):  # as the rollout worker serves: services/gc_freeze.py
        asyncio.run(main(args.repeats, not args.no_routes))
