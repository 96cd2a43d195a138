"""The hand-back through the real services, kept as slow tests: a rollout service (the committed
demo policy on the in-process engine, the tool gateway as its own process) is stopped while a
group is half sampled, and a second service of another name goes on from what it kept and
publishes the whole group. Stopped with SIGTERM, its short grace runs out and it keeps what it
had done as it leaves; killed with SIGKILL, its last keep as it sampled is what is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from proto.base import decode
from proto.handback import HandedBack, handback_key
from proto.messages import PromptTask, TrajectoryGroup
from proto.runs import PbsdSpec, RolloutSpec
from proto.streams import PROMPTS, TRAJECTORIES
from services.bus import Bus
from services.launcher import ServiceProcess
from services.local_redis import free_port
from tests.service_processes import common_env, rollout_process, tools_process, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEMO_POLICY = Path(__file__).parents[1] / "assets" / "demo-policy"


STATES = ("finished", "unfinished", "dropped")


def _counter(url: str, name: str, **labels: str) -> float:
    """Counter ``name`` (without its ``_total``) on a service's /metrics, summed over the series
    whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == name
        for s in f.samples
        if s.name == f"{name}_total" and labels.items() <= s.labels.items()
    )


def _services(
    redis_url: str, prefix: str, world: Path, logs: Path, **env: str
) -> tuple[ServiceProcess, Callable[[str], ServiceProcess]]:
    """The tool gateway, and rollout services by name on the demo policy, a group at a time."""
    common = common_env(redis_url, prefix)
    tools = tools_process(common, world, logs)

    def rollout(name: str) -> ServiceProcess:
        return rollout_process(
            common,
            DEMO_POLICY,
            tools,
            name,
            logs,
            PBSD_ROLLOUT_CONCURRENCY="1",
            PBSD_ROLLOUT_DATE="2025-06-01",
            **env,
        )

    return tools, rollout


def _task(tiny_world: Path) -> PromptTask:
    question = json.loads((tiny_world / "questions" / "rl.jsonl").read_text().splitlines()[0])
    return PromptTask(
        run_id="run-handback",
        task_id="run-handback:0",
        question_id=str(question["id"]),
        question=question["question"],
        answer=question["answer"],
        index=0,
        step=0,
        seed=3,
        algorithm=PbsdSpec(),
        # 256 tokens a turn: half the group answers in its second turn and the rest go on for up
        # to 8 turns, so on a 2-core VM its trajectories end from about 1.2 s to 6.8 s in; at 96
        # every one had ended 0.6 s after the first, too short a time to act in
        rollout=RolloutSpec(group_size=8, max_turns=8, max_tokens_per_turn=256, max_context=4096),
    )


def _start_and_publish(services: list[ServiceProcess], redis_url: str, prefix: str, task: PromptTask) -> None:
    for s in services:
        s.start()
    for s in services:
        s.wait_healthy(timeout=300)

    async def publish() -> None:
        bus = Bus.from_url(redis_url, prefix=prefix)
        await bus.publish(PROMPTS, task)
        await bus.close()

    asyncio.run(publish())


def _published_whole(sync: redis.Redis, prefix: str, staying: ServiceProcess, task: PromptTask) -> None:
    """The group comes out whole, from trajectories the first worker finished and ones it began,
    and what was kept of it is gone."""
    until("the group", lambda: sync.xlen(f"{prefix}:{TRAJECTORIES.name}") == 1, timeout=300)
    ((_, fields),) = sync.xrange(f"{prefix}:{TRAJECTORIES.name}")
    group = decode(TrajectoryGroup, fields[b"data"])
    assert len(group.trajectories) == 8 and all(t.finish_reason != "error" for t in group.trajectories)
    taken_up = {k: _counter(staying.url, "pbsd_rollout_resumed_trajectories", state=k) for k in STATES}
    assert taken_up["finished"] >= 1 and taken_up["unfinished"] >= 1 and taken_up["dropped"] == 0, taken_up
    assert _counter(staying.url, "pbsd_rollout_resumed_turns") >= taken_up["unfinished"]
    assert not sync.exists(f"{prefix}:{handback_key(task.message_id)}")


def test_a_rollout_service_stopped_mid_group_hands_its_turns_to_the_next(redis_server, tiny_world, tmp_path):
    prefix = f"handback{free_port()}"
    tools, rollout = _services(
        redis_server.url,
        prefix,
        tiny_world,
        tmp_path,
        PBSD_ROLLOUT_SHUTDOWN_GRACE_S="0.2",  # the grace runs out with the group in hand
    )

    task = _task(tiny_world)
    sync = redis.Redis.from_url(redis_server.url)
    services = [tools, rollout("rollout-pod-a")]
    try:
        _start_and_publish(services, redis_server.url, prefix, task)
        leaving = services[1]
        # stopped once some of the group's trajectories have ended and the group has not
        until(
            "a trajectory's end", lambda: _counter(leaving.url, "pbsd_rollout_trajectories") >= 1, every=0.05
        )
        assert _counter(leaving.url, "pbsd_rollout_groups") == 0, "the group ended first: lengthen it"
        leaving.stop()
        assert leaving.process.returncode is not None
        assert sync.exists(f"{prefix}:{handback_key(task.message_id)}")

        services.append(rollout("rollout-pod-b").start())
        staying = services[2]
        staying.wait_healthy(timeout=300)
        _published_whole(sync, prefix, staying, task)
        assert (
            "keep what it had done" not in (tmp_path / "rollout-pod-a.log").read_text()
        )  # no failure logged
    finally:
        for s in services:
            s.stop()
        sync.close()


def test_a_rollout_service_killed_mid_group_leaves_its_last_keep_to_the_next(
    redis_server, tiny_world, tmp_path
):
    prefix = f"killkeep{free_port()}"
    tools, rollout = _services(
        redis_server.url,
        prefix,
        tiny_world,
        tmp_path,
        PBSD_ROLLOUT_KEEP_EVERY_S="0.2",
        # a keep every round the group moved: under the growth rule a keep made just before the
        # first trajectory ended is followed only once the group has grown by a quarter, which
        # it may never do (it grows by a fifth after that); the rule has its own tests
        # (test_rollout_keeps.py)
        PBSD_ROLLOUT_KEEP_GROWTH="0",
        PBSD_ROLLOUT_HEARTBEAT_S="0.5",  # a dead worker's prompt is taken over after 5 s
    )

    task = _task(tiny_world)
    key = f"{prefix}:{handback_key(task.message_id)}"
    sync = redis.Redis.from_url(redis_server.url)
    services = [tools, rollout("rollout-pod-a")]
    try:
        _start_and_publish(services, redis_server.url, prefix, task)
        dying = services[1]

        def kept() -> HandedBack | None:
            value = sync.get(key)
            return None if value is None else decode(HandedBack, value)

        # killed once a keep holds a finished trajectory and a begun one, and the group has not ended
        last = until(
            "a keep", lambda: (k := kept()) is not None and k.finished and k.unfinished and k, every=0.05
        )
        assert _counter(dying.url, "pbsd_rollout_groups") == 0, "the group ended first: lengthen it"
        assert _counter(dying.url, "pbsd_rollout_progress_keeps", outcome="kept") >= 1
        os.killpg(dying.process.pid, signal.SIGKILL)
        dying.process.wait(timeout=10)
        assert kept() is not None and len(kept().finished) >= len(last.finished)  # nothing ran after the kill

        services.append(rollout("rollout-pod-b").start())
        staying = services[2]
        staying.wait_healthy(timeout=300)
        _published_whole(sync, prefix, staying, task)
        assert "took over" in (tmp_path / "rollout-pod-b.log").read_text()
    finally:
        for s in services:
            s.stop()
        sync.close()
