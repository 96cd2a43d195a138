"""The bus against a real redis-server: delivery, reclaiming, dead letters, idempotency, trimming."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from proto import examples as ex
from proto.streams import DEAD_LETTERS, PROMPTS, TRAJECTORIES
from services.bus import Bus, ConsumerOptions

FAST = ConsumerOptions(block_ms=50, heartbeat_ms=30, max_deliveries=3, trim_interval_s=0.0)


async def _run_until(bus: Bus, stream, handler, predicate, *, consumer="c1", options=FAST, timeout=10.0):
    """Consume until ``predicate()`` holds, awaited where it is a coroutine (bounded in time)."""
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(stream, consumer, handler, options=options, stop=stop))
    try:
        async with asyncio.timeout(timeout):
            while not await _holds(predicate):
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def _holds(predicate) -> bool:
    held = predicate()
    return bool(await held if inspect.isawaitable(held) else held)


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
    from services.local_redis import LocalRedis, free_port

    port = free_port()
    server = LocalRedis(port=port).__enter__()
    bus = Bus.from_url(server.url, prefix="outage")
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
        # this client has no retries, as the consumer's own outage handling is under test, and of
        # its two pooled connections one is the publisher's, which Redis closed: whichever of the
        # consumer and the publisher takes it first fails once and reconnects
        for attempt in range(2):
            try:
                await bus.publish(PROMPTS, ex.example_task(1))
                break
            except RedisConnectionError:
                assert attempt == 0
        async with asyncio.timeout(30):
            while got != [0, 1]:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await bus.redis.aclose()
        server.__exit__(None, None, None)


def test_what_counts_as_redis_refusing_for_now():
    from redis.exceptions import OutOfMemoryError, ReadOnlyError

    from services.bus.connection import refusing

    assert refusing(OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    assert refusing(ReadOnlyError("You can't write against a read only replica."))
    assert refusing(ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."))
    assert refusing(ResponseError("BUSY Redis is busy running a script."))
    assert not refusing(ResponseError("BUSYGROUP Consumer Group name already exists"))  # not BUSY
    assert not refusing(ResponseError("NOGROUP No such key or consumer group"))
    assert not refusing(ResponseError("ERR wrong number of arguments"))


async def test_publish_checks_the_type(bus: Bus):
    with pytest.raises(TypeError, match="carries TrajectoryGroup"):
        await bus.publish(TRAJECTORIES, ex.example_task())


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
    assert letters[0].task is None and letters[0].payload_kept == "whole"  # whose, it cannot say
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


async def test_a_handler_cancelled_from_elsewhere_fails_its_delivery_not_its_consumer(bus: Bus):
    """A handler awaiting what another task cancels (a pool's job withdrawn) ended cancelled, and its
    consumer took that for its own stop: the loop ended, and the entry waited for a takeover."""
    await bus.publish(PROMPTS, ex.example_task())
    attempts = []

    async def withdrawn_once(msg, delivery):
        attempts.append(delivery.deliveries)
        if delivery.deliveries == 1:
            job = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(job.cancel)
            await job

    await _run_until(bus, PROMPTS, withdrawn_once, lambda: len(attempts) == 2)
    assert attempts == [1, 2]
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0


async def test_an_entry_that_failed_then_came_again_as_a_duplicate_leaves_no_cause_behind(bus: Bus):
    """Its handler's failure is recorded by entry; a copy of the same message processed meanwhile
    made the entry a duplicate when it came back, acknowledged with the cause left in Redis for good."""
    task, calls = ex.example_task(), []
    await bus.publish(PROMPTS, task)
    await bus.publish(PROMPTS, task)  # a producer's retry: the same message under a second entry

    async def fails_once(msg, delivery):
        calls.append(delivery.entry_id)
        if len(calls) == 1:
            raise RuntimeError("tool gateway unreachable")

    async def settled():
        return (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(PROMPTS, "c", fails_once, options=FAST, stop=stop))
    async with asyncio.timeout(10):
        while len(calls) < 2 or not await settled():
            await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(consumer, 5)
    assert len(calls) == 2 and calls[0] != calls[1]  # the failed entry, then the copy; the first came back
    assert await bus.redis.hlen(bus._errors_key(PROMPTS, "rollout")) == 0


async def test_redelivery_and_republish_are_processed_once(bus: Bus):
    """A producer retry (same message id, new entry) and a redelivered pending entry whose
    message was already processed both reach the handler at most once."""
    task = ex.example_task()
    await bus.publish(PROMPTS, task)
    await bus.publish(PROMPTS, task)  # the producer retried the same message
    processed = []

    async def handler(msg, delivery):
        processed.append(msg.message_id)

    last = (await bus.redis.xrevrange(bus.key(PROMPTS), count=1))[0][0]

    async def both_entries_handled() -> bool:
        groups = await bus.redis.xinfo_groups(bus.key(PROMPTS))  # none until the consumer makes it
        group = next((g for g in groups if g["name"] in ("rollout", b"rollout")), None)
        return group is not None and group["last-delivered-id"] == last and group["pending"] == 0

    stop = asyncio.Event()
    consumer = asyncio.create_task(bus.consume(PROMPTS, "c1", handler, options=FAST, stop=stop))
    async with asyncio.timeout(10):  # the duplicate entry is read and acknowledged, not just sent
        while not await both_entries_handled():
            await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(consumer, 5)
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


async def test_a_heartbeat_does_not_take_back_an_entry_another_consumer_took_over(bus: Bus):
    """A consumer whose loop stalled past the takeover renewed its entries with XCLAIM min-idle 0,
    which claims whatever it is given: it took the entry back from the consumer that had taken it
    over, and both worked it. A renewal now keeps only what the consumer still owns, and leaves
    the delivery count alone."""
    key = bus.key(PROMPTS)
    await bus.ensure_group(PROMPTS)
    await bus.publish(PROMPTS, ex.example_task(0))
    [(_, [(entry, _)])] = await bus.redis.xreadgroup("rollout", "stalled", {key: ">"}, count=1)
    entry = entry.decode()
    await bus.redis.xclaim(key, "rollout", "taker", 0, [entry])  # the takeover (counts a delivery)

    def owner():
        return bus.redis.xpending_range(key, "rollout", min=entry, max=entry, count=1)

    before = (await owner())[0]
    assert await bus.renew(key, "rollout", "stalled", [entry]) == []
    assert await bus.renew(key, "rollout", "taker", [entry]) == [entry]
    after = (await owner())[0]
    assert after["consumer"] == b"taker" and after["times_delivered"] == before["times_delivered"] == 2


async def test_dead_letter_stream_is_readable(bus: Bus):
    assert await bus.dead_letters() == []
    assert DEAD_LETTERS.group is None


async def test_publish_ahead_puts_messages_before_what_the_group_has_not_read(bus: Bus):
    """Issue 25, item 2: prompts a resume publishes again go first. Entries already delivered stay
    where they are; the undelivered ones queue behind the new messages, in their order, unchanged."""
    for i in range(4):
        await bus.publish(PROMPTS, ex.example_task(i))
    held = await bus.collect(PROMPTS, "c", 1, _yes, options=FAST)  # index 0 is delivered, pending
    moved = await bus.publish_ahead(PROMPTS, [ex.example_task(10), ex.example_task(11)])
    assert moved == 3
    # Redis counts the group's lag as added minus read: the moved entries, deleted and added again,
    # counted as unread twice for good, and the rollout autoscaler scales on that count. Until the group
    # reads past the deleted entries Redis reports none.
    assert await _lag(bus) is None
    order = []

    async def handler(msg, delivery):
        order.append(msg.index)

    await _run_until(bus, PROMPTS, handler, lambda: len(order) == 5, consumer="c2")
    await bus.commit(held)  # first: a batch left held keeps its heartbeat, and the test, running
    assert order == [10, 11, 1, 2, 3]
    assert (await bus.redis.xpending(bus.key(PROMPTS), "rollout"))["pending"] == 0
    assert await _lag(bus) == 0
    await bus.publish(PROMPTS, ex.example_task(12))
    assert await _lag(bus) == 1
    with pytest.raises(TypeError):
        await bus.publish_ahead(PROMPTS, [ex.example_weights(1)])
    assert await bus.publish_ahead(TRAJECTORIES, []) == 0


async def _yes(message) -> bool:
    return True


async def _lag(bus: Bus) -> int | None:
    (group,) = await bus.redis.xinfo_groups(bus.key(PROMPTS))
    return group["lag"]


async def test_a_collector_does_not_take_back_what_it_holds(bus: Bus):
    """After an outage longer than claim_idle_ms (the heartbeat's renewals failed), the collector's
    own scan for abandoned entries found the ones it held: each was offered to ``accept`` again
    (the trainer's says duplicate, and a rejected entry is acknowledged), so a stop before the
    batch filled lost a group it believed pending; each claim also counted a delivery, and the
    collector restarted after a stop dead-lettered the group as given up on."""
    await bus.publish(PROMPTS, ex.example_task(0))
    seen: list[int] = []

    async def accept(task):
        seen.append(task.index)
        return True

    options = ConsumerOptions(block_ms=20, heartbeat_ms=50, max_deliveries=3)
    stop = asyncio.Event()
    collecting = asyncio.create_task(bus.collect(PROMPTS, "trainer-o", 2, accept, options=options, stop=stop))
    key = bus.key(PROMPTS)
    async with asyncio.timeout(10):
        while not seen:
            await asyncio.sleep(0.01)
    entry = (await bus.redis.xpending_range(key, "rollout", min="-", max="+", count=1))[0]["message_id"]
    for _ in range(100):  # 1 s of missed beats, as in an outage: the entry looks abandoned
        await bus.redis.xclaim(key, "rollout", "trainer-o", 0, [entry], idle=10**7, justid=True)
        await asyncio.sleep(0.01)
    stop.set()
    held = await asyncio.wait_for(collecting, 5)
    assert seen == [0] and [m.index for m in held.messages] == [0]
    [pending] = await bus.redis.xpending_range(key, "rollout", min="-", max="+", count=10)
    assert pending["times_delivered"] == 1  # still held, not acknowledged, and not counted again
    held.stop_heartbeat()  # a stop: the restarted collector reads it back, not a dead letter
    again = await bus.collect(PROMPTS, "trainer-o", 1, accept, options=options)
    assert [m.index for m in again.messages] == [0] and seen == [0, 0]
    assert await bus.redis.xlen(bus.key(DEAD_LETTERS)) == 0
    await bus.commit(again)


async def test_a_large_message_is_decoded_off_the_event_loop_wherever_it_is_read(bus: Bus, monkeypatch):
    """A group with routes is up to 200 MB and takes 130-155 ms to decode: on the loop that holds
    up heartbeats, health probes and the other trajectories' turns. Small messages stay on it."""
    import threading

    from proto.messages import TrajectoryGroup
    from services.bus import decoding

    where: list[tuple[int, bool]] = []

    def spy(model, payload):
        size = len(payload) if isinstance(payload, bytes) else sum(map(len, payload))  # a keep: slices
        where.append((size, threading.current_thread() is threading.main_thread()))
        return decode(model, payload)

    decode = decoding.decode
    monkeypatch.setattr(decoding, "decode", spy)
    large, small = ex.example_group(2, tokens=20_000), ex.example_group(2)
    for g in (large, small):
        await bus.publish(TRAJECTORIES, g)
    await bus.keep("kept-group", large, ttl_s=60)
    seen = []

    async def handler(msg, delivery):
        seen.append(msg)

    assert await bus.kept("kept-group", TrajectoryGroup) == large
    assert [m for _, m in await bus.read_all(TRAJECTORIES)] == [large, small]
    assert [m for _, m in await bus.newest(TRAJECTORIES, 2)] == [large, small]
    followed = []
    async for _, m in bus.follow(TRAJECTORIES, after="0-0", block_ms=50):
        followed.append(m)
        if len(followed) == 2:
            break
    assert followed == [large, small]
    await _run_until(bus, TRAJECTORIES, handler, lambda: len(seen) == 2)
    assert seen == [large, small]
    # kept, read, newest, followed, consumed: each large decode in a thread, each small on the loop
    assert len(where) == 9
    assert all(on_loop == (size <= decoding.DECODE_INLINE_BYTES) for size, on_loop in where), where
    assert {on_loop for _, on_loop in where} == {True, False}
