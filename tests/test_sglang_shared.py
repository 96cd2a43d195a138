"""Replicas that share SGLang servers: each version is loaded into a server once, not once a replica."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.bus import Bus
from services.rollout.sglang import SglangEngine
from services.scorer.backends import SglangScorer
from services.sglang_control import shared_guard
from tests.servers import serve
from tests.sglang_fake import make_sglang, restart

REPLICAS = 4


def loads(app) -> list[dict]:
    return [body for route, body in app.state.control if route == "update_weights_from_disk"]


@pytest.mark.parametrize("kind", ["rollout", "scorer"])
async def test_replicas_sharing_servers_load_each_version_once(redis_url, key_prefix, kind):
    apps = [make_sglang(lambda ids: []), make_sglang(lambda ids: [])]
    buses = [Bus.from_url(redis_url, prefix=key_prefix) for _ in range(REPLICAS)]
    with serve(apps[0]) as a, serve(apps[1]) as b:
        if kind == "rollout":
            replicas = [SglangEngine([a, b], guard=shared_guard(bus.exclusive)) for bus in buses]
        else:
            replicas = [SglangScorer([a, b], guard=shared_guard(bus.exclusive)) for bus in buses]
        # every replica hears of the version at once, as they do from the weights stream
        await asyncio.gather(*(r.update_weights("/runs/r1/weights/v4", 4) for r in replicas))
        for app in apps:
            assert len(loads(app)) == 1  # four replicas, one load
            if kind == "rollout":  # and one pause
                assert [c[0] for c in app.state.control].count("pause_generation") == 1
        # another run counts its versions from the start again: the same number, other weights
        await asyncio.gather(*(r.update_weights("/runs/r2/weights/v4", 4) for r in replicas))
        for app in apps:
            assert [body["model_path"] for body in loads(app)] == [
                "/runs/r1/weights/v4",
                "/runs/r2/weights/v4",
            ]
        versions = [r.weight_version if kind == "rollout" else r.version for r in replicas]
        assert versions == [4] * REPLICAS
        # a server that restarted on its base model is loaded again by the next replica that hears
        restart(apps[1])
        await replicas[0].update_weights("/runs/r2/weights/v4", 4)
        assert len(loads(apps[0])) == 2 and len(loads(apps[1])) == 3
        if kind == "rollout":
            for r in replicas:
                await r.aclose()
    for bus in buses:
        await bus.close()


async def test_a_lock_is_held_by_one_and_kept_past_its_time_to_live_while_held(redis_url, key_prefix):
    first, second = (Bus.from_url(redis_url, prefix=key_prefix) for _ in range(2))
    order: list[str] = []

    async def hold(bus: Bus, name: str, for_s: float, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        async with bus.exclusive("load", ttl_s=1.0):
            order.append(f"{name} in")
            await asyncio.sleep(for_s)
            order.append(f"{name} out")

    # the first works for 2.5 times the lock's time to live: renewed, it stays the only holder
    await asyncio.gather(hold(first, "a", 2.5), hold(second, "b", 0.0, after_s=0.3))
    assert order == ["a in", "a out", "b in", "b out"]
    assert await first.redis.exists(f"{key_prefix}:lock:load") == 0  # released
    await first.close()
    await second.close()


async def test_a_holder_cancelled_as_it_leaves_ends_and_lets_the_lock_go(redis_url, key_prefix, monkeypatch):
    """Leaving swallowed a cancellation of the holder that came while its renewal ended (a worker's
    weights follower, stopped during a load, ran on); the lock is released all the same."""
    from services.bus.lock import Exclusive

    async def slow_to_stop(self):
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.3)

    monkeypatch.setattr(Exclusive, "_renew", slow_to_stop)
    bus = Bus.from_url(redis_url, prefix=key_prefix)
    inside, after = asyncio.Event(), []

    async def holder():
        async with bus.exclusive("load", ttl_s=30):
            inside.set()
            await asyncio.sleep(0.05)  # the renewal has started
        after.append("went on")

    task = asyncio.create_task(holder())
    await asyncio.wait_for(inside.wait(), 5)
    await asyncio.sleep(0.15)  # leaving: its renewal takes 0.3 s to end
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done() and task.cancelled() and after == [], (task, after)
    assert await bus.redis.exists(f"{key_prefix}:lock:load") == 0
    await bus.close()


async def test_a_set_sent_again_after_a_lost_reply_finds_the_lock_its_own(redis_url, key_prefix, bus):
    from services.bus.lock import _OwnRetryLock

    lock = _OwnRetryLock(bus.redis, f"{key_prefix}:lock:x", timeout=5, thread_local=False)
    await bus.redis.set(f"{key_prefix}:lock:x", b"mine")  # what the first, unanswered SET did
    assert await lock.do_acquire(b"mine") and not await lock.do_acquire(b"another's")


async def test_without_redis_the_work_goes_on_unguarded(caplog):
    import redis.asyncio as aioredis

    from services.bus.lock import Exclusive
    from services.local_redis import free_port

    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    ran = False
    with caplog.at_level(logging.WARNING, logger="services.bus.lock"):
        async with Exclusive(client, "k", ttl_s=5):
            ran = True
    await client.aclose()
    assert ran and "going on without the lock" in caplog.text
