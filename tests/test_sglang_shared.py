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
from tests.sglang_fake import make_sglang

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
        apps[1].state.model_path, apps[1].state.version = "/models/fake", 0
        await replicas[0].update_weights("/runs/r2/weights/v4", 4)
        assert len(loads(apps[0])) == 2 and len(loads(apps[1])) == 3
        if kind == "rollout":
            for r in replicas:
                await r.aclose()
    for bus in buses:
        await bus.close()


async def test_a_lock_is_held_by_one_and_outliving_it_is_reported_not_raised(redis_url, key_prefix, caplog):
    first, second = (Bus.from_url(redis_url, prefix=key_prefix) for _ in range(2))
    order: list[str] = []

    async def hold(bus: Bus, name: str, ttl_s: float, for_s: float) -> None:
        async with bus.exclusive("load", ttl_s=ttl_s):
            order.append(f"{name} in")
            await asyncio.sleep(for_s)
            order.append(f"{name} out")

    await asyncio.gather(hold(first, "a", 5, 0.3), hold(second, "b", 5, 0.0))
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])
    with caplog.at_level(logging.WARNING, logger="services.bus.lock"):
        async with first.exclusive("load", ttl_s=0.2):
            await asyncio.sleep(0.5)  # expired: another holder may take it from here
            async with second.exclusive("load", ttl_s=5):
                pass
    assert "past its 0 s expiry" in caplog.text
    await first.close()
    await second.close()
