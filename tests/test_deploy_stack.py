"""The Compose stack for real (`make test-deploy`, marker `deploy`; never in the default suite).

On this machine's container engine (Docker, else podman; tests/deploystack/engine.py), the cpu
profile's images are built with the commands deploy/README.md gives a Docker user, the profile
is brought up, every health check must pass, a short PBSD run is submitted through the trainer's
REST API with the token the trainer was given, and the rollout worker is crashed mid-run (its
process killed, the engine's restart policy brings it back). Then: the run completed, Prometheus
(in the stack) scraped every service, and every PromQL expression of every provisioned Grafana
dashboard returns series over the run. The stack is taken down with its volumes at the end.

Two services of the profile do not start: Grafana, whose image no registry here serves and
which has no Debian package (its dashboards are evaluated through Prometheus instead:
tests/deploystack/promql.py), and demo-run, the one-shot client that submits the 16-step demo;
this test submits its own short run the same way (`POST /runs` with the bearer token).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from docker.errors import DockerException

from services.local_redis import free_port
from tests.deploystack.engine import HealthTicker, start_engine
from tests.deploystack.images import ROOT, build_settings, fill_wheelhouse, standins_needed
from tests.deploystack.promql import grafana_expr, panel_queries, query_range
from tests.test_deploy import alert_rules

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600)]

PROFILE = "cpu"
NOT_STARTED = {"grafana": "no image here", "demo-run": "this test submits its own run"}
SCRAPED = ("pbsd-trainer", "pbsd-rollout", "pbsd-scorer", "pbsd-tools", "prometheus")
# what the cpu profile does not run: SGLang (a dashboard of its own) and the web tools' upstreams
# (Serper, Jina, the summariser), whose series the offline backend never has
OTHER_PROFILE = {
    "sglang": "SGLang runs in the gpu profile only",
    "pbsd_tools_upstream_": "the web tools' upstreams: the gpu profile's",
    "pbsd_tools_breaker_state": "the web tools' circuit breakers: the gpu profile's",
}
CRASHED = "rollout-cpu"
STEP_S = 15


def short_run() -> dict:
    """A PBSD run that takes minutes on two cores: the demo's questions, a few small steps, a
    validation round before and after (the accuracy panels), a KL term (the KL series)."""
    return {
        "name": "stack-test",
        "model": {"path": "/opt/pbsd/assets/demo-policy", "dtype": "float32"},
        "data": {
            "train": "/data/world/demo/rl.jsonl",
            "validation": "/data/world/demo/eval.jsonl",
            "max_validation_questions": 4,
        },
        "rollout": {"group_size": 4, "max_turns": 4, "max_tokens_per_turn": 96, "max_context": 4096},
        "algorithm": {"name": "pbsd", "kl_coef": 0.01},
        "trainer": {"prompts_per_step": 2, "max_steps": 4, "lr": 1e-4, "warmup_steps": 1},
    }


class Stack:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.project = f"pbsdtest{secrets.token_hex(3)}"
        self.ports = {k: free_port() for k in ("TRAINER", "REDIS", "PROMETHEUS", "GRAFANA")}
        self.timings: dict[str, float] = {}
        subprocess.run([ROOT / "scripts/deploy-setup.sh"], check=True)
        self.engine = start_engine(workdir)
        self.standins = standins_needed(self.engine)
        settings = build_settings(self.standins)
        if self.standins:
            subprocess.run(
                [ROOT / "scripts/deploy-setup.sh"], check=True, env={**os.environ, "PBSD_STANDINS": "1"}
            )
            fill_wheelhouse(self.engine, settings["PYTHON_IMAGE"])
        env = {
            "REDIS_PASSWORD": secrets.token_hex(24),
            "PBSD_TRAINER_API_TOKEN": secrets.token_hex(24),
            "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(12),
            **{f"{k}_HOST_PORT": str(v) for k, v in self.ports.items()},
            **settings,
        }
        self.env_file = workdir / "stack.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    def compose(self, *args: str, timeout: float = 1800) -> None:
        cmd = [*self.engine.compose, "-f", str(ROOT / "docker-compose.yml"), "-p", self.project]
        cmd += ["--env-file", str(self.env_file), "--profile", PROFILE, *args]
        with (self.workdir / "compose.log").open("a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(args)} failed: see {self.workdir}/compose.log"

    def services(self) -> list[str]:
        doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
        active = [n for n, s in doc.items() if not s.get("profiles") or PROFILE in s["profiles"]]
        return [n for n in active if n not in NOT_STARTED and "image" in doc[n] and not n.startswith("base-")]

    def containers(self, service: str | None = None):
        labels = [f"com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return self.engine.client.containers.list(all=True, filters={"label": labels})

    def wait_healthy(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pending = []
            for c in self.containers():
                c.reload()
                state = c.attrs["State"]
                service = c.labels.get("com.docker.compose.service")
                if "Healthcheck" in (c.attrs.get("Config") or {}) and c.attrs["Config"]["Healthcheck"].get(
                    "Test"
                ):
                    if (state.get("Health") or {}).get("Status") != "healthy":
                        pending.append(f"{service}: {(state.get('Health') or {}).get('Status')}")
                elif state["Status"] != "running":
                    pending.append(f"{service}: {state['Status']}")
            if not pending:
                return
            assert time.monotonic() < deadline, f"not healthy after {timeout:.0f} s: {pending}"
            time.sleep(2)

    def built_images(self) -> list[str]:
        doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
        return sorted(
            {svc["image"] for svc in doc.values() if "build" in svc and PROFILE in svc.get("profiles", [])}
        )

    def forget_images(self) -> None:
        for image in self.built_images():
            with contextlib.suppress(DockerException):
                self.engine.client.images.remove(image, force=True)
        self.engine.client.images.prune(filters={"dangling": True})  # the build stages' layers
        if self.engine.name == "docker":
            self.engine.client.api.prune_builds()

    def save_logs(self) -> None:
        for c in self.containers():
            with contextlib.suppress(Exception):
                name = c.labels.get("com.docker.compose.service", c.name)
                (self.workdir / f"{name}-{c.short_id}.log").write_bytes(c.logs(timestamps=True))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    print(f"\nstack: {s.engine.name}, stand-ins {s.standins}, project {s.project}, work in {s.workdir}")
    ticker = HealthTicker(s.engine, s.project) if s.engine.needs_health_ticker() else contextlib.nullcontext()
    try:
        if os.environ.get("PBSD_DEPLOY_COLD") == "1":  # timings of a first build: no image, no cache
            s.forget_images()
        # deploy/README.md, "Docker Compose": the base image, then the service images, then up
        t = time.monotonic()
        s.compose("build", "base-cpu")
        s.timings["build base-cpu s"] = time.monotonic() - t
        t = time.monotonic()
        s.compose("build")
        s.timings["build services s"] = time.monotonic() - t
        for image in s.built_images():
            s.timings[f"size {image} GB"] = s.engine.client.images.get(image).attrs["Size"] / 1e9
        with ticker:
            t = time.monotonic()
            s.compose("up", "-d", *s.services())
            s.wait_healthy()
            s.timings["up to healthy s"] = time.monotonic() - t
            yield s
    finally:
        with contextlib.suppress(Exception):
            s.save_logs()
        try:
            s.compose("down", "-v", timeout=900)
        finally:
            leftover = s.containers()
            s.engine.close()
            (s.workdir / "timings.json").write_text(json.dumps(s.timings, indent=1))
            print(f"stack timings: {s.timings}")
        assert not leftover, f"containers left after down: {[c.name for c in leftover]}"


def crash(container) -> None:
    """Kill the service's process inside the container, as an out-of-memory kill would: the
    container exits non-zero and the restart policy, not the harness, brings it back."""
    script = (
        "import os, signal\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        cmd = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
        "        if b'serve' in cmd:\n"
        "            os.kill(int(p), signal.SIGKILL)\n"
    )
    container.exec_run(["python", "-c", script])


@pytest.fixture(scope="module")
def finished_run(stack):
    trainer = stack.containers("trainer-cpu")[0]
    env = dict(e.split("=", 1) for e in trainer.attrs["Config"]["Env"])
    token = env["PBSD_TRAINER_API_TOKEN"]
    url = f"http://127.0.0.1:{stack.ports['TRAINER']}"
    rollout = stack.containers(CRASHED)[0]
    restarts_before = rollout.attrs.get("RestartCount", 0)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        assert httpx.get(f"{url}/runs", timeout=30).status_code == 401  # the token is required
        start = time.time()
        run_id = api.post("/runs", json=short_run()).raise_for_status().json()["id"]
        crashed_at = None
        deadline = time.monotonic() + 2400
        while (run := api.get(f"/runs/{run_id}").raise_for_status().json())["state"] not in (
            "completed",
            "failed",
        ):
            assert time.monotonic() < deadline, f"the run did not finish: {run}"
            if crashed_at is None and (run.get("step") or 0) >= 1:
                crash(rollout)
                crashed_at = run.get("step")
            time.sleep(3)
        end = time.time()
        stack.timings["run s"] = end - start
        evals = api.get(f"/runs/{run_id}/evals").raise_for_status().json()
    time.sleep(2 * STEP_S)  # the last values scraped at least once more
    rollout.reload()
    return {
        "run": run,
        "url": url,
        "token": token,
        "evals": evals,
        "start": start,
        "end": end,
        "crashed_at_step": crashed_at,
        "restarts": rollout.attrs.get("RestartCount", 0) - restarts_before,
    }


def test_every_service_is_healthy_and_the_secrets_are_not_in_the_images(stack):
    stack.wait_healthy(timeout=60)
    for c in stack.containers():
        image = stack.engine.client.images.get(c.attrs["Image"])
        config_env = " ".join(image.attrs["Config"].get("Env") or [])
        secrets_ = [line.split("=", 1)[1] for line in stack.env_file.read_text().splitlines()]
        assert not [v for v in secrets_ if len(v) >= 24 and v in config_env], c.name


def test_no_service_runs_as_root(stack):
    """Redis ran as root: Compose replaces its image's entrypoint, which is what stepped down to
    the image's "redis" user. The process each container started is read, not its configuration."""
    for c in stack.containers():
        code, out = c.exec_run(["cat", "/proc/1/status"])
        assert code == 0, (c.name, out)
        uids = next(line for line in out.decode().splitlines() if line.startswith("Uid:")).split()[1:]
        assert "0" not in uids, (c.labels.get("com.docker.compose.service"), uids)


def test_a_run_completes_through_the_api_with_a_crashed_rollout_worker(finished_run):
    run = finished_run["run"]
    assert run["state"] == "completed", run.get("error")
    assert run["step"] == short_run()["trainer"]["max_steps"]
    assert finished_run["crashed_at_step"] is not None, "the run finished before the crash"
    assert finished_run["restarts"] >= 1, "the crashed rollout worker was not restarted"
    assert [r["version"] for r in finished_run["evals"]] == [0, short_run()["trainer"]["max_steps"]]


def test_runs_watch_shows_the_run_step_by_step(finished_run):
    """`pbsd runs watch` from the host, on the stack's trainer: every step and both validation
    rounds of the real run's records, each once, and exit 0 for a completed run."""
    pbsd = Path(sys.executable).parent / "pbsd"
    run_id, steps = finished_run["run"]["id"], short_run()["trainer"]["max_steps"]
    watched = subprocess.run(
        [
            str(pbsd),
            "runs",
            "watch",
            run_id,
            "--url",
            finished_run["url"],
            "--interval",
            "0.5",
            "--timeout",
            "60",
        ],
        env={**os.environ, "PBSD_TRAINER_API_TOKEN": finished_run["token"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert watched.returncode == 0, watched.stdout + watched.stderr
    lines = watched.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == [
        str(s) for s in range(1, steps + 1)
    ]
    assert [line.split()[0] for line in lines if line.startswith("v")] == ["v0", f"v{steps}"]
    assert any("answer-free s" in line for line in lines)  # a PBSD run: the teacher's figures
    assert lines[-1] == f"{run_id} completed at step {steps}"


def test_prometheus_scraped_every_service(stack, finished_run):
    prometheus = f"http://127.0.0.1:{stack.ports['PROMETHEUS']}"
    window = int(finished_run["end"] - finished_run["start"]) + 60
    for job in SCRAPED:
        series = query_range(
            prometheus,
            f'max_over_time(up{{job="{job}"}}[{window}s])',
            finished_run["end"],
            finished_run["end"],
            STEP_S,
        )
        assert series and all(float(s["values"][-1][1]) == 1 for s in series), f"{job} was never scraped up"


def test_prometheus_loads_and_evaluates_every_alert_rule(stack, finished_run):
    """deploy/prometheus/alerts.yml, mounted beside the configuration: every rule loaded and
    evaluated without an error over the run (a rule Prometheus cannot parse fails its start-up)."""
    prometheus = f"http://127.0.0.1:{stack.ports['PROMETHEUS']}"
    loaded = httpx.get(f"{prometheus}/api/v1/rules", timeout=30).raise_for_status().json()["data"]["groups"]
    rules = {r["name"]: r for group in loaded for r in group["rules"]}
    assert set(rules) == {r["alert"] for r in alert_rules()}
    broken = {
        name: r.get("lastError") for name, r in rules.items() if r["health"] != "ok" or r.get("lastError")
    }
    assert not broken, broken
    # the run's stack is sound: nothing that pages anyone fires over it (info may: the teacher's drift)
    paging = [
        r["name"] for r in rules.values() if r["state"] == "firing" and r["labels"]["severity"] != "info"
    ]
    assert not paging, paging


def test_every_dashboard_query_returns_series_over_the_run(stack, finished_run):
    prometheus = f"http://127.0.0.1:{stack.ports['PROMETHEUS']}"
    start, end = finished_run["start"], time.time()
    queries = [
        q
        for q in panel_queries(ROOT / "deploy/grafana/dashboards")
        if q.dashboard not in OTHER_PROFILE and not any(k in q.expr for k in OTHER_PROFILE)
    ]
    assert len(queries) >= 40
    empty = []
    for q in queries:
        expr = grafana_expr(q.expr, range_s=int(end - start), step_s=STEP_S)
        if not query_range(prometheus, expr, start, end, STEP_S):
            empty.append(f"{q.dashboard} / {q.panel}: {expr}")
    assert not empty, "panels with no series over the run:\n" + "\n".join(empty)
