"""The bus when consumers die, stall or restart: a live consumer keeps what it holds, a dead one's
entries are taken over (by any name) and a restarted one takes its own back at once, for single
messages and for collected batches (services/bus/groups.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import redis

from proto import examples as ex
from proto.streams import PROMPTS
from services.bus import Bus, ConsumerOptions, metrics
from tests.test_bus import FAST, _run_until, _yes

# for tests where a stall of the shared event loop past FAST's 0.3 s claim-idle time would let a
# peer take what a live consumer holds: 1 s
STEADY = ConsumerOptions(block_ms=50, heartbeat_ms=100, max_deliveries=3, trim_interval_s=0.0)


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
        await asyncio.sleep(3.0)  # three claim-idle periods

    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(bus.consume(PROMPTS, name, slow, options=STEADY, stop=stop))
        for name in ("a", "b")
    ]
    await asyncio.sleep(4.0)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(calls) == 1


async def test_collect_holds_messages_until_commit_and_acks_rejects(bus: Bus):
    for i in range(6):
        await bus.publish(PROMPTS, ex.example_task(i))

    async def accept(task):
        return task.index % 2 == 0  # odd ones are rejected (acknowledged at once)

    held = await bus.collect(PROMPTS, "trainer", 3, accept, options=STEADY)
    assert sorted(m.index for m in held.messages) == [0, 2, 4]
    summary = await bus.redis.xpending(bus.key(PROMPTS), "rollout")
    assert summary["pending"] == 3  # held, not acknowledged
    await asyncio.sleep(1.5)  # longer than claim_idle_ms: the heartbeat keeps them ours
    idle = STEADY.claim_idle_ms
    rows = await bus.redis.xpending_range(bus.key(PROMPTS), "rollout", min="-", max="+", count=10, idle=idle)
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
    assert after < FAST.claim_idle_ms / 1000 + 3.0  # a heartbeat's scan later, with slack for a busy machine
    took = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(took) == 1 and "rollout-new-host-0 took over 1 prompts entries" in took[0]


async def test_a_restarted_consumer_logs_what_it_took_back(bus: Bus, caplog):

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


async def test_consumers_long_gone_are_forgotten_and_none_that_holds_an_entry(bus: Bus, monkeypatch):
    """Workers are named after their hosts, and every pod Kubernetes starts is a new host: Redis
    would keep each name in the group for good. A consumer that holds nothing and has not read for
    ``forget_idle_s`` is deleted; one that holds an entry is not, however long idle, since deleting it
    would drop the entry from the pending list."""
    from services.bus import trimming

    monkeypatch.setattr(trimming, "FORGET_INTERVAL_S", 0.0)
    for i in range(3):
        await bus.publish(PROMPTS, ex.example_task(i))
    key = bus.key(PROMPTS)

    async def names() -> set[str]:
        return {c["name"].decode() for c in await bus.redis.xinfo_consumers(key, "rollout")}

    held = await bus.collect(PROMPTS, "holder", 1, _yes, options=FAST)  # holds one, idle from now on
    held.stop_heartbeat()
    old = await bus.collect(PROMPTS, "old-pod", 1, _yes, options=FAST)  # handles one and goes away
    await bus.commit(old)
    assert await names() == {"holder", "old-pod"}
    await asyncio.sleep(0.3)
    # (a heartbeat of 1 s: the holder's entry is not yet taken over as a dead consumer's)
    options = ConsumerOptions(block_ms=50, heartbeat_ms=1000, trim_interval_s=0.0, forget_idle_s=0.2)
    seen = []

    async def handler(message, delivery):
        seen.append(message.index)

    await _run_until(bus, PROMPTS, handler, lambda: seen, consumer="new-pod", options=options)
    assert await names() == {"holder", "new-pod"}  # old-pod is gone; the holder keeps its entry
    assert (await bus.redis.xpending(key, "rollout"))["pending"] == 1
    await bus.commit(held)


async def test_a_consumer_whose_entry_was_taken_over_stops_working_it(bus: Bus, caplog):
    """A consumer that missed its heartbeats (a loop blocked, Redis out of its reach) lost its
    entry to another consumer and worked on regardless: a long group sampled twice, the second
    result a duplicate for the dedupe to drop. Its next heartbeat now finds the entry gone and
    stops the handler, leaves the entry to the consumer that has it, and goes on to the next."""
    key = bus.key(PROMPTS)
    await bus.publish(PROMPTS, ex.example_task(0))
    started, stopped, handled = asyncio.Event(), asyncio.Event(), []

    async def handler(msg, delivery):
        if msg.index == 0:
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stopped.set()
                raise
        handled.append(msg.index)

    async def taker_alive(entry: str) -> None:  # its heartbeat: else "slow" could take the entry back
        while True:
            await bus.redis.xclaim(key, "rollout", "taker", 0, [entry], justid=True)
            await asyncio.sleep(0.02)

    before = metrics.TAKEN_OVER.labels(PROMPTS.name, "rollout")._value.get()
    stop = asyncio.Event()
    slow = asyncio.create_task(bus.consume(PROMPTS, "slow", handler, options=FAST, stop=stop))
    taker = None
    try:
        await asyncio.wait_for(started.wait(), 5)
        [entry] = await _pending_ids(bus)
        await bus.redis.xclaim(key, "rollout", "taker", 0, [entry])  # what a takeover does
        taker = asyncio.create_task(taker_alive(entry))
        with caplog.at_level(logging.WARNING, logger="services.bus.groups"):
            await asyncio.wait_for(stopped.wait(), 5)
            await bus.publish(PROMPTS, ex.example_task(1))
            async with asyncio.timeout(10):
                while handled != [1]:
                    await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(slow, 10)
        if taker is not None:
            taker.cancel()
    [row] = await bus.redis.xpending_range(key, "rollout", "-", "+", 10)
    assert row["consumer"] == b"taker" and (await _pending_ids(bus)) == [entry]  # neither acked nor lost
    assert metrics.TAKEN_OVER.labels(PROMPTS.name, "rollout")._value.get() == before + 1
    assert f"slow stopped handling prompts entry {entry}: it is no longer this consumer's" in caplog.text


async def test_a_consumer_cancelled_twice_leaves_no_heartbeat_behind(bus: Bus):
    """A consumer cancelled again while its handler was still unwinding left the handler's
    heartbeat running: it renewed the entry for as long as the process lived, so neither the
    hand-back nor a takeover could give it to anyone else."""
    key = bus.key(PROMPTS)
    await bus.publish(PROMPTS, ex.example_task(0))
    started = asyncio.Event()

    async def slow_to_stop(msg, delivery):
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # unwinding: closing sessions, writing a log

    consumer = asyncio.create_task(bus.consume(PROMPTS, "twice", slow_to_stop, options=FAST))
    await asyncio.wait_for(started.wait(), 5)
    consumer.cancel()
    await asyncio.sleep(0.05)
    consumer.cancel()
    await asyncio.wait({consumer}, timeout=5)
    assert consumer.done()
    await asyncio.sleep(0.6)  # twenty heartbeats, and the handler has ended
    [row] = await bus.redis.xpending_range(key, "rollout", "-", "+", 10)
    assert row["consumer"] == b"twice" and row["time_since_delivered"] >= 500  # nobody renews it


async def test_a_leaving_consumer_hands_back_what_it_holds_at_once(bus: Bus):
    """A worker stopped mid-handler (a scale-down past its grace) left its entry to wait out the
    takeover time (ten heartbeats, 50 s by default) before another sampled it again. Released, the
    entry goes to the next live consumer within a heartbeat, and its delivery count stays: a worker
    that was stopped did not fail on it (a long group handed on through a rolling update reached
    max_deliveries). A release after someone else took the entry changes nothing; an entry whose
    message is gone from the stream is left for the takeover to dead-letter."""
    options = ConsumerOptions(block_ms=50, heartbeat_ms=500, trim_interval_s=0.0)  # takeover after 5 s
    task = ex.example_task()
    await bus.publish(PROMPTS, task)
    started = asyncio.Event()

    async def stuck(msg, delivery):
        started.set()
        await asyncio.sleep(3600)

    leaving = asyncio.create_task(bus.consume(PROMPTS, "leaving", stuck, options=options))
    await asyncio.wait_for(started.wait(), 10)
    leaving.cancel()
    await asyncio.wait({leaving})
    assert await bus.release(PROMPTS, ["leaving"]) == [(await _pending_ids(bus))[0]]
    got = []

    async def handler(msg, delivery):
        got.append(delivery)

    loop = asyncio.get_running_loop()
    began = loop.time()
    await _run_until(bus, PROMPTS, handler, lambda: got, consumer="staying", options=options, timeout=4.0)
    assert loop.time() - began < 2.0  # one heartbeat's scan, not the 5 s of a takeover
    assert got[0].deliveries == 1 and got[0].consumer == "staying"
    assert await bus.release(PROMPTS, ["leaving"]) == []
    assert await bus.release(PROMPTS, ["nobody"], group="no-such-group") == []
    gone = await bus.publish(PROMPTS, ex.example_task(1))
    await bus.redis.xreadgroup("rollout", "leaving", {bus.key(PROMPTS): ">"}, count=1)
    await bus.redis.xdel(bus.key(PROMPTS), gone)
    assert await bus.release(PROMPTS, ["leaving"]) == [] and await _pending_ids(bus) == [gone]


async def test_a_stopped_consumer_starts_nothing_it_reads_after_the_stop(bus: Bus):
    """A read that was blocked when the stop came returns the entry published meanwhile: it was
    handled, so a worker told to leave started a group it had no time to finish. It is left
    pending now, for the release to hand on."""
    await bus.ensure_group(PROMPTS)
    handled = []

    async def handler(msg, delivery):
        handled.append(msg)

    stop = asyncio.Event()
    consumer = asyncio.create_task(
        bus.consume(PROMPTS, "leaving", handler, options=ConsumerOptions(block_ms=1000), stop=stop)
    )
    await asyncio.sleep(0.3)  # inside its blocking read
    stop.set()
    await bus.publish(PROMPTS, ex.example_task())
    await asyncio.wait_for(consumer, 5)
    assert handled == []
    await bus.release(PROMPTS, ["leaving"])
    got = []
    await _run_until(bus, PROMPTS, lambda msg, delivery: _append(got, msg), lambda: got, consumer="staying")
    assert len(got) == 1


async def _append(into: list, item) -> None:
    into.append(item)


async def _pending_ids(bus: Bus) -> list[str]:
    pending = await bus.redis.xpending_range(bus.key(PROMPTS), "rollout", "-", "+", 10)
    return [
        p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"] for p in pending
    ]
