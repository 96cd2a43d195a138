"""The bus lets go of its large values a few MiB at a time (services/bus/freeing.py): what it
writes goes out from its parts (``Parts``, ``proto.base.encode_parts``), never joined whole, and
the parts it wrote and the slices it read are freed between turns of the event loop."""

from __future__ import annotations

import asyncio
import random
import tracemalloc

import pytest
import redis.asyncio as aioredis

import services.bus.client as bus_client
import services.bus.decoding as bus_decoding
from proto import examples as ex
from proto.base import encode
from proto.messages import TrajectoryGroup
from proto.streams import TRAJECTORIES
from services.bus import Bus, ConsumerOptions, redis_client
from services.bus.connection import SLICE_BYTES, Parts
from services.bus.decoding import decoded
from services.bus.freeing import RELEASE_BYTES, let_go
from services.bus.slices import READ_SLICE_BYTES

MIB = 1 << 20


def test_parts_are_packed_as_their_joined_bytes_would_be_without_a_copy():
    conn = redis_client("redis://127.0.0.1:1/0").connection_pool.make_connection()
    parts = [b"ab", b"", random.Random(0).randbytes(10_000), b"d"]
    ours = conn.pack_command("SET", "k", Parts(parts), "PX", 5000)
    assert b"".join(ours) == b"".join(conn.pack_command("SET", "k", b"".join(parts), "PX", 5000))
    assert any(piece is parts[2] for piece in ours)  # handed on, not copied
    # a command of several words is several arguments, as redis-py sends it
    for name in ("CONFIG SET", b"CONFIG SET"):
        ours = conn.pack_command(name, "maxmemory", Parts([b"1", b"00"]))
        assert b"".join(ours) == b"".join(conn.pack_command(name, "maxmemory", b"100"))


async def test_a_value_sent_as_parts_arrives_whole(redis_url, key_prefix):
    client = redis_client(redis_url)
    rng = random.Random(1)
    parts = [rng.randbytes(3 * SLICE_BYTES + 5), b"", rng.randbytes(17), rng.randbytes(SLICE_BYTES)]
    try:
        await client.set(f"{key_prefix}:v", Parts(parts), px=60_000)
        assert await client.get(f"{key_prefix}:v") == b"".join(parts)
        assert 0 < await client.pttl(f"{key_prefix}:v") <= 60_000
    finally:
        await client.aclose()


async def test_let_go_frees_the_parts_a_few_mib_at_a_time_between_turns_of_the_loop():
    """Freed in one go, 200 MB held the loop for 14-19 ms on a 2-core VM: here every turn the loop
    gets between frees finds the memory lower by about ``RELEASE_BYTES``."""
    tracemalloc.start()
    try:
        parts = [bytes(MIB) for _ in range(10)]
        held: list[int] = []

        async def watch() -> None:
            while True:
                held.append(tracemalloc.get_traced_memory()[0])
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        before = held[-1]
        await let_go(parts)
        after = tracemalloc.get_traced_memory()[0]
        watcher.cancel()
    finally:
        tracemalloc.stop()
    assert parts == []
    during = held[1:]  # the turns let_go gave the loop: after 4 MiB, then after 8 MiB
    assert len(during) == 10 * MIB // RELEASE_BYTES
    steps = [a - b for a, b in zip([before, *during], [*during, after], strict=True)]
    assert all(step >= 0.9 * min(RELEASE_BYTES, 2 * MIB) for step in steps), steps


async def test_decoded_lets_go_of_the_slices_it_decoded_and_keeps_those_that_do_not_decode():
    group = ex.example_group(4, tokens=4_000)
    payload = encode(group)
    slices = [payload[i : i + 50_000] for i in range(0, len(payload), 50_000)]
    assert len(payload) > bus_decoding.DECODE_INLINE_BYTES  # decoded in a thread
    assert await decoded(TrajectoryGroup, slices) == group
    assert slices == []
    bad = [payload[:-1]]  # cut short
    with pytest.raises(ValueError):
        await decoded(TrajectoryGroup, bad)
    assert bad == [payload[:-1]]  # for its dead letter


async def test_what_the_bus_writes_and_reads_is_freed_where_it_lets_go(redis_url, key_prefix, monkeypatch):
    """A claimed publish, a keep, a claimed read and the read of a keep each hand their whole value
    to ``let_go``, holding no other reference to it: the memory goes there, not with the frame that
    held it after (on the loop, in one piece)."""
    freed: list[tuple[int, int]] = []  # (the value's bytes, what tracemalloc saw go)

    async def spy(parts: list[bytes]) -> None:
        assert max(map(len, parts)) <= READ_SLICE_BYTES  # parts and slices, never the value whole
        size, before = sum(map(len, parts)), tracemalloc.get_traced_memory()[0]
        await let_go(parts)
        freed.append((size, before - tracemalloc.get_traced_memory()[0]))

    monkeypatch.setattr(bus_client, "let_go", spy)
    monkeypatch.setattr(bus_decoding, "let_go", spy)
    group = ex.example_group(4, tokens=60_000, routed_experts=(4, 4))
    size = len(encode(group))
    assert size > 4 * MIB
    bus = Bus.from_url(redis_url, prefix=key_prefix, claim_bytes=MIB)
    tracemalloc.start()
    try:
        await bus.publish(TRAJECTORIES, group)  # claimed: written from its parts
        held = await bus.collect(TRAJECTORIES, "c", 1, _yes, options=ConsumerOptions(block_ms=100))
        assert held.messages == [group]
        await bus.commit(held)
        await bus.keep("k", group, ttl_s=60)
        assert await bus.kept("k", TrajectoryGroup) == group
    finally:
        tracemalloc.stop()
        await bus.close()
    assert [s for s, _ in freed] == [size] * 4  # publish, read, keep, read
    assert all(went >= 0.9 * s for s, went in freed), freed


async def test_a_write_that_fails_lets_go_of_its_parts_as_slowly(redis_url, key_prefix, monkeypatch):
    let_go_of: list[int] = []

    async def spy(parts: list[bytes]) -> None:
        let_go_of.append(sum(map(len, parts)))
        await let_go(parts)

    async def refused(*args, **kwargs):
        raise aioredis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")

    monkeypatch.setattr(bus_client, "let_go", spy)
    monkeypatch.setattr(bus_client, "add_claimed", refused)
    group = ex.example_group(2, tokens=60_000, routed_experts=(4, 4))  # past claim_bytes
    bus = Bus.from_url(redis_url, prefix=key_prefix, claim_bytes=MIB)
    try:
        with pytest.raises(aioredis.ResponseError):
            await bus.publish(TRAJECTORIES, group)
        monkeypatch.setattr(bus.redis, "set", refused)
        with pytest.raises(aioredis.ResponseError):
            await bus.keep("k", group, ttl_s=60)
    finally:
        await bus.close()
    assert let_go_of == [len(encode(group))] * 2


async def _yes(message) -> bool:
    return True


def test_the_bus_needs_a_client_of_redis_client():
    """Its connections keep cancellations and write values from their parts; redis-py's own do
    neither."""
    with pytest.raises(ValueError, match="redis_client"):
        Bus(aioredis.Redis.from_url("redis://127.0.0.1:1/0"))
    Bus(redis_client("redis://127.0.0.1:1/0"))
