"""The bus's Redis client keeps every cancellation: a task cancelled in a command ends
(services/bus/connection.py, ``_KeepsCancellation``)."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio as aioredis

from services.bus.connection import _KeepsCancellation, redis_client


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
