"""A Redis that refuses writes for now (at maxmemory with noeviction: OOM; a read-only replica
after a failover: READONLY) is waited out by the bus's consumers, as an outage is."""

from __future__ import annotations

import asyncio

from proto import examples as ex
from proto.streams import PROMPTS
from services.bus import Bus
from tests.test_bus import FAST


async def test_a_consumer_waits_out_a_redis_that_refuses_writes():
    """A Redis at maxmemory (noeviction) answers OOM to every write, the handler's commit included;
    a replica after a failover answers READONLY. The consumer waits, the entry stays pending, and
    it is handled once Redis takes writes again. (Before, the consumer died of the error.)"""
    from services.local_redis import LocalRedis, free_port

    with LocalRedis(port=free_port()) as server:
        bus = Bus.from_url(server.url, prefix="oom")
        got: list[int] = []

        async def handler(message, delivery):
            got.append(message.index)

        stop = asyncio.Event()
        await bus.publish(PROMPTS, ex.example_task(0))
        await bus.publish(PROMPTS, ex.example_task(1))
        await bus.ensure_group(PROMPTS, "rollout")
        await bus.redis.config_set("maxmemory", "1")  # full: every write is refused with OOM
        task = asyncio.create_task(bus.consume(PROMPTS, "c", handler, options=FAST, stop=stop))
        try:
            await asyncio.sleep(1.5)
            assert not task.done()  # the OutOfMemoryError must not kill it
            await bus.redis.config_set("maxmemory", "0")
            async with asyncio.timeout(30):
                while sorted(set(got)) != [0, 1]:
                    await asyncio.sleep(0.05)
            summary = await bus.redis.xpending(bus.key(PROMPTS), "rollout")
            assert summary["pending"] == 0
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await bus.redis.aclose()


async def test_a_lost_group_redis_will_not_make_again_is_waited_for_not_spun_on():
    """A Redis restarted empty that refuses writes for now (full, a read-only replica): the consumer
    met NOGROUP, its group could not be made again, and it read again at once, without a pause."""
    from services.local_redis import LocalRedis, free_port

    with LocalRedis(port=free_port()) as server:
        bus = Bus.from_url(server.url, prefix="nogroup")
        got: list[int] = []

        async def handler(message, delivery):
            got.append(message.index)

        await bus.publish(PROMPTS, ex.example_task(0))  # the stream is there, its group is not
        await bus.redis.config_set("maxmemory", "1")
        await bus.redis.config_resetstat()
        stop = asyncio.Event()
        task = asyncio.create_task(bus.consume(PROMPTS, "c", handler, options=FAST, stop=stop))
        try:
            await asyncio.sleep(1.5)
            reads = (await bus.redis.info("commandstats")).get("cmdstat_xreadgroup", {}).get("calls", 0)
            assert not task.done() and reads < 10, reads
            await bus.redis.config_set("maxmemory", "0")
            async with asyncio.timeout(30):
                while got != [0]:
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await bus.redis.aclose()
