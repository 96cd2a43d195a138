"""The stream lag exporter against a real redis-server: length, lag, pending, consumers, age."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import REGISTRY

from proto import examples as ex
from proto.streams import PROMPTS, SCORED, TRAJECTORIES
from services.bus import Bus
from services.bus.lag import StreamLagMonitor


def _value(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


async def test_gauges_follow_what_waits_at_each_stage(bus: Bus):
    await bus.ensure_group(PROMPTS)
    for _i in range(5):
        await bus.publish(PROMPTS, ex.example_task())
    # a consumer takes two entries and has not acknowledged them yet
    await bus.redis.xreadgroup("rollout", "worker-a", {bus.key(PROMPTS): ">"}, count=2)
    await asyncio.sleep(0.05)
    monitor = StreamLagMonitor(bus.redis, bus.prefix, streams=(PROMPTS, TRAJECTORIES, SCORED))
    await monitor.sample()

    assert _value("pbsd_stream_length", stream="prompts") == 5
    assert _value("pbsd_stream_lag", stream="prompts", group="rollout") == 3
    assert _value("pbsd_stream_pending", stream="prompts", group="rollout") == 2
    assert _value("pbsd_stream_outstanding", stream="prompts", group="rollout") == 5  # what the HPA reads
    assert _value("pbsd_stream_consumers", stream="prompts", group="rollout") == 1
    assert _value("pbsd_stream_oldest_pending_seconds", stream="prompts", group="rollout") >= 0.04
    # a stream nobody has written to yet: length 0, no group series invented
    assert _value("pbsd_stream_length", stream="scored") == 0

    # the consumer acknowledges everything: lag and pending drop to zero
    ids = [
        i
        for _k, entries in await bus.redis.xreadgroup("rollout", "worker-a", {bus.key(PROMPTS): ">"})
        for i, _f in entries
    ]
    pending = await bus.redis.xpending_range(bus.key(PROMPTS), "rollout", "-", "+", 10)
    await bus.redis.xack(bus.key(PROMPTS), "rollout", *[p["message_id"] for p in pending])
    assert len(ids) == 3
    await monitor.sample()
    assert _value("pbsd_stream_lag", stream="prompts", group="rollout") == 0
    assert _value("pbsd_stream_pending", stream="prompts", group="rollout") == 0
    assert _value("pbsd_stream_outstanding", stream="prompts", group="rollout") == 0
    assert _value("pbsd_stream_oldest_pending_seconds", stream="prompts", group="rollout") == 0


async def test_a_destroyed_group_leaves_no_series_behind(bus: Bus):
    """Each run reads scored groups through a group of its own, destroyed when it ends: its last
    pending count and age stayed exported for good, and the stuck-entry alert fired on them."""
    await bus.publish(SCORED, ex.example_scored())
    await bus.collect(SCORED, "trainer", 1, _yes, group="trainer-ended-run")  # held, never committed
    monitor = StreamLagMonitor(bus.redis, bus.prefix, streams=(SCORED,))
    await monitor.sample()
    assert _value("pbsd_stream_pending", stream="scored", group="trainer-ended-run") == 1
    await bus.destroy_group(SCORED, "trainer-ended-run")
    await monitor.sample()
    for gauge in ("pending", "lag", "outstanding", "consumers", "oldest_pending_seconds"):
        assert (
            REGISTRY.get_sample_value(
                f"pbsd_stream_{gauge}", {"stream": "scored", "group": "trainer-ended-run"}
            )
            is None
        )


async def _yes(message) -> bool:
    return True


async def test_lag_is_nan_when_redis_cannot_count_it(bus: Bus):
    await bus.ensure_group(TRAJECTORIES)
    ids = [await bus.publish(TRAJECTORIES, ex.example_group(2, seed=i)) for i in range(3)]
    await bus.redis.xreadgroup("scorer", "worker-a", {bus.key(TRAJECTORIES): ">"}, count=1)
    await bus.redis.xdel(bus.key(TRAJECTORIES), ids[1])  # a hole inside the group's unread range
    await StreamLagMonitor(bus.redis, bus.prefix, streams=(TRAJECTORIES,)).sample()
    assert math.isnan(_value("pbsd_stream_lag", stream="trajectories", group="scorer"))


async def test_the_monitor_loop_samples_until_asked_to_stop(bus: Bus):
    """It samples again every interval (a length that changes shows up without a call), and stops
    within one when asked."""
    await bus.publish(TRAJECTORIES, ex.example_group(2, seed=0))
    stop = asyncio.Event()
    monitor = StreamLagMonitor(bus.redis, bus.prefix, streams=(TRAJECTORIES,), interval_s=0.05)
    task = asyncio.create_task(monitor.run(stop))
    async with asyncio.timeout(5):
        while REGISTRY.get_sample_value("pbsd_stream_length", {"stream": "trajectories"}) != 1:
            await asyncio.sleep(0.02)
        await bus.publish(TRAJECTORIES, ex.example_group(2, seed=1))
        while REGISTRY.get_sample_value("pbsd_stream_length", {"stream": "trajectories"}) != 2:
            await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 2)


async def test_a_destroyed_group_leaves_no_forget_schedule_behind(bus: Bus):
    """The bus remembers when it last forgot a group's idle consumers; a run's group, destroyed as
    the run ends, left its entry for good."""
    await bus.publish(SCORED, ex.example_scored())
    await bus.commit(await bus.collect(SCORED, "trainer", 1, _yes, group="trainer-ended-run"))
    assert ("scored", "trainer-ended-run") in bus._last_forget
    await bus.destroy_group(SCORED, "trainer-ended-run")
    assert ("scored", "trainer-ended-run") not in bus._last_forget
