"""Trimming and stream bounds against a real redis-server: what every group has acknowledged goes,
what is pending stays, a broadcast stream is bounded, a work stream keeps its backlog."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError

from proto import examples as ex
from proto.streams import DEAD_LETTERS, PROMPTS, WEIGHTS
from services.bus import Bus, ConsumerOptions
from tests.test_bus import FAST, _run_until


async def test_trimming_keeps_only_unacknowledged_history(bus: Bus):
    for i in range(20):
        await bus.publish(PROMPTS, ex.example_task(i))
    processed = []

    async def handler(msg, delivery):
        processed.append(msg.index)

    opts = ConsumerOptions(block_ms=50, heartbeat_ms=30, count=1, trim_interval_s=0.0)
    await _run_until(bus, PROMPTS, handler, lambda: len(processed) == 20, options=opts)
    assert (
        await bus.stream_length(PROMPTS) <= 1
    )  # trimmed after each ack; at most the last stays until the next trim
    await bus.trim_acked(PROMPTS)
    assert await bus.stream_length(PROMPTS) == 0
    # pending (unacknowledged) entries are never trimmed
    for i in range(5):
        await bus.publish(PROMPTS, ex.example_task(100 + i))
    await bus.redis.xreadgroup("rollout", "holder", {bus.key(PROMPTS): ">"}, count=2)
    removed = await bus.trim_acked(PROMPTS)
    assert removed == 0 and await bus.stream_length(PROMPTS) == 5


async def test_housekeeping_passes_over_a_missing_stream_and_reports_a_key_of_another_type(bus: Bus):
    """Any ResponseError used to read as "no such stream": a stream key holding a string (another
    deployment's key under the same prefix) was trimmed as an empty stream, silently, for good."""
    assert await bus.trim_acked(PROMPTS) == 0 and await bus.group_names(PROMPTS) == []
    await bus.redis.set(bus.key(PROMPTS), "not a stream")
    for housekeeping in (bus.trim_acked, bus.group_names):
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await housekeeping(PROMPTS)


async def test_maxlen_bounds_a_stream_without_consumers(redis_url, key_prefix):
    bus = Bus.from_url(redis_url, prefix=key_prefix, maxlen=50)
    try:
        for v in range(400):
            await bus.publish(WEIGHTS, ex.example_weights(v))
        assert await bus.stream_length(WEIGHTS) < 400
        _, latest = await bus.latest(WEIGHTS)
        assert latest.version == 399
    finally:
        await bus.close()


async def test_a_work_stream_keeps_its_backlog_past_maxlen(redis_url, key_prefix):
    """MAXLEN removes entries whether or not a group has read them: applied to a work stream, a
    backlog past it lost prompts without a trace (no pending entry, no dead letter). Work streams
    are trimmed by what their groups acknowledged only."""
    bus = Bus.from_url(redis_url, prefix=key_prefix + "-backlog", maxlen=10)
    try:
        await bus.ensure_group(PROMPTS)
        for i in range(400):
            await bus.publish(PROMPTS, ex.example_task(i))
        assert await bus.stream_length(PROMPTS) == 400
        read = await bus.redis.xreadgroup("rollout", "late", {bus.key(PROMPTS): ">"}, count=1000)
        assert len(read[0][1]) == 400
    finally:
        await bus.close()


async def test_a_pending_entry_trimmed_away_is_a_dead_letter(redis_url, key_prefix):
    """Past MAXLEN Redis trims entries a dead consumer still held: they cannot be processed any
    more, but their loss is recorded, not silent."""
    bus = Bus.from_url(redis_url, prefix=key_prefix + "-trim", maxlen=10)
    try:
        await bus.ensure_group(PROMPTS)
        await bus.publish(PROMPTS, ex.example_task(0))
        await bus.redis.xreadgroup("rollout", "dead", {bus.key(PROMPTS): ">"}, count=1)  # then dies
        for i in range(1, 400):
            await bus.publish(PROMPTS, ex.example_task(i))
        await bus.redis.xtrim(bus.key(PROMPTS), maxlen=10)  # what MAXLEN ~ does, exactly
        handled: list[int] = []

        async def handler(message, delivery):
            handled.append(message.index)

        await asyncio.sleep(0.35)  # the dead consumer's entry is idle past claim_idle_ms
        await _run_until(bus, PROMPTS, handler, lambda: len(handled) >= 10, options=FAST)
        letters = [m for _, m in await bus.read_all(DEAD_LETTERS)]
        assert [(d.stream, d.payload, "trimmed" in d.cause) for d in letters] == [("prompts", b"", True)]
    finally:
        await bus.close()
