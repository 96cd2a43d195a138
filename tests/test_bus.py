"""The bus against a real redis-server: delivery, reclaiming, dead letters, idempotency, trimming."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import redis

from proto import examples as ex
from proto.streams import DEAD_LETTERS, PROMPTS, TRAJECTORIES, WEIGHTS
from services.bus import Bus, ConsumerOptions

FAST = ConsumerOptions(block_ms=50, heartbeat_ms=30, max_deliveries=3, trim_interval_s=0.0)


async def _run_until(bus: Bus, stream, handler, predicate, *, consumer="c1", options=FAST, timeout=10.0):
    """Consume until ``predicate()`` holds (bounded in time)."""
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(stream, consumer, handler, options=options, stop=stop))
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_round_trip_and_ack(bus: Bus):
    groups = [ex.example_group(2, seed=i) for i in range(3)]
    for g in groups:
        await bus.publish(TRAJECTORIES, g)
    seen = []

    async def handler(msg, delivery):
        assert delivery.deliveries == 1 and delivery.group == "scorer"
        seen.append(msg)

    await _run_until(bus, TRAJECTORIES, handler, lambda: len(seen) == 3)
    assert seen == groups
    summary = await bus.redis.xpending(bus.key(TRAJECTORIES), "scorer")
    assert summary["pending"] == 0


async def test_a_consumer_rides_out_a_redis_restart():
    """Redis goes away for a while and comes back empty (no persistence: the consumer group is
    gone too): the consumer waits instead of dying, makes the group again and goes on."""
    import redis.asyncio as aioredis

    from services.local_redis import LocalRedis, free_port

    port = free_port()
    server = LocalRedis(port=port).__enter__()
    bus = Bus(aioredis.Redis.from_url(server.url), prefix="outage")
    got: list[int] = []

    async def handler(message, delivery):
        got.append(message.index)

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(PROMPTS, "c", handler, options=FAST, stop=stop))
    try:
        await bus.publish(PROMPTS, ex.example_task(0))
        async with asyncio.timeout(10):
            while got != [0]:
                await asyncio.sleep(0.02)
        server.__exit__(None, None, None)
        await asyncio.sleep(1.5)
        assert not task.done()  # the ConnectionError must not kill it
        server = LocalRedis(port=port).__enter__()
        await bus.publish(PROMPTS, ex.example_task(1))
        async with asyncio.timeout(30):
            while got != [0, 1]:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await bus.redis.aclose()
        server.__exit__(None, None, None)


async def test_publish_checks_the_type(bus: Bus):
    with pytest.raises(TypeError, match="carries TrajectoryGroup"):
        await bus.publish(TRAJECTORIES, ex.example_task())


async def _kill_mid_handler(redis_url: str, key_prefix: str, task, consumer: str, options: str) -> None:
    """A consumer process (``ConsumerOptions(options)``) takes ``task`` and is killed (SIGKILL)
    inside its handler."""
    script = textwrap.dedent(f"""
        import asyncio
        from services.bus import Bus, ConsumerOptions
        from proto.streams import PROMPTS
        async def main():
            bus = Bus.from_url({redis_url!r}, prefix={key_prefix!r})
            async def handler(msg, delivery):
                await bus.redis.set({key_prefix!r} + ":started", msg.message_id)
                await asyncio.sleep(3600)
            await bus.consume(PROMPTS, {consumer!r}, handler, options=ConsumerOptions({options}))
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=os.getcwd())
    try:
        sync = redis.Redis.from_url(redis_url)
        for _ in range(1000):
            if sync.get(f"{key_prefix}:started"):
                break
            await asyncio.sleep(0.02)
        assert sync.get(f"{key_prefix}:started") == task.message_id.encode()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_consumer_killed_mid_handler_is_reclaimed(bus: Bus, redis_url, key_prefix):
    """A consumer process dies (SIGKILL) inside its handler; another takes the entry over."""
    await bus.ensure_group(PROMPTS)
    task = ex.example_task()
    await bus.publish(PROMPTS, task)
    await _kill_mid_handler(redis_url, key_prefix, task, "doomed", "block_ms=50, heartbeat_ms=30")
    got = []

    async def handler(msg, delivery):
        got.append((msg, delivery))

    await _run_until(bus, PROMPTS, handler, lambda: got, consumer="survivor")
    msg, delivery = got[0]
    assert msg == task
    assert delivery.deliveries == 2 and delivery.consumer == "survivor"
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0


async def test_long_handler_is_not_stolen_while_alive(bus: Bus):
    """The heartbeat keeps a slow handler's entry from being reclaimed by a peer."""
    await bus.publish(PROMPTS, ex.example_task())
    calls = []

    async def slow(msg, delivery):
        calls.append(delivery.consumer)
        await asyncio.sleep(1.2)  # four claim-idle periods

    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(bus.consume(PROMPTS, name, slow, options=FAST, stop=stop)) for name in ("a", "b")
    ]
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(calls) == 1


async def test_poison_payload_goes_to_dead_letters_with_cause(bus: Bus):
    await bus.ensure_group(TRAJECTORIES)
    await bus.redis.xadd(
        bus.key(TRAJECTORIES), {b"type": b"TrajectoryGroup", b"mid": b"x", b"data": b"\x93\x01\x02\x03"}
    )
    bad = ex.example_group(1).model_dump()
    bad["trajectories"][0]["reward"] = float("nan")
    import msgpack

    await bus.redis.xadd(
        bus.key(TRAJECTORIES),
        {b"type": b"TrajectoryGroup", b"mid": b"y", b"data": msgpack.packb(bad, use_bin_type=True)},
    )
    good = ex.example_group(1, seed=9)
    await bus.publish(TRAJECTORIES, good)
    seen = []

    async def handler(msg, delivery):
        seen.append(msg)

    await _run_until(bus, TRAJECTORIES, handler, lambda: seen)
    letters = await bus.dead_letters()
    assert len(letters) == 2
    assert "must be a map" in letters[0].cause
    assert "reward must be finite" in letters[1].cause
    assert letters[0].payload == b"\x93\x01\x02\x03" and letters[0].stream == "trajectories"
    assert seen == [good]
    assert (await bus.redis.xpending(bus.key(TRAJECTORIES), "scorer"))["pending"] == 0


async def test_failing_handler_is_retried_then_dead_lettered(bus: Bus):
    await bus.publish(PROMPTS, ex.example_task())
    attempts = []

    async def failing(msg, delivery):
        attempts.append(delivery.deliveries)
        raise RuntimeError("tool gateway unreachable")

    async def dead():
        return len(await bus.dead_letters())

    holder = {"n": 0}

    async def poll():
        holder["n"] = await dead()

    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(PROMPTS, "c", failing, options=FAST, stop=stop))
    try:
        async with asyncio.timeout(15):
            while holder["n"] == 0:
                await poll()
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert attempts == [1, 2, 3]
    letter = (await bus.dead_letters())[0]
    assert "gave up after 3 deliveries" in letter.cause and "tool gateway unreachable" in letter.cause
    assert letter.deliveries == 4


async def test_redelivery_and_republish_are_processed_once(bus: Bus):
    """A producer retry (same message id, new entry) and a redelivered pending entry whose
    message was already processed both reach the handler at most once."""
    task = ex.example_task()
    await bus.publish(PROMPTS, task)
    await bus.publish(PROMPTS, task)  # the producer retried the same message
    processed = []

    async def handler(msg, delivery):
        processed.append(msg.message_id)

    await _run_until(bus, PROMPTS, handler, lambda: len(processed) >= 1)
    await asyncio.sleep(0.3)  # give the duplicate entry time to be read
    assert processed == [task.message_id]

    # a third copy is delivered to a consumer that dies before acknowledging it ...
    await bus.publish(PROMPTS, task)
    await bus.redis.xreadgroup("rollout", "ghost", {bus.key(PROMPTS): ">"}, count=1)
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 1
    # ... and is reclaimed after the idle time, found done, and acknowledged unprocessed
    await asyncio.sleep(0.4)
    before = processed.copy()
    stop = asyncio.Event()
    t = asyncio.create_task(bus.consume(PROMPTS, "c2", handler, options=FAST, stop=stop))
    try:
        async with asyncio.timeout(10):
            while (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"]:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(t, 5)
    assert processed == before


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


async def test_dead_letter_stream_is_readable(bus: Bus):
    assert await bus.dead_letters() == []
    assert DEAD_LETTERS.group is None


async def test_collect_holds_messages_until_commit_and_acks_rejects(bus: Bus):
    for i in range(6):
        await bus.publish(PROMPTS, ex.example_task(i))

    async def accept(task):
        return task.index % 2 == 0  # odd ones are rejected (acknowledged at once)

    held = await bus.collect(PROMPTS, "trainer", 3, accept, options=FAST)
    assert sorted(m.index for m in held.messages) == [0, 2, 4]
    summary = await bus.redis.xpending(bus.key(PROMPTS), "rollout")
    assert summary["pending"] == 3  # held, not acknowledged
    await asyncio.sleep(0.5)  # longer than claim_idle_ms: the heartbeat keeps them ours
    rows = await bus.redis.xpending_range(bus.key(PROMPTS), "rollout", min="-", max="+", count=10, idle=300)
    assert rows == []
    await bus.commit(held)
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0


async def test_a_restarted_collector_gets_its_own_held_messages_back_at_once(bus: Bus):
    """A trainer that stops mid-batch leaves its groups pending; restarted under the same consumer
    name it reads them back first, without waiting claim_idle_ms for them to look abandoned."""
    for i in range(3):
        await bus.publish(PROMPTS, ex.example_task(i))

    async def accept(task):
        return True

    slow = ConsumerOptions(block_ms=50, heartbeat_ms=60_000)
    held = await bus.collect(PROMPTS, "trainer-r", 2, accept, options=slow)
    held.stop_heartbeat()  # shut down without committing
    again = await bus.collect(PROMPTS, "trainer-r", 3, accept, options=slow)
    assert sorted(m.index for m in again.messages) == [0, 1, 2]
    await bus.commit(again)
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0


async def test_collected_messages_of_a_dead_collector_are_reclaimed(bus: Bus):
    for i in range(2):
        await bus.publish(PROMPTS, ex.example_task(i))

    async def accept(task):
        return True

    held = await bus.collect(PROMPTS, "crashed", 2, accept, options=FAST)
    held.stop_heartbeat()  # the collector dies without committing
    await asyncio.sleep(0.4)
    again = await bus.collect(PROMPTS, "restarted", 2, accept, options=FAST)
    assert sorted(m.index for m in again.messages) == [0, 1]
    await bus.commit(again)
    stop = asyncio.Event()
    stop.set()
    assert (await bus.collect(PROMPTS, "x", 1, accept, options=FAST, stop=stop)).messages == []


# -- issue 25, item 4: a dead consumer's work moves on within a minute, to any name, and says so --
def test_the_claim_idle_limit_follows_the_heartbeat_and_is_about_a_minute(tmp_path):
    """It was 600 s for the rollout and the scorer and 1,800 s for the trainer, set apart from the
    heartbeat: a replacement under another name waited that long for a dead consumer's work."""
    from pathlib import Path

    from services.bus.delivery import MISSED_BEATS
    from services.rollout.settings import RolloutSettings
    from services.scorer.settings import ScorerSettings
    from services.trainer.settings import TrainerSettings

    model = str(Path(__file__).parents[1] / "assets" / "demo-policy")
    for settings in (
        RolloutSettings(model=model),
        ScorerSettings(model=model),
        TrainerSettings(local_mode=True, runs_dir=tmp_path),
    ):
        options = settings.consumer_options()
        assert options.claim_idle_ms == MISSED_BEATS * options.heartbeat_ms == 50_000
        assert options.claim_idle_ms + options.heartbeat_ms <= 60_000  # the next scan finds it
    assert ConsumerOptions(heartbeat_ms=40).claim_idle_ms == 40 * MISSED_BEATS


async def test_a_replacement_of_another_name_takes_over_a_dead_consumers_entry_and_logs_it(bus: Bus, caplog):
    """The consumer holding an entry dies (its heartbeat stops); a replacement with a different
    consumer name takes the entry over once MISSED_BEATS beats are missed, not before, and logs it."""
    import logging
    import time

    await bus.publish(PROMPTS, ex.example_task(7))
    held = await bus.collect(PROMPTS, "rollout-old-host-0", 1, _yes, options=FAST)
    held.stop_heartbeat()  # the process is gone
    died = time.monotonic()
    got: list[tuple[int, float]] = []

    async def handler(msg, delivery):
        got.append((msg.index, time.monotonic() - died))

    with caplog.at_level(logging.INFO, logger="services.bus.groups"):
        await _run_until(bus, PROMPTS, handler, lambda: got, consumer="rollout-new-host-0")
    ((index, after),) = got
    assert index == 7 and after >= FAST.claim_idle_ms / 1000
    assert after < FAST.claim_idle_ms / 1000 + 1.0  # a heartbeat's scan later, with slack for a busy machine
    took = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(took) == 1 and "rollout-new-host-0 took over 1 prompts entries" in took[0]


async def test_a_restarted_consumer_logs_what_it_took_back(bus: Bus, caplog):
    import logging

    for i in range(2):
        await bus.publish(PROMPTS, ex.example_task(i))
    held = await bus.collect(PROMPTS, "scorer-a-0", 2, _yes, options=FAST)
    held.stop_heartbeat()
    with caplog.at_level(logging.INFO, logger="services.bus.groups"):
        again = await bus.collect(PROMPTS, "scorer-a-0", 2, _yes, options=FAST)
    ids = ", ".join(entry_id for entry_id, _ in again.items)
    await bus.commit(again)
    lines = [r.getMessage() for r in caplog.records if "took back" in r.getMessage()]
    assert lines == [f"scorer-a-0 took back 2 prompts entries it held before it stopped: {ids}"]


async def _yes(message) -> bool:
    return True


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_killed_consumer_with_default_settings_is_replaced_within_a_minute(
    bus: Bus, redis_url, key_prefix
):
    """kill -9 of a consumer process mid-handler with the services' default heartbeat; a
    replacement under another name (a new pod) gets the entry within about a minute."""
    import time

    await bus.ensure_group(PROMPTS)
    task = ex.example_task()
    await bus.publish(PROMPTS, task)
    await _kill_mid_handler(redis_url, key_prefix, task, "rollout-pod-a-0", "")
    killed = time.monotonic()
    got = []

    async def handler(msg, delivery):
        got.append(time.monotonic() - killed)

    options = ConsumerOptions(block_ms=200)
    await _run_until(
        bus, PROMPTS, handler, lambda: got, consumer="rollout-pod-b-0", options=options, timeout=90
    )
    assert got[0] <= (options.claim_idle_ms + options.heartbeat_ms) / 1000 + 5


async def test_publish_ahead_puts_messages_before_what_the_group_has_not_read(bus: Bus):
    """Issue 25, item 2: prompts a resume publishes again go first. Entries already delivered stay
    where they are; the undelivered ones queue behind the new messages, in their order, unchanged."""
    for i in range(4):
        await bus.publish(PROMPTS, ex.example_task(i))
    held = await bus.collect(PROMPTS, "c", 1, _yes, options=FAST)  # index 0 is delivered, pending
    moved = await bus.publish_ahead(PROMPTS, [ex.example_task(10), ex.example_task(11)])
    assert moved == 3
    order = []

    async def handler(msg, delivery):
        order.append(msg.index)

    await _run_until(bus, PROMPTS, handler, lambda: len(order) == 5, consumer="c2")
    assert order == [10, 11, 1, 2, 3]
    await bus.commit(held)
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0
    with pytest.raises(TypeError):
        await bus.publish_ahead(PROMPTS, [ex.example_weights(1)])
    assert await bus.publish_ahead(TRAJECTORIES, []) == 0
