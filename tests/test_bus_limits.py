"""A message past Redis's bulk-length limit: refused before it is sent, and dead-lettered at once; and
a dead letter of a large message is kept without its bulk."""

from __future__ import annotations

import asyncio

import pytest
import redis

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
    bus = Bus.from_url(small_redis.url, prefix="big", max_message_bytes=LIMIT)
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
    bus = Bus.from_url(small_redis.url, prefix="big", max_message_bytes=LIMIT)
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


async def test_a_dead_letter_of_a_group_with_routes_keeps_it_without_them(bus: Bus):
    """The letter kept the whole payload: with routing replay's routes a scored group is hundreds of
    MB, the stream is trimmed by count only, and a hundred of them filled Redis."""
    from proto.base import decode
    from proto.messages import ScoredGroup
    from proto.streams import SCORED
    from services.bus.dead_lettering import DEAD_LETTER_PAYLOAD_BYTES

    scored = ex.example_scored(ex.example_group(8, tokens=4096, routed_experts=(48, 8)))
    whole = len(encode(scored))
    assert whole > DEAD_LETTER_PAYLOAD_BYTES
    await bus.publish(SCORED, scored)
    task = ex.example_task()
    await bus.publish(PROMPTS, task)  # a small one stays whole

    async def failing(msg, delivery):
        raise RuntimeError("the trainer cannot take it")

    for stream in (SCORED, PROMPTS):
        stop = asyncio.Event()
        consumer = asyncio.create_task(bus.consume(stream, "c", failing, options=FAST, stop=stop))
        async with asyncio.timeout(20):
            while len(await bus.dead_letters()) < (1 if stream is SCORED else 2):
                await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(consumer, 5)
    big, small = await bus.dead_letters()
    assert big.payload_bytes == whole and len(big.payload) < whole // 10
    kept = decode(ScoredGroup, big.payload)
    assert kept.group.task_id == scored.group.task_id and kept.message_id == scored.message_id
    assert all(t.routed_experts is None for t in kept.group.trajectories)
    assert (kept.group.trajectories[0].completion_ids == scored.group.trajectories[0].completion_ids).all()
    assert big.payload_kept == "without_bulk" and big.task == scored.task_ref()
    assert small.payload_bytes is None and small.payload == encode(task) and small.payload_kept == "whole"
    assert small.task == task.task_ref() and small.task.purpose == "train"


async def test_a_dead_letter_past_the_limit_without_bulk_keeps_its_head_and_its_task(bus: Bus):
    """A long group's tokens alone are several MB (16 x 32K tokens: about 5 MB), and a failure that
    hits every group makes a letter of each: the stream, trimmed by count, held up to 100,000 of
    them whole. Such a letter keeps the payload's first MiB, and names the task it answers, which is
    all the trainer reads of it."""
    from proto.streams import SCORED
    from services.bus.dead_lettering import DEAD_LETTER_PAYLOAD_BYTES
    from services.trainer.dead_letters import lost_prompt

    group = ex.example_group(8, tokens=40_000).model_copy(update={"run_id": "r9", "task_id": "r9:3"})
    scored = ex.example_scored(group)
    whole = len(encode(scored))
    assert whole > 2 * DEAD_LETTER_PAYLOAD_BYTES
    await bus.publish(SCORED, scored)

    async def failing(msg, delivery):
        raise RuntimeError("the trainer cannot take it")

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(SCORED, "c", failing, options=FAST, stop=stop))
    async with asyncio.timeout(20):
        while not (letters := await bus.dead_letters()):
            await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(consumer, 5)
    (letter,) = letters
    assert letter.payload_kept == "head" and letter.payload_bytes == whole
    assert letter.payload == encode(scored)[:DEAD_LETTER_PAYLOAD_BYTES]
    assert letter.task == scored.task_ref() and letter.task.message_id == group.message_id
    lost = lost_prompt(letter, "r9")
    assert lost is not None and lost.index == 3 and lost.message_id == group.message_id


async def test_the_dead_letter_stream_keeps_fewer_letters_than_the_broadcasts(bus: Bus, monkeypatch):
    """Trimmed to the bus's maxlen like the other broadcast streams (100,000 entries), the dead
    letters could hold 100,000 MiB-sized payloads. They keep DEAD_LETTERS_KEPT (10,000; 50 here);
    another broadcast stream keeps its maxlen. Redis trims whole nodes of 100 entries (approximate
    MAXLEN), so the stream stays within a node of the bound."""
    from proto.messages import DeadLetter, RunEnded
    from proto.streams import DEAD_LETTERS, RUN_ENDS
    from services.bus import dead_lettering

    monkeypatch.setattr(dead_lettering, "DEAD_LETTERS_KEPT", 50)
    for i in range(400):
        letter = DeadLetter(
            stream="prompts", group="g", entry_id=f"{i}-0", cause="x", deliveries=5, payload=b""
        )
        await bus.publish(DEAD_LETTERS, letter)
        await bus.publish(RUN_ENDS, RunEnded(run_id=f"r{i}", state="completed"))
    assert 50 <= await bus.stream_length(DEAD_LETTERS) <= 150
    assert await bus.stream_length(RUN_ENDS) == 400
