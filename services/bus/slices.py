"""Reading a large string value from Redis a slice at a time, as it stood at one moment.

A rollout worker's keep of a group is one string of up to the bus's message limit (about 200 MB
with a MoE policy's routes). Read with one GET, the reply is parsed on the event loop as it comes
in, and hiredis gathers 200 MB into one buffer as it goes: on a 2-core VM the read and its
decoding took 1.0-1.5 s and held the loop for 0.49-1.1 s at a time, while the worker's heartbeats
and its other trajectories waited. GETRANGE a few MiB at a time parses small replies, the loop
runs between them, and the read and decoding take 0.38-0.59 s with stalls of 11-15 ms
(benchmarks/keeps.py, six runs).

A value longer than a slice is read on a connection of its own under WATCH and closed with an
empty MULTI/EXEC, which Redis refuses if the key was written, prolonged, removed or expired
meanwhile: the slices then come from one value, never half of a keep and half of the next, and
the read goes round again. A value cut short is caught by its length where EXEC does not say
(Redis before 6.0.9 does not count an expiry as a write). A read that a writer keeps
interrupting, or whose connection keeps breaking, falls back to one GET, which Redis answers
whole and the client retries through an outage.

The watched read sends its commands on the connection itself, not through redis-py's
pipeline: a pipeline cut off (cancelled, its connection broken) undoes its WATCH by sending
UNWATCH on a fresh connection, so a cancelled read waited for a stalled Redis and could end
in a TimeoutError instead. Here a read that does not end cleanly drops its connection, which
ends its WATCH with it, before it goes back to the pool.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from services.bus.connection import REDIS_DOWN

__all__ = ["READ_SLICE_BYTES", "TRIES", "read_value"]

# a 200 MB value read in 1 MiB slices took about as long, in 16 MiB ones longer (an ad-hoc
# measurement on the 2-core VM of benchmarks/README.md, "keeps")
READ_SLICE_BYTES = 4 << 20
TRIES = 3


async def read_value(redis: aioredis.Redis, key: str, *, large: bool = False) -> list[bytes] | None:
    """The string at ``key`` as its slices, in order (``b"".join`` them), or None where there is
    no value or it is empty. A value shorter than a slice is one GETRANGE, one round trip.
    ``large``: the caller knows the value is longer than a slice (a claim), and the watched read
    starts at once: the first slice, read alone to see whether there is more, would be read twice."""
    if not large:
        first = await redis.getrange(key, 0, READ_SLICE_BYTES - 1)
        if len(first) < READ_SLICE_BYTES:  # the whole value: one command is atomic
            return [first] if first else None
    pool = redis.connection_pool
    for _ in range(TRIES):
        # taken outside the except: an outage is waited out once, on the client's patience, as a
        # GET waits it out, not once a try
        conn = await pool.get_connection()
        try:
            slices = await _watched(conn, key)
        except REDIS_DOWN:  # its connection broke: the next try has another
            continue
        finally:
            await pool.release(conn)
        if slices is not None:
            return slices or None  # [] where it went as the read began
    value = await redis.get(key)
    return [value] if value else None


async def _watched(conn: aioredis.Connection, key: str) -> list[bytes] | None:
    """The value's slices, read under WATCH on ``conn`` ([] where there is none); None if it changed
    or expired as they were read. ``conn`` is left clean for the pool: every way out but the
    EXEC's reply drops it (a reply left unread on it would answer the next command that uses it)."""
    try:
        await _send(conn, "WATCH", key)
        await conn.read_response()
        await _send(conn, "STRLEN", key)
        size = await conn.read_response()
        slices = []
        for start in range(0, size, READ_SLICE_BYTES):
            await _send(conn, "GETRANGE", key, start, start + READ_SLICE_BYTES - 1)
            slices.append(await conn.read_response())
        await _send(conn, "MULTI")
        await _send(conn, "EXEC")
        await conn.read_response()  # MULTI's OK
        done = await conn.read_response()  # EXEC: None if the key changed; either way WATCH ends
    except BaseException:  # cancelled, broken or refused: the connection goes, and its WATCH with it
        await conn.disconnect(nowait=True)
        raise
    # short: it expired as it was read, which Redis before 6.0.9 does not count as a write
    if done is None or sum(map(len, slices)) != size:
        return None
    return slices


async def _send(conn: aioredis.Connection, *args) -> None:
    """A command on the watched connection, never on another: a connection closed under the read
    connects again as it sends, and a health check that fails reconnects and sends on the new
    one, each without the WATCH, so the read would go on unwatched."""
    if not conn.is_connected:
        raise RedisConnectionError("the watched connection was closed")
    await conn.send_command(*args, check_health=False)
