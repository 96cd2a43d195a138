"""`pbsd runs watch`: following a run from a terminal, through a resume and a trainer restart."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pbsd.cli import app
from tests.conftest import TOKEN, trainer_settings
from tests.test_trainer_cli import _add_eval_round
from tests.test_trainer_service import _spec

runner = CliRunner()


async def _in_store(redis_url: str, prefix: str, do) -> None:
    import redis.asyncio as aioredis

    from services.trainer.runs import RunStore

    client = aioredis.from_url(redis_url)
    try:
        await do(RunStore(client, prefix))
    finally:
        await client.aclose()


def _step(step: int, **extra) -> dict:  # as the executor records a step: every figure a float
    return {
        "step": float(step),
        "policy_version": float(step),
        "reward_mean": 0.25,
        "loss": 0.01,
        "grad_norm": 0.5,
        **extra,
    }


def test_runs_watch_follows_steps_and_rounds_until_the_run_ends(
    api, redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path
):
    """`pbsd runs watch`: a line per step and per validation round, each once, the steps again
    after a resume rewrote them, and an exit code that says how the run ended."""
    import httpx

    from pbsd.cli.runs import _look, _Series, _step_line

    spec_file = tmp_path / "run.yaml"
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["max_steps"] = 100
    spec_file.write_text(yaml.safe_dump(spec))
    args = ["--url", api, "--token", TOKEN]
    run_id = runner.invoke(app, ["runs", "submit", str(spec_file), *args]).stdout.strip()

    def store(do):
        asyncio.run(_in_store(redis_url, key_prefix, do))

    async def two_steps(s):  # no rollout worker runs here: the steps are recorded as the executor would
        await s.add_metrics(run_id, _step(1))
        await s.add_metrics(
            run_id,
            _step(
                2,
                answer_free_mean_s=-0.002,
                wrong_final_turns=10.0,
                wrong_final_disfavoured_frac=0.9,
                correct_final_turns=0.0,
            ),
        )

    store(two_steps)
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        steps, look = _Series("metrics", _step_line), partial(_look, client, wait=True)
        first = steps.new_lines(look, run_id)
        assert [line.split()[:2] for line in first] == [["step", "1"], ["step", "2"]]
        assert "answer-free s -0.0020  wrong finals down 90% of 10" in first[1]
        assert "right finals" not in first[1]  # no correct final that step: no fraction
        assert steps.new_lines(look, run_id) == []  # nothing new, nothing shown twice
        store(lambda s: s.add_metrics(run_id, _step(3)))
        assert [line.split()[:2] for line in steps.new_lines(look, run_id)] == [["step", "3"]]

        async def resumed(s):  # a crash lost steps 2 and 3; the resumed run trains step 2 again
            await s.truncate_metrics(run_id, 1)
            await s.add_metrics(run_id, _step(2, skipped_update=1.0, grad_norm=float("nan")))

        store(resumed)
        again = steps.new_lines(look, run_id)
        assert "resumed from a checkpoint" in again[0] and "record 2" in again[0]
        # the API sends the skipped update's NaN norm as null
        assert (
            again[1].startswith("step     2  v2 ") and "grad -  " in again[1] and "UPDATE SKIPPED" in again[1]
        )
        assert len(again) == 2
        store(lambda s: s.add_metrics(run_id, _step(3)))
        assert [line.split()[:2] for line in steps.new_lines(look, run_id)] == [["step", "3"]]

    asyncio.run(_add_eval_round(redis_url, key_prefix, run_id))
    waiting = runner.invoke(app, ["runs", "watch", run_id, "--interval", "0.1", "--timeout", "0.3", *args])
    assert waiting.exit_code == 1 and f"run {run_id}: it is still " in waiting.output, waiting.output
    assert waiting.stdout.count("step ") == 3 + 1  # three steps, and the round's "step     3"
    assert "v3     step     3  mean@4 0.250" in waiting.stdout
    runner.invoke(app, ["runs", "cancel", run_id, *args])
    deadline = time.monotonic() + 60
    while json.loads(runner.invoke(app, ["runs", "show", run_id, *args]).stdout)["state"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelled = runner.invoke(app, ["runs", "watch", run_id, "--interval", "0.1", *args])
    assert cancelled.exit_code == 1 and f"run {run_id} cancelled" in cancelled.output
    store(lambda s: s.update(run_id, state="completed"))
    completed = runner.invoke(app, ["runs", "watch", run_id, "--interval", "0.1", *args])
    assert completed.exit_code == 0 and f"{run_id} completed" in completed.stdout, completed.output


def test_runs_watch_waits_for_a_trainer_it_reached_once_and_not_for_one_it_never_did():
    """A resumed run follows a trainer restart: watch waits through the restart. A trainer never
    reached is a wrong URL, said at once (`test_cli_errors.py`'s "runs watch: no trainer")."""
    import httpx

    from pbsd.cli.runs import _Away, _look
    from services.local_redis import free_port

    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=2) as gone:
        with pytest.raises(_Away, match="connection failed"):
            _look(gone, "/runs/r1", wait=True)
        with pytest.raises(httpx.ConnectError):
            _look(gone, "/runs/r1", wait=False)


def test_runs_watch_follows_a_run_through_a_real_trainer_restart(
    redis_url, key_prefix, tiny_world, tiny_checkpoint, tmp_path, tmp_path_factory
):
    """The trainer service stopped and started again on its port, as a restart does, while watch runs
    as a process of its own: watch says once that it waits, shows the steps the resumed run records
    again, and ends with the run."""
    import httpx

    from services.local_redis import free_port
    from services.trainer.app import create_app
    from tests.servers import serve

    settings = trainer_settings(redis_url, key_prefix, tmp_path, tmp_path_factory)
    port = free_port()
    spec_file = tmp_path / "run.yaml"
    spec = _spec(tiny_world, tiny_checkpoint)
    spec["trainer"]["max_steps"] = 100  # no rollout worker runs: the run waits for groups until cancelled
    spec_file.write_text(yaml.safe_dump(spec))
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def store(do):
        asyncio.run(_in_store(redis_url, key_prefix, do))

    def until(what, test, seconds=60.0):
        deadline = time.monotonic() + seconds
        while not test():
            assert watch is None or watch.poll() is None, f"watch ended waiting for {what}:\n{''.join(said)}"
            assert time.monotonic() < deadline, (
                f"waited {seconds:g} s for {what}; watch said:\n{''.join(said)}"
            )
            time.sleep(0.1)

    def state(url):
        return httpx.get(f"{url}/runs/{run_id}", headers=headers, timeout=5).json()["state"]

    said: list[str] = []
    watch = None
    pbsd = Path(sys.executable).parent / "pbsd"
    with serve(create_app(settings), port=port) as url:
        run_id = runner.invoke(app, ["runs", "submit", str(spec_file), "--url", url, "--token", TOKEN]).stdout
        run_id = run_id.strip()
        until("the run to start", lambda: state(url) == "running")
        store(lambda s: s.add_metrics(run_id, _step(1)))
        watch = subprocess.Popen(
            [str(pbsd), "runs", "watch", run_id, "--interval", "0.2", "--timeout", "150"]
            + ["--url", url, "--token", TOKEN],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )

        def read():  # a line at a time, as watch writes them
            for line in watch.stdout:
                said.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            until("step 1", lambda: any(line.startswith("step     1") for line in said))
        except AssertionError:
            watch.kill()
            raise
    try:  # the trainer is down; the run it was training stays "running", to resume on restart
        until("watch to notice", lambda: any("does not answer" in line for line in said))
        with serve(create_app(settings), port=port) as url:  # the restart: the run resumes at step 0
            until("the resume", lambda: state(url) == "running" and not _metrics(url, run_id, headers))
            store(lambda s: s.add_metrics(run_id, _step(1, reward_mean=0.5)))
            until("step 1 again", lambda: sum(line.startswith("step     1") for line in said) == 2)
            assert httpx.post(f"{url}/runs/{run_id}/cancel", headers=headers, timeout=5).status_code == 202
            assert watch.wait(timeout=60) == 1
    finally:
        watch.kill()
    reader.join(timeout=5)
    out = "".join(said)
    assert sum("does not answer" in line for line in said) == 1, out  # said once, however long it waits
    assert out.index("step     1") < out.index("does not answer") < out.index("resumed from a checkpoint")
    assert "reward 0.500" in out.split("resumed from a checkpoint")[1], out
    assert said[-1].startswith(f"error: run {run_id} cancelled at step"), out


def _metrics(url: str, run_id: str, headers: dict) -> list:
    import httpx

    return httpx.get(f"{url}/runs/{run_id}/metrics", headers=headers, timeout=5).json()
