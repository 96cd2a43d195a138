"""The deployment, checked without Docker or a cluster, against the real specifications:

* docker-compose.yml validates against the Compose specification's JSON Schema (the copy
  vendored by check-jsonschema), after interpolation with .env.example's values;
* every Prometheus scrape target names a service that exists, on the port it listens on;
* every setting the deployment passes is one the services read, every variable the compose
  file uses is documented in .env.example, and no secret is baked into an image.

The Kubernetes manifests are tests/test_deploy_k8s.py's, the Grafana dashboards and the metrics
they query tests/test_deploy_metrics.py's; both use the helpers here.
"""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.rollout.settings import RolloutSettings
from services.scorer.settings import ScorerSettings
from services.tools.settings import ToolsSettings
from services.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "PBSD_TOOLS_": ToolsSettings,
    "PBSD_ROLLOUT_": RolloutSettings,
    "PBSD_SCORER_": ScorerSettings,
    "PBSD_TRAINER_": TrainerSettings,
}
# read by something other than a settings class: the bus URL and prefix (CommonSettings'
# aliases), the CLI's trainer URL, torch's thread count, Redis' own password and memory cap
OTHER_VARIABLES = {
    "REDIS_URL",
    "PBSD_STREAM_PREFIX",
    "PBSD_LOG_LEVEL",
    "PBSD_TRAINER_URL",
    "OMP_NUM_THREADS",
    "REDIS_PASSWORD",
    "REDIS_MAXMEMORY",  # Redis' own maxmemory, read by its start command (k8s)
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",  # SGLang's own (sglang/srt/environ.py)
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
    return {
        n for panel in dashboard["panels"] for t in panel.get("targets", []) for n in expr_metrics(t["expr"])
    }


def expr_metrics(expr: str) -> set[str]:
    """The pbsd and SGLang series a PromQL expression reads."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", expr)  # selectors, ranges, strings
    return {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if n.startswith(("pbsd_", "sglang:"))}


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


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
    for section in ("rollout", "trainer", "algorithm"):
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
def test_the_alert_rules_are_loaded_and_say_what_to_do():
    """Prometheus loads them (the compose file mounts them beside its configuration), and every
    rule has a severity and an operator's summary and description; that each one's series exist
    is tests/test_deploy_metrics.py's, that Prometheus evaluates them `make test-deploy`'s."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    mounts = compose()["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules) >= 6
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, rule["alert"]
        assert rule["alert"] == "PbsdServiceDown" or expr_metrics(rule["expr"]), rule["alert"]


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
