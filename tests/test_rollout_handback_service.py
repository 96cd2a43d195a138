"""The hand-back through the real services, kept as a slow test: a rollout service (the committed
demo policy on the in-process engine, the tool gateway as its own process) is stopped with
SIGTERM while a group is half sampled; its short grace runs out, it keeps what it had done, and
a second service of another name goes on from there and publishes the whole group."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from proto.base import decode
from proto.handback import handback_key
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


def test_a_rollout_service_stopped_mid_group_hands_its_turns_to_the_next(redis_server, tiny_world, tmp_path):
    prefix = f"handback{free_port()}"
    common = common_env(redis_server.url, prefix)
    tools = tools_process(common, tiny_world, tmp_path)

    def rollout(name: str) -> ServiceProcess:
        return rollout_process(
            common,
            DEMO_POLICY,
            tools,
            name,
            tmp_path,
            PBSD_ROLLOUT_CONCURRENCY="1",
            PBSD_ROLLOUT_SHUTDOWN_GRACE_S="0.2",  # the grace runs out with the group in hand
            PBSD_ROLLOUT_DATE="2025-06-01",
        )

    question = json.loads((tiny_world / "questions" / "rl.jsonl").read_text().splitlines()[0])
    task = PromptTask(
        run_id="run-handback",
        task_id="run-handback:0",
        question_id=str(question["id"]),
        question=question["question"],
        answer=question["answer"],
        index=0,
        step=0,
        seed=3,
        algorithm=PbsdSpec(),
        rollout=RolloutSpec(group_size=8, max_turns=8, max_tokens_per_turn=96, max_context=4096),
    )
    sync = redis.Redis.from_url(redis_server.url)
    services = [tools, rollout("rollout-pod-a")]
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_healthy(timeout=300)

        async def publish() -> None:
            bus = Bus.from_url(redis_server.url, prefix=prefix)
            await bus.publish(PROMPTS, task)
            await bus.close()

        asyncio.run(publish())
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
        until("the group", lambda: sync.xlen(f"{prefix}:{TRAJECTORIES.name}") == 1, timeout=300)
        ((_, fields),) = sync.xrange(f"{prefix}:{TRAJECTORIES.name}")
        group = decode(TrajectoryGroup, fields[b"data"])
        assert len(group.trajectories) == 8 and all(t.finish_reason != "error" for t in group.trajectories)
        # the second worker took up trajectories the first had finished and ones it had begun
        taken_up = {k: _counter(staying.url, "pbsd_rollout_resumed_trajectories", state=k) for k in STATES}
        assert taken_up["finished"] >= 1 and taken_up["unfinished"] >= 1 and taken_up["dropped"] == 0, (
            taken_up
        )
        assert _counter(staying.url, "pbsd_rollout_resumed_turns") >= taken_up["unfinished"]
        assert not sync.exists(f"{prefix}:{handback_key(task.message_id)}")
        assert (
            "keep what it had done" not in (tmp_path / "rollout-pod-a.log").read_text()
        )  # no failure logged
    finally:
        for s in services:
            s.stop()
        sync.close()
