"""The Grafana dashboards: generated from their source, and every metric they query exported by a
running service (the four pbsd services started as processes and scraped, a run with validation
through them) or by SGLang (its recorded /metrics page)."""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import pytest

from services.launcher import ServiceProcess
from services.local_redis import free_port
from tests.test_deploy import (
    ROOT,
    alert_rules,
    exported_names,
    expr_metrics,
    load_dashboards,
    queried_metrics,
)


def test_dashboards_are_generated_from_their_source():
    spec = importlib.util.spec_from_file_location("dashboards", ROOT / "deploy/grafana/dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    on_disk = {p.name: p.read_text() for p in (ROOT / "deploy/grafana/dashboards").glob("*.json")}
    assert on_disk == module.render(), "run: python deploy/grafana/dashboards.py"
    dashboards = load_dashboards()
    assert set(dashboards) == {"pipeline", "credit", "tools", "sglang"}
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    for d in dashboards.values():
        for p in d["panels"]:
            if p["type"] != "row":
                assert p["targets"] and p["description"] and p["datasource"]["uid"] == "pbsd-prometheus"


@pytest.fixture(scope="module")
def pipeline(redis_server, tiny_checkpoint, tiny_world, tmp_path_factory):
    """The four services as processes, as in production, on one Redis (trainer in local mode)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    common = {
        "REDIS_URL": redis_server.url,
        "PBSD_STREAM_PREFIX": f"p{free_port()}",
        "PBSD_LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    tools = ServiceProcess(
        "tools",
        port=free_port(),
        log=tmp / "tools.log",
        env={**common, "PBSD_TOOLS_CORPUS": str(tiny_world / "corpus.jsonl")},
    )
    services = {
        "tools": tools,
        "rollout": ServiceProcess(
            "rollout",
            port=free_port(),
            log=tmp / "rollout.log",
            env={**common, "PBSD_ROLLOUT_MODEL": str(tiny_checkpoint), "PBSD_ROLLOUT_TOOLS_URL": tools.url},
        ),
        "scorer": ServiceProcess(
            "scorer",
            port=free_port(),
            log=tmp / "scorer.log",
            env={**common, "PBSD_SCORER_MODEL": str(tiny_checkpoint)},
        ),
        "trainer": ServiceProcess(
            "trainer",
            port=free_port(),
            log=tmp / "trainer.log",
            env={
                **common,
                "PBSD_TRAINER_LOCAL_MODE": "1",
                "PBSD_TRAINER_RUNS_DIR": str(tmp / "runs"),
                "PBSD_TRAINER_DATA_ROOTS": json.dumps([str(tmp_path_factory.getbasetemp())]),
                "PBSD_TRAINER_MODEL_ROOTS": json.dumps([str(tmp_path_factory.getbasetemp())]),
                "PBSD_TRAINER_LAG_INTERVAL_S": "0.2",
            },
        ),
    }
    try:
        for s in services.values():
            s.start()
        for s in services.values():
            s.wait_healthy(timeout=240)
        yield services
    finally:
        for s in services.values():
            s.stop()


@pytest.mark.timeout(300)
def test_a_run_with_validation_through_the_services_as_processes(pipeline, tiny_world, tiny_checkpoint):
    """data.validation end to end: the trainer publishes validation prompts, the rollout process
    samples them with the published version and sends them back on the evals stream."""
    spec = {
        "name": "validated",
        "model": {"path": str(tiny_checkpoint), "dtype": "float32"},
        "data": {
            "train": str(tiny_world / "questions" / "rl.jsonl"),
            "validation": str(tiny_world / "questions" / "validation.jsonl"),
            "max_validation_questions": 2,
        },
        "rollout": {"group_size": 2, "max_turns": 2, "max_tokens_per_turn": 16, "eval_samples": 1},
        "algorithm": {"name": "pbsd"},
        "trainer": {"prompts_per_step": 1, "max_steps": 1, "lr": 1e-4, "warmup_steps": 0},
    }
    with httpx.Client(base_url=pipeline["trainer"].url, timeout=30) as api:
        run_id = api.post("/runs", json=spec).raise_for_status().json()["id"]
        deadline = time.monotonic() + 240
        while (state := api.get(f"/runs/{run_id}").json()["state"]) not in ("completed", "failed"):
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(0.5)
        assert state == "completed", api.get(f"/runs/{run_id}").json()["error"]
        rounds = api.get(f"/runs/{run_id}/evals").json()
    assert [(r["version"], r["versions_used"], r["questions"], r["samples"]) for r in rounds] == [
        (0, [0], 2, 1),
        (1, [1], 2, 1),
    ]
    assert all(r["failed"] == 0 for r in rounds)


@pytest.mark.timeout(300)
def test_every_dashboard_metric_is_exported_by_a_running_service(pipeline):
    exported: set[str] = set()
    for s in pipeline.values():
        exported |= exported_names(httpx.get(f"{s.url}/metrics", timeout=10).text)
    exported |= exported_names((ROOT / "tests/fixtures/sglang_metrics.txt").read_text())
    missing = {}
    for name, dashboard in load_dashboards().items():
        queried = queried_metrics(dashboard)
        assert queried, name
        if queried - exported:
            missing[name] = sorted(queried - exported)
    assert not missing, f"dashboards query series no service exports: {missing}"
    alerts = {r["alert"]: expr_metrics(r["expr"]) - exported for r in alert_rules()}
    assert not any(alerts.values()), f"alert rules read series no service exports: {alerts}"
    # and the check has teeth: the lag exporter's series are really there, a made-up one is not
    assert {"pbsd_stream_lag", "pbsd_stream_pending", "pbsd_scorer_evidence_bucket"} <= exported
    assert "pbsd_made_up_total" not in exported
