"""A kept value is read a few MiB at a time, and as it stood at one moment
(services/bus/slices.py): a writer between two slices sends the read round again, never a value
made of two keeps; a read cut off drops its connection and leaves no WATCH behind."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

import proto.examples as ex
from proto.handback import HandedBack, UnfinishedTrajectory
from proto.messages import TrajectoryGroup
from services.bus import Bus, slices
from services.bus.claims import payload_of
from services.bus.slices import read_value
from services.local_redis import LocalRedis

SLICE = 1024


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(slices, "READ_SLICE_BYTES", SLICE)


@pytest.fixture
def reads(monkeypatch):
    """The commands sent, by name, and two hooks: ``between``, run before each STRLEN (sent once a
    watched read has its WATCH, before its slices), and ``second_slice``, given the connection
    before a watched read asks for its second slice."""
    seen = {"GETRANGE": 0, "GET": 0, "between": None, "second_slice": None}
    send = AbstractConnection.send_command

    async def counted(self, *args, **kwargs):
        name = str(args[0]).upper()
        seen[name] = seen.get(name, 0) + 1
        if name == "STRLEN" and seen["between"] is not None:
            await seen["between"]()
        if name == "GETRANGE" and args[2] == SLICE and seen["second_slice"] is not None:
            await seen["second_slice"](self)
        return await send(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_command", counted)
    return seen


async def test_a_large_value_comes_back_in_slices_and_a_small_one_in_one(
    bus, key_prefix, small_slices, reads
):
    key = f"{key_prefix}:v"
    value = bytes(range(256)) * 41 + b"tail"  # 10 slices and 500 bytes
    await bus.redis.set(key, value)
    parts = await read_value(bus.redis, key)
    assert b"".join(parts) == value and max(map(len, parts)) == SLICE and len(parts) == 11
    assert reads["GETRANGE"] == 1 + 11 and reads["GET"] == 0  # the first slice, then all under WATCH
    await bus.redis.set(key, b"short")
    assert await read_value(bus.redis, key) == [b"short"]
    assert reads["GETRANGE"] == 13 and reads["WATCH"] == 1  # one GETRANGE, one round trip
    await bus.redis.set(key, b"x" * SLICE)  # exactly one slice: read again under WATCH, whole
    assert await read_value(bus.redis, key) == [b"x" * SLICE]
    assert await read_value(bus.redis, f"{key_prefix}:none") is None


async def test_a_claim_is_read_in_slices_each_read_once(bus, key_prefix, small_slices, reads):
    """A claim is longer than a slice by construction: its first slice is not read on its own
    before the watched read reads it again (a 4.8 MB group was read 8-12 ms slower by claim)."""
    key = f"{key_prefix}:claim"
    value = bytes(range(256)) * 10  # 2.5 slices
    await bus.redis.set(key, value)
    parts = await payload_of(bus.redis, {b"claim": key.encode()})
    assert b"".join(parts) == value and len(parts) == 3
    assert reads["GETRANGE"] == 3 and reads["WATCH"] == 1
    await bus.redis.delete(key)
    assert await payload_of(bus.redis, {b"claim": key.encode()}) is None


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
    assert reads["GET"] == 0 and reads["GETRANGE"] == 1 + 5 + 5 and reads["WATCH"] == 2


async def test_a_value_a_writer_never_leaves_alone_is_read_with_one_get(bus, key_prefix, small_slices, reads):
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (5 * SLICE))
    n = iter(range(100))

    async def write_always():
        await bus.redis.set(key, bytes([next(n)]) * (5 * SLICE))

    reads["between"] = write_always
    assert b"".join(await read_value(bus.redis, key)) == bytes([slices.TRIES - 1]) * (5 * SLICE)
    assert reads["GET"] == 1 and reads["GETRANGE"] == 1 + 5 * slices.TRIES


@pytest.mark.parametrize("meanwhile", ["delete", "prolong", "expire"])
async def test_a_value_removed_prolonged_or_expired_during_the_read_is_read_again(
    bus, key_prefix, small_slices, reads, meanwhile
):
    """Prolonged (PEXPIRE, as a worker still alive prolongs its keep), the value is the same but
    Redis counts the key as written: the read goes round again and gets it. Removed or expired, it
    is gone."""
    key = f"{key_prefix}:v"
    value = b"a" * (3 * SLICE)
    await bus.redis.set(key, value, px=300 if meanwhile == "expire" else None)
    done = []

    async def once():
        if not done:
            done.append(1)
            if meanwhile == "expire":
                await asyncio.sleep(0.4)
            else:
                await (bus.redis.delete(key) if meanwhile == "delete" else bus.redis.pexpire(key, 60_000))

    reads["between"] = once
    parts = await read_value(bus.redis, key)
    assert reads["WATCH"] == 2  # a second watched read, after the first one's EXEC failed
    assert (b"".join(parts) == value) if meanwhile == "prolong" else (parts is None)


async def test_a_value_cut_short_is_not_returned_where_exec_would_not_say(
    bus, key_prefix, small_slices, reads
):
    """Redis before 6.0.9 does not count an expiry as a write to a watched key: EXEC succeeds and
    the slices after the expiry are empty. The read's length gives it away. (A delete after the
    first slice, hidden from WATCH by an UNWATCH sent before it, stands in for the expiry.)"""
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (3 * SLICE))

    async def unwatch_then_delete(conn):
        await conn.send_command("UNWATCH")
        await conn.read_response()
        await bus.redis.delete(key)

    reads["second_slice"] = unwatch_then_delete
    assert await read_value(bus.redis, key) is None
    assert reads["WATCH"] == 2 and reads["GET"] == 0  # the second finds it gone


async def test_a_read_whose_connection_breaks_is_read_again(bus, key_prefix, small_slices, reads):
    key = f"{key_prefix}:v"
    value = b"a" * (4 * SLICE)
    await bus.redis.set(key, value)
    done = []

    async def kill_the_others():  # the watched read's connection among them
        if not done:
            done.append(1)
            await bus.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    reads["between"] = kill_the_others
    assert b"".join(await read_value(bus.redis, key)) == value
    assert reads["WATCH"] == 2 and reads["GET"] == 0


async def test_a_read_whose_redis_is_gone_for_good_waits_out_the_patience_once(small_slices, reads):
    """An outage is waited out on the client's patience as a GET waits it out: once, not once for
    each try of the watched read (which waited about four times as long as the GET)."""
    with LocalRedis() as server:
        bus = Bus.from_url(server.url, prefix="t", patience_s=1.0)
        await bus.redis.set("t:v", b"a" * (3 * SLICE))

        async def stop():
            server.process.kill()
            server.process.wait()

        reads["between"] = stop
        started = time.perf_counter()
        with pytest.raises(RedisConnectionError):
            await read_value(bus.redis, "t:v")
        waited = time.perf_counter() - started
        started = time.perf_counter()
        with pytest.raises(RedisConnectionError):
            await bus.redis.get("t:v")
        a_get = time.perf_counter() - started
        await bus.close()
    assert a_get >= 1.0 and waited < 1.5 * a_get, (waited, a_get)


async def test_a_health_check_never_sends_the_read_on_an_unwatched_connection(
    redis_url, key_prefix, small_slices, reads
):
    """With a health check on (``?health_check_interval=`` in the URL) and a patience, a failed
    check reconnects and sends the command on the new connection, which holds no WATCH: a read
    broken after its first slice, the value written meanwhile, came back half old and half new."""
    bus = Bus.from_url(f"{redis_url}?health_check_interval=1", prefix=key_prefix, patience_s=1.0)
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (4 * SLICE))
    done = []

    async def break_then_write(conn):
        if not done:
            done.append(1)
            await bus.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            await bus.redis.set(key, b"b" * (4 * SLICE))
            await asyncio.sleep(1.05)  # past the health check's interval

    reads["second_slice"] = break_then_write
    try:
        assert b"".join(await read_value(bus.redis, key)) == b"b" * (4 * SLICE)
    finally:
        await bus.close()


@pytest.mark.parametrize("cut", ["cancelled", "refused"])
async def test_a_read_cut_off_ends_at_once_and_leaves_no_watch(
    bus, redis_url, key_prefix, small_slices, reads, cut
):
    """A read cancelled while Redis does not answer (paused here) ends cancelled when cancelled,
    not when Redis answers (through redis-py's pipeline it waited for Redis: 2.1 s); a read Redis
    refuses (the key became a list) raises. Either way its connection is dropped, so no
    connection in the pool is left watching the key (a later transaction on it would fail for a
    write it never saw). redis-py drops a connection cancelled as it reads by itself; the
    refusal is the case where only the read's own drop keeps the pool clean."""
    key = f"{key_prefix}:v"
    await bus.redis.set(key, b"a" * (4 * SLICE))
    other = aioredis.Redis.from_url(redis_url)

    async def pause():
        await other.execute_command("CLIENT", "PAUSE", 1500, "ALL")

    async def make_it_a_list():
        await other.delete(key)
        await other.rpush(key, b"x")

    reads["between"] = pause if cut == "cancelled" else make_it_a_list
    started = time.perf_counter()
    with pytest.raises(TimeoutError if cut == "cancelled" else ResponseError):
        await asyncio.wait_for(read_value(bus.redis, key), 0.3)
    assert time.perf_counter() - started < 1.0
    if cut == "cancelled":
        await asyncio.sleep(1.3)  # the pause ends
    reads["between"] = None
    pool = bus.redis.connection_pool
    assert not pool._in_use_connections
    # every pooled connection runs a transaction though the key was written after the read's WATCH
    await other.delete(key)
    await other.set(key, b"b")
    conns = [await pool.get_connection() for _ in range(len(pool._available_connections))]
    for conn in conns:
        await conn.send_packed_command(conn.pack_commands([("MULTI",), ("GET", key), ("EXEC",)]))
        await conn.read_response()
        await conn.read_response()
        assert await conn.read_response() == [b"b"]
        await pool.release(conn)
    await other.aclose()


async def test_a_kept_group_or_hand_back_is_read_in_slices_and_decoded_from_them(bus, small_slices, reads):
    group = ex.example_group(2, tokens=300)
    back = HandedBack(
        run_id="r",
        task_message_id="m",
        unfinished=tuple(
            UnfinishedTrajectory(
                trajectory_id=f"r:0/{i}",
                sample_index=i,
                prompt_ids=np.arange(5, dtype=np.int32),
                completion_ids=np.arange(600, dtype=np.int32),
                loss_mask=np.repeat(np.array([1, 0], dtype=np.uint8), 300),  # a turn, then tool results
                rollout_logprobs=np.zeros(600, dtype=np.float32),
                turn_spans=((0, 300),),
                versions=(1,),
                attempt=f"r:0/{i}#abc",
            )
            for i in range(2)
        ),
    )
    for name, message in (("g", group), ("h", back)):
        await bus.keep(name, message, ttl_s=60)
        assert await bus.kept(name, type(message)) == message
    assert reads["GETRANGE"] > 10 and reads["GET"] == 0
    assert await bus.kept("nothing", TrajectoryGroup) is None
