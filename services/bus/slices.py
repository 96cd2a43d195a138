"""Reading a large string value from Redis a slice at a time, as it stood at one moment.

A rollout worker's keep of a group is one string of up to the bus's message limit (about 200 MB
with a MoE policy's routes). Read with one GET, the reply is parsed on the event loop as it comes
in, and hiredis gathers 200 MB into one buffer as it goes: on a 2-core VM the read and its
decoding took 1.0-1.5 s and held the loop for 0.84-1.1 s at a time, while the worker's heartbeats
and its other trajectories waited. GETRANGE a few MiB at a time parses small replies, the loop
runs between them, and the read and decoding take 0.49-0.59 s with stalls of 12-14 ms
(benchmarks/keeps.py).

Slices are read under WATCH and closed with an empty MULTI/EXEC, which Redis refuses if the key
was written, prolonged, removed or expired meanwhile: the slices then come from one value, never
half of a keep and half of the next, and the read goes round again. A value cut short is caught
by its length where EXEC does not say (Redis before 6.0.9 does not count an expiry as a write).
A read that a writer keeps interrupting falls back to one GET, which Redis answers whole.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import WatchError

__all__ = ["READ_SLICE_BYTES", "TRIES", "read_value"]

# a 200 MB value read in 1 MiB slices took about as long, in 16 MiB ones longer (an ad-hoc
# measurement on the 2-core VM of benchmarks/README.md, "keeps")
READ_SLICE_BYTES = 4 << 20
TRIES = 3


async def read_value(redis: aioredis.Redis, key: str) -> list[bytes] | None:
    """The string at ``key`` as its slices, in order (``b"".join`` them), or None where there is
    no value or it is empty. A value no longer than a slice is one GETRANGE, one round trip."""
    for _ in range(TRIES):
        try:
            async with redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                first = await pipe.getrange(key, 0, READ_SLICE_BYTES - 1)
                if len(first) < READ_SLICE_BYTES:  # the whole value: one command is atomic
                    return [first] if first else None
                size = await pipe.strlen(key)
                slices = [first]
                for start in range(READ_SLICE_BYTES, size, READ_SLICE_BYTES):
                    slices.append(await pipe.getrange(key, start, start + READ_SLICE_BYTES - 1))
                pipe.multi()
                await pipe.execute()  # WatchError: the key changed after WATCH
            # short: it expired as it was read, which Redis before 6.0.9 does not count as a write
            if sum(map(len, slices)) == size:
                return slices
        except WatchError:  # also what redis-py raises when the connection breaks while watching
            pass
    value = await redis.get(key)
    return [value] if value else None
