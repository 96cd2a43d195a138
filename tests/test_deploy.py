"""The deployment, checked without Docker or a cluster, against the real specifications:

* docker-compose.yml validates against the Compose specification's JSON Schema (the copy
  vendored by check-jsonschema), after interpolation with .env.example's values;
* every Kubernetes manifest, rendered from the base and each overlay, validates against the
  Kubernetes 1.37 API schemas (kubernetes-validate, offline, strict);
* every Prometheus scrape target names a service that exists, on the port it listens on;
* every metric a Grafana dashboard queries is exported by a running service (the four pbsd
  services are started and scraped) or by SGLang (its recorded /metrics page);
* every setting the deployment passes is one the services read, every variable the compose
  file uses is documented in .env.example, and no secret is baked into an image.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from importlib.resources import files
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.launcher import ServiceProcess
from services.local_redis import free_port
from services.rollout.settings import RolloutSettings
from services.scorer.settings import ScorerSettings
from services.tools.settings import ToolsSettings
from services.trainer.settings import TrainerSettings
from tests.kustomize import build, containers

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.37.0"
SETTINGS = {
    "PBSD_TOOLS_": ToolsSettings,
    "PBSD_ROLLOUT_": RolloutSettings,
    "PBSD_SCORER_": ScorerSettings,
    "PBSD_TRAINER_": TrainerSettings,
}
# read by something other than a settings class: the bus URL and prefix (CommonSettings'
# aliases), the CLI's trainer URL, torch's thread count, Redis' own password
OTHER_VARIABLES = {
    "REDIS_URL",
    "PBSD_STREAM_PREFIX",
    "PBSD_LOG_LEVEL",
    "PBSD_TRAINER_URL",
    "OMP_NUM_THREADS",
    "REDIS_PASSWORD",
}
SERVICE_ALIASES = ("tools", "rollout", "scorer", "trainer")


# -- helpers -------------------------------------------------------------------------------------
def env_example() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        present = name in env and (env[name] != "" or op in ("-", "?"))
        if op in (":?", "?") and not present:
            raise KeyError(f"{name}: {arg}")
        if op in (":-", "-") and not present:
            return arg
        return env.get(name, "")

    return _VAR.sub(sub, value)


def compose_raw() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose(**overrides: str) -> dict:
    env = env_example()
    env.update(
        REDIS_PASSWORD="s3cret",
        PBSD_TRAINER_API_TOKEN="t0ken",
        GRAFANA_ADMIN_PASSWORD="g",
        PBSD_TOOLS_SERPER_API_KEY="k",
        **overrides,
    )
    return interpolate(compose_raw(), env)


def dockerfile(path: str) -> str:
    return (ROOT / path).read_text()


def listening_port(service: dict) -> int | None:
    """The port a compose service's process listens on: PBSD_<NAME>_PORT from its Dockerfile,
    or SGLang's --port."""
    command = service.get("command") or []
    if isinstance(command, list) and "--port" in command:
        return int(command[command.index("--port") + 1])
    build_ = service.get("build")
    if isinstance(build_, dict) and "dockerfile" in build_:
        m = re.search(r"PBSD_[A-Z]+_PORT=(\d+)", dockerfile(build_["dockerfile"]))
        if m:
            return int(m.group(1))
    return None


def aliases(service: dict) -> list[str]:
    networks = service.get("networks") or {}
    if isinstance(networks, list):
        return []
    return [a for n in networks.values() for a in ((n or {}).get("aliases") or [])]


def check_variables(env: dict[str, str], where: str) -> None:
    for key in env:
        if key in OTHER_VARIABLES:
            continue
        prefix = next((p for p in SETTINGS if key.startswith(p)), None)
        assert prefix is not None, f"{where}: {key} is read by no service"
        field = key[len(prefix) :].lower()
        assert field in SETTINGS[prefix].model_fields, (
            f"{where}: {key} is not a {SETTINGS[prefix].__name__} field"
        )


def load_dashboards() -> dict[str, dict]:
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
    }


def queried_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(
                r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", target["expr"]
            )  # selectors, ranges, strings
            names |= {
                n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if n.startswith(("pbsd_", "sglang:"))
            }
    return names


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can carry, samples or not (a labelled family with no
    children yet still announces itself with HELP and TYPE)."""
    names = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


# -- Docker Compose --------------------------------------------------------------------------------
def test_compose_validates_against_the_compose_specification():
    schema = json.loads((files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    for profile_env in ({}, {"PBSD_ROLLOUT_REPLICAS": "3"}):
        errors = sorted(validator.iter_errors(compose(**profile_env)), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_compose_invalid_documents_are_caught():
    """The schema check can fail: a typo'd key and a wrong type are both rejected."""
    schema = json.loads((files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    doc = compose()
    doc["services"]["redis"]["helthcheck"] = {}
    doc["services"]["tools-cpu"]["depends_on"] = 3
    assert len(list(validator.iter_errors(doc))) >= 2


def test_compose_requires_its_secrets():
    env = env_example()
    env.update(PBSD_TRAINER_API_TOKEN="t", GRAFANA_ADMIN_PASSWORD="g", PBSD_TOOLS_SERPER_API_KEY="k")
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(compose_raw(), env)  # REDIS_PASSWORD is empty in .env.example


def test_compose_profiles_wire_every_stage_once():
    services = compose()["services"]
    for profile in ("cpu", "gpu"):
        active = {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}
        for alias in SERVICE_ALIASES:
            owners = [n for n, s in active.items() if alias in aliases(s)]
            assert len(owners) == 1, f"profile {profile}: alias {alias} is served by {owners}"
        for name, s in active.items():
            for dep, cond in (s.get("depends_on") or {}).items():
                assert dep in active, f"profile {profile}: {name} depends on {dep}, not in the profile"
                if cond["condition"] == "service_healthy":
                    # in the compose file, not only the Dockerfile: podman's OCI images drop HEALTHCHECK
                    assert "healthcheck" in services[dep], (
                        f"{name} waits for {dep} to be healthy, which has no healthcheck"
                    )
        built = {s["image"] for s in active.values() if "build" in s}
        for name, s in active.items():
            # an image built on another one: that one is built by a service of the profile
            base = ((s.get("build") or {}).get("args") or {}).get("BASE")
            if base:
                assert base in built, f"profile {profile}: {name} is built on {base}, which no service builds"
                assert "FROM ${BASE}" in dockerfile(s["build"]["dockerfile"]), name
            # a container others wait for keeps running: podman restarts a crashed container only
            # while every container it depends on runs, so none may depend on a one-shot
            for dep in s.get("depends_on") or {}:
                assert active[dep].get("restart") != "no", (
                    f"profile {profile}: {name} depends on one-shot {dep}"
                )
    assert "sglang" in [n for n, s in services.items() if "gpu" in s.get("profiles", [])]


def _world_params(command: list[str], name: str = "build") -> dict:
    """The parameters `pbsd world <name>` would run with, from a container's `sh -c` command
    (each step of which is in parentheses)."""
    import shlex

    import typer.main

    from pbsd.cli import app

    script = command[-1]
    step = script[script.index(f"pbsd world {name}") :].split(")")[0]
    cmd = typer.main.get_command(app).commands["world"].commands[name]  # built afresh each call
    for param in cmd.params:  # the paths are the container's (/data/world): read them, not check them
        param.callback = None
    return cmd.make_context(name, shlex.split(step)[3:]).params


def test_the_deployed_world_is_the_demos_world(rendered):
    """Compose's and the cpu overlay's world are the one the committed policy was supervised
    on: with another SFT count the validation split would hold questions it was trained on."""
    from demo.config import DemoConfig

    c = DemoConfig()
    want = {"seed": c.seed, "entities": c.entities, "rl": c.n_rl, "validation": c.n_val, "sft": c.n_sft}
    commands = [compose()["services"]["tools-cpu"]["command"]]
    commands += [
        c["command"]
        for d in rendered["cpu"]
        for c in containers(d)
        if "pbsd world build" in " ".join(c.get("command") or [])
    ]
    assert len(commands) == 2
    for command in commands:
        params = _world_params(command)
        assert {k: params[k] for k in want} == want, command
        assert params["questions"] is None
        # then the demo's question files, with the demo's settings, where the Compose run reads them
        questions = _world_params(command, "demo-questions")
        assert questions["config"] is None and str(questions["world"]) == str(params["out"])
        run = yaml.safe_load((ROOT / "deploy/runs/demo-cpu.yaml").read_text())["data"]
        assert (run["train"], run["validation"]) == (
            f"{questions['out']}/rl.jsonl",
            f"{questions['out']}/eval.jsonl",
        )


def test_every_shipped_run_specification_is_valid():
    from proto.runs import RunSpec

    specs = sorted((ROOT / "deploy/runs").glob("*.yaml"))
    assert len(specs) >= 3
    for path in specs:
        RunSpec.model_validate(yaml.safe_load(path.read_text()))


def test_the_compose_run_is_sized_like_the_demo():
    from demo.config import DemoConfig
    from demo.run import run_spec

    compose_run = yaml.safe_load((ROOT / "deploy/runs/demo-cpu.yaml").read_text())
    config = DemoConfig()
    # 70: the easy RL questions of the default world the demo trains on (48 others set aside)
    demo = run_spec(config, "pbsd", Path("policy"), Path("rl.jsonl"), questions=70)
    for section in ("rollout", "trainer"):
        for key, value in demo[section].items():
            if key != "checkpoint_every":
                assert compose_run[section][key] == value, f"{section}.{key}"
    data = compose_run["data"]
    assert (data["epochs"], data["shuffle_seed"]) == (demo["data"]["epochs"], demo["data"]["shuffle_seed"])
    assert data["max_validation_questions"] == config.eval_questions
    assert compose_run["rollout"]["eval_samples"] == config.eval_samples
    assert compose_run["rollout"]["eval_top_p"] == config.eval_top_p


def test_compose_services_connect_to_redis_with_credentials():
    services = compose()["services"]
    redis = services["redis"]
    script = " ".join(redis["entrypoint"])
    assert "user default off" in script and "user pbsd on >" in script and "--aclfile" in script
    assert "--appendonly yes" in script  # persistence on
    assert "healthcheck" in redis
    for name, s in services.items():
        env = s.get("environment") or {}
        if set(aliases(s)) & set(SERVICE_ALIASES):  # a pipeline service (not SGLang, not a client)
            assert env.get("REDIS_URL") == "redis://pbsd:s3cret@redis:6379/0", name


def test_compose_settings_are_real_and_documented():
    raw = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", raw))
    documented = set(env_example())
    assert used <= documented, f"undocumented in .env.example: {sorted(used - documented)}"
    assert documented <= used, f".env.example documents unused variables: {sorted(documented - used)}"
    for name, s in compose()["services"].items():
        if s.get("image", "").startswith("pbsd-"):
            check_variables(s.get("environment") or {}, f"compose service {name}")


def test_images_are_pinned_non_root_and_free_of_secrets():
    for path in sorted((ROOT / "deploy/docker").glob("*.Dockerfile")):
        text = path.read_text()
        for image in re.findall(r"^ARG [A-Z_]*IMAGE=(\S+)", text, flags=re.M):
            assert re.search(r":\d[\w.-]*", image), f"{path.name}: base image {image} is not pinned"
        assert not re.search(r"^(ENV|ARG)\s+\S*(KEY|TOKEN|PASSWORD|SECRET)", text, flags=re.M | re.I), (
            path.name
        )
        if path.name == "base.Dockerfile":
            assert text.count("USER pbsd") == 2  # both runtime flavours
        else:
            assert "HEALTHCHECK" in text and "FROM ${BASE}" in text
    for name, s in compose()["services"].items():
        image = s.get("image", "")
        if "/" in image or image.startswith(("redis", "prom", "grafana")):
            assert re.search(r":v?\d", image), f"{name}: image {image} is not pinned"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".env" in ignored and ".git" in ignored


# -- Prometheus -----------------------------------------------------------------------------------
def test_every_scrape_target_names_a_service_on_its_port():
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    services = compose()["services"]
    by_name: dict[str, list[dict]] = {}
    for name, s in services.items():
        for n in [name, *aliases(s)]:
            by_name.setdefault(n, []).append(s)
    jobs = {}
    for job in config["scrape_configs"]:
        targets = [t for c in job.get("static_configs", []) for t in c["targets"]]
        targets += [f"{n}:{c['port']}" for c in job.get("dns_sd_configs", []) for n in c["names"]]
        for target in targets:
            host, port = target.rsplit(":", 1)
            if host == "127.0.0.1":
                continue  # Prometheus itself
            assert host in by_name, f"job {job['job_name']}: {host} is no compose service"
            ports = {listening_port(s) for s in by_name[host]}
            assert ports == {int(port)}, (
                f"job {job['job_name']}: {host} listens on {ports}, scraped on {port}"
            )
            jobs[host] = job["job_name"]
    assert set(jobs) >= {*SERVICE_ALIASES, "sglang"}


# -- Kubernetes -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: build(ROOT / "deploy/k8s/overlays" / o) for o in ("cpu", "gpu")}


def test_k8s_manifests_validate_against_the_api_schemas(rendered):
    for docs in rendered.values():
        assert len(docs) >= 10
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    example = yaml.safe_load((ROOT / "deploy/k8s/base/secret.example.yaml").read_text())
    kubernetes_validate.validate(example, K8S_VERSION, strict=True)


def test_k8s_validation_catches_mistakes(rendered):
    """The validator is strict: an unknown field and a wrong type both fail."""
    doc = json.loads(
        json.dumps(
            next(
                d for d in rendered["cpu"] if d["metadata"]["name"] == "rollout" and d["kind"] == "Deployment"
            )
        )
    )
    doc["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = json.loads(json.dumps(next(d for d in rendered["cpu"] if d["kind"] == "Service")))
    doc["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _find(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_k8s_workloads_have_probes_resources_and_wiring(rendered):
    secret_keys = set(
        yaml.safe_load((ROOT / "deploy/k8s/base/secret.example.yaml").read_text())["stringData"]
    )
    for overlay, docs in rendered.items():
        names = {(d["kind"], d["metadata"]["name"]) for d in docs}
        config = _find(docs, "ConfigMap", "pbsd-config")["data"]
        check_variables(config, f"{overlay} ConfigMap")
        for name in ("tools", "rollout", "scorer"):
            assert ("Deployment", name) in names
        trainer = _find(docs, "StatefulSet", "trainer")
        assert trainer["spec"]["replicas"] == 1
        assert any(v.get("persistentVolumeClaim") for v in trainer["spec"]["template"]["spec"]["volumes"])
        assert ("StatefulSet", "redis") in names
        hpa = _find(docs, "HorizontalPodAutoscaler", "rollout")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "rollout",
        }
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = doc["spec"]["template"]
            for v in pod["spec"].get("volumes", []):
                if "persistentVolumeClaim" in v:
                    assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
            for c in containers(doc):
                assert ":" in c["image"], (
                    f"{overlay}: {doc['metadata']['name']} image {c['image']} has no tag"
                )
                for e in c.get("env", []):
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == "pbsd-secrets" and ref["key"] in secret_keys
                for src in c.get("envFrom", []):
                    assert ("ConfigMap", src["configMapRef"]["name"]) in names
                if c in pod["spec"]["containers"] and doc["metadata"]["name"] != "redis":
                    check_variables({e["name"]: "" for e in c.get("env", [])}, f"{overlay} {c['name']}")
                    port = c["ports"][0]["containerPort"]
                    for probe in ("readinessProbe", "livenessProbe"):
                        assert c[probe]["httpGet"]["path"] == "/health", (overlay, c["name"], probe)
                    assert "requests" in c["resources"]
                    annotations = pod["metadata"].get("annotations", {})
                    assert annotations.get("prometheus.io/scrape") == "true"
                    assert annotations.get("prometheus.io/port") == str(port)
    gpu = rendered["gpu"]
    for kind, name in (("Deployment", "scorer"), ("StatefulSet", "trainer"), ("StatefulSet", "sglang")):
        assert containers(_find(gpu, kind, name))[-1]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (
        _find(gpu, "HorizontalPodAutoscaler", "rollout")["spec"]["metrics"][0]["external"]["metric"]["name"]
        == "pbsd_stream_lag"
    )
    assert (
        _find(rendered["cpu"], "HorizontalPodAutoscaler", "rollout")["spec"]["metrics"][0]["type"]
        == "Resource"
    )


# -- Grafana --------------------------------------------------------------------------------------
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
    # and the check has teeth: the lag exporter's series are really there, a made-up one is not
    assert {"pbsd_stream_lag", "pbsd_stream_pending", "pbsd_scorer_evidence_bucket"} <= exported
    assert "pbsd_made_up_total" not in exported
