"""The kill -9s of the fault-injection battery (issue 25), kept as a slow test: the four services
run as processes on one Redis, as in production, and a PBSD run goes on while the trainer is
killed one step after its last checkpoint and, later, a rollout worker with prompts in hand is
killed and replaced by one of another name (a new pod)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import redis

from proto.messages import ScoredGroup, WeightsPublished
from proto.streams import DEAD_LETTERS, PROMPTS, WEIGHTS
from services.launcher import ServiceProcess
from services.local_redis import free_port
from services.trainer.viewer import load_groups
from tests.service_processes import common_env, rollout_process, tools_process, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _kill(service: ServiceProcess) -> None:
    os.killpg(service.process.pid, signal.SIGKILL)
    service.process.wait(timeout=10)


def test_a_run_survives_kill_9_of_its_trainer_and_of_a_rollout_worker(
    redis_server, tiny_checkpoint, tiny_world, tmp_path, tmp_path_factory
):
    prefix = f"kill{free_port()}"
    common = common_env(redis_server.url, prefix)
    roots = json.dumps([str(tmp_path_factory.getbasetemp())])
    tools = tools_process(common, tiny_world, tmp_path)

    def rollout(name: str) -> ServiceProcess:
        return rollout_process(common, tiny_checkpoint, tools, name, tmp_path, PBSD_ROLLOUT_CONCURRENCY="2")

    def trainer(n: int) -> ServiceProcess:
        return ServiceProcess(
            "trainer",
            port=free_port(),
            log=tmp_path / f"trainer-{n}.log",
            env={
                **common,
                "PBSD_TRAINER_LOCAL_MODE": "1",
                "PBSD_TRAINER_RUNS_DIR": str(tmp_path / "runs"),
                "PBSD_TRAINER_DATA_ROOTS": roots,
                "PBSD_TRAINER_MODEL_ROOTS": roots,
                "PBSD_TRAINER_SAVE_GROUPS": "1",
            },
        )

    services = [
        tools,
        ServiceProcess(
            "scorer",
            port=free_port(),
            log=tmp_path / "scorer.log",
            env={**common, "PBSD_SCORER_MODEL": str(tiny_checkpoint)},
        ),
        rollout("rollout-pod-a"),
        trainer(1),
    ]
    sync = redis.Redis.from_url(redis_server.url)
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_healthy(timeout=300)
        spec = {
            "name": "battery",
            "model": {"path": str(tiny_checkpoint), "dtype": "float32"},
            "data": {"train": str(tiny_world / "questions" / "rl.jsonl"), "shuffle_seed": 1},
            "rollout": {"group_size": 2, "max_turns": 2, "max_tokens_per_turn": 16, "max_staleness": 1},
            "algorithm": {"name": "pbsd"},
            "trainer": {
                "prompts_per_step": 2,
                "max_steps": 8,
                "checkpoint_every": 2,
                "lr": 1e-4,
                "warmup_steps": 0,
            },
        }
        api = services[3].url
        run_id = httpx.post(f"{api}/runs", json=spec).raise_for_status().json()["id"]

        def record(base: str) -> dict:
            return httpx.get(f"{base}/runs/{run_id}", timeout=10).json()

        # the trainer dies one step after its checkpoint of step 2: version 3 is lost
        until("step 3", lambda: record(api)["step"] >= 3)
        _kill(services[3])
        lost_timeline = next(
            w.timeline for w in _weights(sync, prefix) if w.run_id == run_id and w.version == 3
        )
        services[3] = trainer(2).start()
        services[3].wait_healthy(timeout=300)
        api = services[3].url
        # a rollout worker dies with prompts in hand; a replacement of another name takes them over
        until("step 5", lambda: record(api)["step"] >= 5)
        until(
            "a prompt in hand",
            lambda: sync.xpending(f"{prefix}:{PROMPTS.name}", "rollout")["pending"] > 0,
            every=0.05,
        )
        _kill(services[2])
        killed = time.monotonic()
        services[2] = rollout("rollout-pod-b").start()
        # what the dead worker held moves to the replacement within about a minute, said in its log
        log = tmp_path / "rollout-pod-b.log"
        until("the takeover", lambda: "took over" in log.read_text(), timeout=120)
        assert time.monotonic() - killed < 75  # 50 s without a heartbeat, a scan every 5 s, slack
        done = until(
            "the run's end",
            lambda: (r := record(api))["state"] in ("completed", "failed", "cancelled") and r,
            timeout=600,
        )
        assert (done["state"], done["step"]) == ("completed", 8), done["error"]
        assert [int(m["step"]) for m in httpx.get(f"{api}/runs/{run_id}/metrics").json()] == list(range(1, 9))
        trained = sync.smembers(f"{prefix}:run:{run_id}:trained")
        assert len(trained) == 8 * 2 * 2  # every step's trajectories, none twice
        groups: list[tuple[int, ScoredGroup]] = load_groups(tmp_path / "runs" / run_id)
        assert len(groups) == 8 * 2
        for step, scored in groups:  # nothing trained was sampled with the lost version 3 (or later)
            assert scored.group.policy_timelines.get(lost_timeline, 0) <= 2, (
                step,
                scored.group.policy_timelines,
            )
        assert sync.xlen(f"{prefix}:{DEAD_LETTERS.name}") == 0
        # the run's end is announced after its state is stored; the workers then drop what is left
        pending = lambda: sync.xpending(f"{prefix}:{PROMPTS.name}", "rollout")["pending"]  # noqa: E731
        until("leftovers dropped", lambda: pending() == 0, timeout=60)
    finally:
        for s in services:
            s.stop()
        sync.close()


def _weights(client: redis.Redis, prefix: str) -> list[WeightsPublished]:
    from proto.base import decode

    return [decode(WeightsPublished, f[b"data"]) for _, f in client.xrange(f"{prefix}:{WEIGHTS.name}")]
