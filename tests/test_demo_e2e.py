"""The main job end to end with the smallest settings: real Redis, the four services as real
processes, the committed warm policy, a PBSD run through the REST API, evaluation and report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack


def _service_processes(out: Path) -> list[str]:
    """The demo's services still running: ``pbsd serve`` processes started in this test's folder
    (services run in the demo's working directory), and its Redis (its data, and so its working
    directory, lie in ``out``). Other
    demos and services on the machine are not this test's."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if ("pbsd.cli serve" in args and cwd.startswith(str(out.parent))) or (
            "redis-server" in args and (str(out) in args or cwd.startswith(str(out)))
        ):
            found.append(args)
    return found


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "pbsd.cli",
        "demo",
        "--out",
        "demo",  # relative, as `make demo`'s default runs/demo-<time> is
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--eval-questions",
        "2",
        "--max-turns",
        "3",
        "--max-tokens-per-turn",
        "48",
        "--stall-timeout",  # a stuck pipeline fails here with its logs' place, inside pytest's 300 s
        "120",
    ]
    result = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "pbsd demo finished" in result.stdout

    (run_dir,) = (out / "runs").iterdir()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1.0, 2.0]  # steps happened
    assert [m["policy_version"] for m in metrics] == [1.0, 2.0]  # and published weight versions advanced
    assert [(p / "config.json").exists() for p in (run_dir / "weights").glob("v000002-*")] == [True] and (
        run_dir / "final" / "config.json"
    ).exists()
    assert all("teacher_higher_frac" in m and m["scored_turns"] > 0 for m in metrics)  # evidence was computed
    # with the teacher sanity figures and the null pass's noise floor, summed over the step's groups
    assert all(m["noise_tokens"] > 0 and "answer_free_turns" in m for m in metrics)
    # grounding is measured when a batch has a search (48 tokens a turn rarely finish one)
    assert all(0 <= m.get("grounded_queries_frac", 0) <= 1 for m in metrics)
    groups = [
        g for path in sorted((run_dir / "groups").iterdir()) for g in msgpack.unpackb(path.read_bytes())
    ]
    assert len(groups) == 4

    report = (out / "report.html").read_text()
    assert report.count("<img") >= 4 and "data:image/png;base64," in report
    assert (out / "viewer-pbsd.html").exists() and (out / "metrics-pbsd.jsonl").exists()
    assert {p.name for p in (out / "figures").iterdir()} >= {
        "reward_accuracy.png",
        "evidence.png",
        "before_after.png",
    }
    for name in ("eval-before.json", "eval-after-pbsd.json"):
        evaluation = json.loads((out / name).read_text())
        assert evaluation["questions"] == 2 and set(evaluation["grounding"]) == {
            "queries",
            "reads",
            "answers",
        }
        assert ("change" in evaluation) == (name != "eval-before.json")
    assert "grounded searches" in report and "Does the teacher read x*?" in report
    # the teacher's x* is the demo's answer-first note, and beside the favoured fraction its bound
    assert "Verified answer: {answer}" in report and "any teacher could favour" in report
    assert "data-testid='sanity'" in (out / "viewer-pbsd.html").read_text()
    assert "change of mean@1 from before" in report and "95% CI" in report  # the paired comparison
    assert "change " in result.stdout and " better, " in result.stdout
    assert _service_processes(out) == []  # nothing left behind


def test_a_world_left_by_a_demo_with_other_settings_is_refused(tmp_path):
    """--out reused with other world settings: the demo stops before training on the old world."""
    import pytest

    from demo.config import DemoConfig
    from demo.run import run_demo

    world = tmp_path / "world"
    world.mkdir()
    (world / "manifest.json").write_text("{}")
    (world / "demo-world.json").write_text(
        json.dumps({"seed": 0, "entities": 300, "n_rl": 20, "n_val": 10, "n_sft": 30})
    )
    with pytest.raises(SystemExit, match=r"was built for .*'entities': 300"):
        run_demo(DemoConfig(), tmp_path)


def test_a_terminated_demo_stops_its_services(tmp_path):
    """`kill <demo>` (SIGTERM, what a CI timeout or a supervisor sends) goes through the demo's own
    clean-up as Ctrl-C does: Python's default would end the demo on the spot, leaving its services
    to learn of it from their parent's death after Redis had gone, and a trainer mid-step to wait
    out its shutdown grace."""
    out = tmp_path / "demo"
    log = tmp_path / "demo.log"
    cmd = [sys.executable, "-m", "pbsd.cli", "demo", "--out", str(out), "--steps", "50"]
    cmd += ["--eval-questions", "1", "--max-turns", "2", "--max-tokens-per-turn", "32"]
    with log.open("w") as sink:
        demo = subprocess.Popen(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            deadline = time.monotonic() + 240
            while "submitted pbsd run" not in log.read_text():
                assert demo.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            time.sleep(3)  # into the run: rollouts in flight, the trainer waiting for groups
            demo.send_signal(signal.SIGTERM)
            code = demo.wait(timeout=60)
        finally:
            demo.kill()
    assert code != -signal.SIGTERM, "the demo died without its clean-up"
    assert _service_processes(out) == [], log.read_text()[-3000:]
