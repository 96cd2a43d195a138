"""Following a stream from outside any group: the newest entry, every broadcast after a point,
and a follower for good that rides out lost connections and failures of its reader
(services/bus/client.py)."""

from __future__ import annotations

import asyncio

from proto import examples as ex
from proto.streams import WEIGHTS
from services.bus import Bus


async def test_the_latest_entry_passes_over_undecodable_ones(bus):
    """A worker reads the newest weights as it starts: a garbage entry on top once raised there, so
    every worker failed to start until a good entry came, which needed the workers."""
    assert await bus.latest(WEIGHTS) is None
    await bus.publish(WEIGHTS, ex.example_weights(7))
    await bus.redis.xadd(bus.key(WEIGHTS), {"data": b"\xc1 not msgpack"})
    await bus.redis.xadd(bus.key(WEIGHTS), {"other": b"no data field"})
    _, latest = await bus.latest(WEIGHTS)
    assert latest.version == 7


async def test_follow_sees_every_broadcast(bus: Bus):
    await bus.publish(WEIGHTS, ex.example_weights(1))
    seen = []
    stop = asyncio.Event()

    async def reader():
        async for _id, msg in bus.follow(WEIGHTS, after="0-0", block_ms=50, stop=stop):
            seen.append(msg.version)
            if len(seen) == 3:
                stop.set()

    t = asyncio.create_task(reader())
    await asyncio.sleep(0.1)
    await bus.publish(WEIGHTS, ex.example_weights(2))
    await bus.publish(WEIGHTS, ex.example_weights(3))
    await asyncio.wait_for(t, 5)
    assert seen == [1, 2, 3]


async def test_a_follower_for_good_rides_out_a_lost_connection_and_a_failed_handler(bus, monkeypatch):
    """The trainer's dead-letter follower died with its connection: dead-lettered prompts were never
    replaced after that, and a run whose last prompt was one waited for good."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    for v in range(4):
        await bus.publish(WEIGHTS, ex.example_weights(v))
    real, calls = bus.follow, []

    async def flaky(stream, *, after, block_ms, stop):
        calls.append(after)
        async for entry, message in real(stream, after=after, block_ms=50, stop=stop):
            yield entry, message
            if len(calls) == 1:
                raise RedisConnectionError("connection lost")

    monkeypatch.setattr(bus, "follow", flaky)
    seen, stop, failed = [], asyncio.Event(), []

    async def see(entry, message):
        if message.version == 2 and not failed:
            failed.append(entry)
            raise RuntimeError("a handler's bug")
        seen.append(message.version)
        if message.version == 3:
            stop.set()

    await asyncio.wait_for(bus.follow_for_good(WEIGHTS, "0-0", see, stop, reader="test"), 10)
    assert seen == [0, 1, 2, 3]  # version 2's failure was followed again, not skipped
    assert calls[0] == "0-0" and len(calls) == 3  # lost after 0; the handler failed at 2

    tries, seen, stop = [], [], asyncio.Event()

    async def stuck(entry, message):  # fails at version 1 every time
        if message.version == 1:
            tries.append(entry)
            raise RuntimeError("a letter this reader cannot take")
        seen.append(message.version)
        if message.version == 3:
            stop.set()

    monkeypatch.setattr(bus, "follow", real)
    await asyncio.wait_for(bus.follow_for_good(WEIGHTS, "0-0", stuck, stop, reader="test", block_ms=50), 10)
    assert len(tries) == 3 and seen == [0, 2, 3]  # tried three times, then passed over


async def test_a_see_cancelled_from_elsewhere_fails_its_entry_not_the_follower(bus: Bus):
    """A reader's ``see`` awaiting what another task cancels (a job withdrawn) ended the follower
    for good with its bare CancelledError: a worker would never see newer weights after it."""
    for v in range(3):
        await bus.publish(WEIGHTS, ex.example_weights(v))
    seen, stop = [], asyncio.Event()

    async def see(entry, message):
        if message.version == 1 and 1 not in seen:
            seen.append(1)
            job = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(job.cancel)
            await job
        seen.append(message.version)
        if message.version == 2:
            stop.set()

    await asyncio.wait_for(bus.follow_for_good(WEIGHTS, "0-0", see, stop, reader="test", block_ms=50), 10)
    assert seen == [0, 1, 1, 2]  # version 1 tried again a second later, then the rest


async def test_a_stopped_follower_ends_while_its_see_runs(bus: Bus):
    """Its own cancellation still ends it, inside ``see`` too."""
    await bus.publish(WEIGHTS, ex.example_weights(0))
    started = asyncio.Event()

    async def see(entry, message):
        started.set()
        await asyncio.sleep(3600)

    follower = asyncio.create_task(bus.follow_for_good(WEIGHTS, "0-0", see, asyncio.Event(), reader="test"))
    await asyncio.wait_for(started.wait(), 5)
    follower.cancel()
    await asyncio.wait({follower}, timeout=5)
    assert follower.cancelled()
