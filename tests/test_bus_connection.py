"""The bus's Redis client keeps every cancellation: a task cancelled in a command ends
(services/bus/connection.py, ``_KeepsCancellation``); and it writes a large command a slice at a
time (``_WritesInSlices``)."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio as aioredis

from services.bus.connection import SLICE_BYTES, _KeepsCancellation, _WritesInSlices, redis_client


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0",
        "rediss://127.0.0.1:1/0",
        "unix:///tmp/no-such.sock",
        "redis://:pw@127.0.0.1:1/3",
    ],
)
def test_every_scheme_gets_its_own_connection_class_that_keeps_cancellations(url):
    pool = redis_client(url).connection_pool
    kind = {"redis": "Connection", "rediss": "SSLConnection", "unix": "UnixDomainSocketConnection"}
    assert issubclass(pool.connection_class, getattr(aioredis, kind[url.split(":")[0]]))
    assert issubclass(pool.connection_class, _KeepsCancellation)
    assert issubclass(pool.connection_class, _WritesInSlices)
    assert pool.connection_kwargs.get("password") == ("pw" if "pw@" in url else None)


async def test_a_task_cancelled_in_a_command_always_ends(redis_url):
    """redis-py bounds each write with asyncio.wait_for, and on Python 3.11 a cancellation that
    comes as the write completes is lost: a third of these tasks, each a loop of commands
    cancelled at a random point, ran on (a heartbeat that lost its cancellation renewed its entry
    for good, and the consumer waiting for it hung). Each now ends cancelled, and the client
    works on after it."""
    client = redis_client(redis_url)
    rng = random.Random(0)
    ran_on = 0
    try:
        for _ in range(150):

            async def commands() -> None:
                while True:
                    await client.eval("return 1", 0)

            task = asyncio.create_task(commands())
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            if not done:  # it lost its cancellation: it would run for good
                ran_on += 1
                while not task.done():  # end it: cancel until one is kept
                    task.cancel()
                    await asyncio.wait({task}, timeout=0.1)
                break
            assert task.cancelled()
        assert ran_on == 0
        assert await client.eval("return 7", 0) == 7  # no reply left unread on a connection
    finally:
        await client.aclose()


def _spy_on_writes(client, sizes: list[int], after_first=None):
    """Record every size the connection hands its transport (``after_first``: called once, after
    the first write)."""
    original = client.connection_pool.connection_class.send_packed_command

    async def send(conn, command, check_health=True):
        writer = conn._writer
        if writer is not None and not hasattr(writer, "spied"):
            write = writer.write

            def spied(data):
                sizes.append(len(data))
                write(data)
                if after_first is not None and len(sizes) == 1:
                    after_first()

            writer.write, writer.spied = spied, True
        await original(conn, command, check_health)

    return send


async def test_a_large_command_is_written_a_slice_at_a_time(redis_url, key_prefix, monkeypatch):
    """redis-py joins a command into one bytes object and hands it to the transport at once, which
    held the event loop for a third of a second for a group with routes (200 MB): no write hands
    the transport more than a slice now, and the values arrive whole."""
    client = redis_client(redis_url)
    await client.ping()  # connected: the spy wraps the connection's writer
    sizes: list[int] = []
    cls = client.connection_pool.connection_class
    monkeypatch.setattr(cls, "send_packed_command", _spy_on_writes(client, sizes))
    value = random.Random(1).randbytes(5 * SLICE_BYTES + 123)
    await client.set(f"{key_prefix}:big", value)
    async with client.pipeline(transaction=True) as pipe:
        pipe.xadd(f"{key_prefix}:stream", {b"data": value})
        pipe.set(f"{key_prefix}:small", b"x")
        await pipe.execute()
    assert max(sizes) <= SLICE_BYTES and sum(sizes) > 2 * len(value)
    assert await client.get(f"{key_prefix}:big") == value
    ((_, fields),) = await client.xrange(f"{key_prefix}:stream")
    assert fields[b"data"] == value and await client.get(f"{key_prefix}:small") == b"x"
    await client.aclose()


async def test_a_large_write_cancelled_halfway_leaves_nothing_and_the_client_works_on(
    redis_url, key_prefix, monkeypatch
):
    """What was written of the command is not a command: the connection is dropped, so Redis
    never runs it, and the next command goes out on a fresh connection."""
    client = redis_client(redis_url)
    await client.ping()
    sizes: list[int] = []
    task: asyncio.Task | None = None
    cls = client.connection_pool.connection_class
    monkeypatch.setattr(cls, "send_packed_command", _spy_on_writes(client, sizes, lambda: task.cancel()))
    task = asyncio.create_task(client.set(f"{key_prefix}:big", bytes(8 * SLICE_BYTES)))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 1 <= len(sizes) < 8
    monkeypatch.undo()
    assert await client.ping() and await client.get(f"{key_prefix}:big") is None
    await client.aclose()
