"""A kept value is read a few MiB at a time, and as it stood at one moment
(services/bus/slices.py): a writer between two slices sends the read round again, never a value
made of two keeps."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

import proto.examples as ex
from proto.messages import TrajectoryGroup
from services.bus import slices
from services.bus.slices import read_value

SLICE = 1024


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(slices, "READ_SLICE_BYTES", SLICE)


@pytest.fixture
def reads(monkeypatch):
    """The GETRANGEs and GETs a read sends, and a hook run before each STRLEN (the second command
    of a read of more than one slice: one slice has been read)."""
    seen = {"getrange": 0, "get": 0, "between": None}
    getrange, get, strlen = Pipeline.getrange, aioredis.Redis.get, Pipeline.strlen

    def counted_getrange(self, *args):
        seen["getrange"] += 1
        return getrange(self, *args)

    def counted_get(self, *args, **kwargs):
        seen["get"] += 1
        return get(self, *args, **kwargs)

    async def strlen_after(self, key):
        if seen["between"] is not None:
            await seen["between"]()
        return await strlen(self, key)

    monkeypatch.setattr(Pipeline, "getrange", counted_getrange)
    monkeypatch.setattr(aioredis.Redis, "get", counted_get)
    monkeypatch.setattr(Pipeline, "strlen", strlen_after)
    return seen


async def test_a_large_value_comes_back_in_slices_and_a_small_one_in_one(
    bus, key_prefix, small_slices, reads
):
    key = f"{key_prefix}:v"
    value = bytes(range(256)) * 41 + b"tail"  # 10 slices and 500 bytes
    await bus.redis.set(key, value)
    parts = await read_value(bus.redis, key)
    assert b"".join(parts) == value and max(map(len, parts)) == SLICE and len(parts) == 11
    assert reads["getrange"] == 11 and reads["get"] == 0
    await bus.redis.set(key, b"short")
    assert await read_value(bus.redis, key) == [b"short"] and reads["getrange"] == 12
    await bus.redis.set(key, b"x" * SLICE)  # exactly one slice: one more GETRANGE finds the end
    assert await read_value(bus.redis, key) == [b"x" * SLICE]
    assert await read_value(bus.redis, f"{key_prefix}:none") is None


async def test_a_value_written_during_the_read_is_read_again_whole(bus, key_prefix, small_slices, reads):
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (5 * SLICE))
    writes = []

    async def write_once():
        if not writes:
            writes.append(1)
            await bus.redis.set(key, b"b" * (5 * SLICE))

    reads["between"] = write_once
    assert b"".join(await read_value(bus.redis, key)) == b"b" * (5 * SLICE)
    # the first try reads on to the end (Redis says only at EXEC that the key changed), then again
    assert reads["get"] == 0 and reads["getrange"] == 5 + 5


async def test_a_value_a_writer_never_leaves_alone_is_read_with_one_get(bus, key_prefix, small_slices, reads):
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (5 * SLICE))
    n = iter(range(100))

    async def write_always():
        await bus.redis.set(key, bytes([next(n)]) * (5 * SLICE))

    reads["between"] = write_always
    assert b"".join(await read_value(bus.redis, key)) == bytes([slices.TRIES - 1]) * (5 * SLICE)
    assert reads["get"] == 1 and reads["getrange"] == 5 * slices.TRIES


@pytest.mark.parametrize("meanwhile", ["delete", "prolong"])
async def test_a_value_removed_or_prolonged_during_the_read_is_read_again(
    bus, key_prefix, small_slices, reads, meanwhile
):
    """Prolonged (PEXPIRE, as a worker still alive prolongs its keep), the value is the same but
    Redis counts the key as written: the read goes round again and gets it."""
    key = f"{key_prefix}:v"
    value = b"a" * (3 * SLICE)
    await bus.redis.set(key, value)
    done = []

    async def once():
        if not done:
            done.append(1)
            await (bus.redis.delete(key) if meanwhile == "delete" else bus.redis.pexpire(key, 60_000))

    reads["between"] = once
    parts = await read_value(bus.redis, key)
    assert (parts is None) if meanwhile == "delete" else (b"".join(parts) == value)


async def test_a_kept_group_is_read_in_slices_and_decoded_from_them(bus, small_slices, reads):
    group = ex.example_group(2, tokens=300)
    await bus.keep("g", group, ttl_s=60)
    assert await bus.kept("g", TrajectoryGroup) == group
    assert reads["getrange"] > 1 and reads["get"] == 0
    assert await bus.kept("nothing", TrajectoryGroup) is None


async def test_a_value_that_expires_during_the_read_is_gone(bus, key_prefix, small_slices, reads):
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (3 * SLICE), px=200)

    async def past_its_expiry():
        await asyncio.sleep(0.3)

    reads["between"] = past_its_expiry
    assert await read_value(bus.redis, key) is None


async def test_a_value_cut_short_is_not_returned_where_exec_would_not_say(
    bus, key_prefix, small_slices, reads, monkeypatch
):
    """Redis before 6.0.9 does not count an expiry as a write to a watched key: EXEC succeeds and
    the slices after the expiry are empty. The read's length gives it away."""
    execute = Pipeline.execute

    async def exec_that_never_aborts(self, *args, **kwargs):
        try:
            return await execute(self, *args, **kwargs)
        except WatchError:
            return []

    monkeypatch.setattr(Pipeline, "execute", exec_that_never_aborts)
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (3 * SLICE))
    reads["between"] = lambda: bus.redis.delete(key)
    assert await read_value(bus.redis, key) is None
