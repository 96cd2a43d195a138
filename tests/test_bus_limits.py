"""A message past Redis's bulk-length limit: refused before it is sent, and dead-lettered at once."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from proto import examples as ex
from proto.base import encode
from proto.streams import PROMPTS, TRAJECTORIES
from services.bus import Bus, MessageTooLarge
from services.bus import metrics as bus_metrics
from services.local_redis import LocalRedis, free_port
from services.settings import CommonSettings
from tests.test_bus import FAST

LIMIT = 1024 * 1024  # the least proto-max-bulk-len Redis takes


@pytest.fixture
def small_redis():
    """A private redis-server whose bulk strings are limited to 1 MiB (512 MiB by default)."""
    with LocalRedis(port=free_port()) as server:
        redis.Redis.from_url(server.url).config_set("proto-max-bulk-len", LIMIT)
        yield server


def _big_group():
    """A group with routes past 1 MiB: 8 x 1,024 tokens x 48 layers x top-8, as Qwen3-30B-A3B routes."""
    group = ex.example_group(8, tokens=1024, routed_experts=(48, 8))
    assert len(encode(group)) > LIMIT
    return group


def test_redis_refuses_a_message_past_its_limit_and_drops_the_connection(small_redis):
    """Why the bus checks first: Redis answers such a write with a protocol error and closes the
    connection. Which of the two redis-py reports is a race: the error, if the whole payload was
    already in the socket's buffers, or else a broken pipe, the error it also gets when Redis is
    down."""
    client = redis.Redis.from_url(small_redis.url)
    with pytest.raises((redis.ConnectionError, redis.ResponseError)) as refused:
        client.xadd("raw", {b"data": b"x" * (LIMIT + 1)})
    if isinstance(refused.value, redis.ResponseError):
        assert "invalid bulk length" in str(refused.value)
    server = redis.Redis.from_url(small_redis.url)  # this client's connection may be closed
    assert server.ping() and server.xlen("raw") == 0


async def test_the_bus_refuses_a_message_past_its_limit_before_sending_it(small_redis):
    bus = Bus(aioredis.Redis.from_url(small_redis.url), prefix="big", max_message_bytes=LIMIT)
    before = bus_metrics.TOO_LARGE.labels(TRAJECTORIES.name)._value.get()
    try:
        with pytest.raises(
            MessageTooLarge, match=r"trajectories message of .* MiB is past the bus's limit of 1.0 MiB"
        ):
            await bus.publish(TRAJECTORIES, _big_group())
        with pytest.raises(MessageTooLarge):
            await bus.publish_ahead(TRAJECTORIES, [ex.example_group(2), _big_group()])
        assert await bus.redis.xlen(bus.key(TRAJECTORIES)) == 0  # nothing of either went out
        assert bus_metrics.TOO_LARGE.labels(TRAJECTORIES.name)._value.get() == before + 2
        await bus.publish(TRAJECTORIES, ex.example_group(2))  # the connection is as it was
        assert await bus.redis.xlen(bus.key(TRAJECTORIES)) == 1
    finally:
        await bus.close()


async def test_a_handler_that_makes_a_message_past_the_limit_loses_its_entry_once(small_redis):
    """A rollout worker whose group is too large to publish: sampling it again would make another
    group as large, so the prompt is dead-lettered on the first attempt, with the reason, and the
    trainer replaces it (services.trainer.dead_letters)."""
    bus = Bus(aioredis.Redis.from_url(small_redis.url), prefix="big", max_message_bytes=LIMIT)
    attempts: list[int] = []

    async def sample(task, delivery):
        attempts.append(delivery.deliveries)
        await bus.publish(TRAJECTORIES, _big_group())

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(PROMPTS, "w", sample, options=FAST, stop=stop))
    try:
        task = ex.example_task(7)
        await bus.publish(PROMPTS, task)
        async with asyncio.timeout(10):
            while not (letters := await bus.dead_letters()):
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # time for a retry, were there one
        assert attempts == [1] and len(letters) == 1
        letter = letters[0]
        assert (
            letter.stream == PROMPTS.name
            and letter.deliveries == 1
            and "past the bus's limit" in letter.cause
        )
        assert letter.payload == encode(task)  # the prompt, so the trainer knows which to replace
        assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0
        assert bus_metrics.DEAD_LETTERED.labels(PROMPTS.name, "rollout", "too_large")._value.get() >= 1
    finally:
        stop.set()
        await asyncio.wait_for(consumer, 5)
        await bus.close()


def test_every_service_takes_the_limit_from_one_setting(monkeypatch):
    monkeypatch.setenv("PBSD_BUS_MAX_MESSAGE_BYTES", str(LIMIT))
    assert CommonSettings().bus().max_message_bytes == LIMIT
    monkeypatch.delenv("PBSD_BUS_MAX_MESSAGE_BYTES")
    assert CommonSettings().bus().max_message_bytes == 512 * 1024 * 1024  # Redis's default
