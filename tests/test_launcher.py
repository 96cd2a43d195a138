"""Local service processes: no orphan when the parent is killed outright; a stalled or broken
pipeline fails the demo instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from demo.run import follow_run
from services.launcher import ServiceProcess


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose (its parent, init here, reaps it)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_service_dies_with_a_parent_that_is_killed():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time\n"
            "from services.launcher import die_with_parent\n"
            "p = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=die_with_parent)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()  # SIGKILL: no clean-up runs in the parent
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


@pytest.fixture
def parked(api, redis_url, key_prefix, tiny_world, tiny_checkpoint):
    """``parked(state, step)``: (a client of the trainer's API with its token, the id of a run
    parked there in ``state`` at ``step``), as the demo follows its runs."""
    import asyncio

    from tests.conftest import TOKEN
    from tests.test_trainer_api import _parked_run
    from tests.test_trainer_service import _spec

    clients = []

    def make(state: str = "running", step: int = 0) -> tuple[httpx.Client, str]:
        spec = _spec(tiny_world, tiny_checkpoint, max_steps=4)
        run_id = asyncio.run(_parked_run(redis_url, key_prefix, spec, state, step))
        clients.append(httpx.Client(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}))
        return clients[-1], run_id

    yield make
    for client in clients:
        client.close()


def _service(cmd: list[str], tmp_path) -> ServiceProcess:
    service = ServiceProcess("rollout", port=1, env={}, log=tmp_path / "rollout.log")
    service.process = subprocess.Popen(cmd)
    return service


def test_follow_run_stops_a_stalled_run(tmp_path, parked):
    service = _service(["sleep", "30"], tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="stalled: no training step for 1s after step 0"):
            follow_run(*parked(), 4, "pbsd", [service], stall_timeout_s=1.0)
        assert time.monotonic() - started < 10
    finally:
        service.process.kill()
        service.process.wait()


def test_follow_run_fails_when_a_service_exits(tmp_path, parked):
    service = _service([sys.executable, "-c", "raise SystemExit(3)"], tmp_path)
    service.process.wait()
    with pytest.raises(RuntimeError, match=r"rollout exited with code 3; see .*rollout\.log"):
        follow_run(*parked(), 4, "pbsd", [service], stall_timeout_s=600.0)


def test_follow_run_returns_a_completed_run(tmp_path, parked):
    service = _service(["sleep", "30"], tmp_path)
    try:
        assert follow_run(*parked("completed", 4), 4, "pbsd", [service], 600.0)["step"] == 4
    finally:
        service.process.kill()
        service.process.wait()


def test_local_redis_starts_in_a_relative_workdir(tmp_path, monkeypatch):
    # `make demo` writes under runs/demo-<time>, a relative path: redis-server changes into --dir
    # before opening --logfile, so a relative log path would stop it from starting at all
    from pathlib import Path

    import redis

    from services.local_redis import LocalRedis

    monkeypatch.chdir(tmp_path)
    with LocalRedis(workdir=Path("runs") / "redis") as server:
        assert redis.Redis.from_url(server.url).ping()
        assert (tmp_path / "runs" / "redis" / "redis.log").exists()
