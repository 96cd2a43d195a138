"""The Kubernetes manifests, checked without a cluster: every manifest rendered from the base and
each overlay validates against the Kubernetes 1.37 API schemas (kubernetes-validate, offline,
strict), workloads have probes, resources and their wiring, and the deployed world (Compose's
and the cpu overlay's) is the one the demo's committed policy was supervised on."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from tests.kustomize import build, containers
from tests.test_deploy import ROOT, check_variables, compose

K8S_VERSION = "1.37.0"


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


def test_every_resource_is_in_the_namespace_with_the_label(rendered):
    """The base's namespace and labels reach only the base's resources: the gpu overlay's SGLang
    went to the context's namespace (default), where its claim and the workers' URL are not. The
    gpu overlay's volume holds a 30B run's checkpoints, and its GPU pods have Compose's /dev/shm."""
    from tests.kustomize import CLUSTER_SCOPED

    for overlay, docs in rendered.items():
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                where = f"{overlay}: {d['kind']}/{d['metadata']['name']}"
                assert d["metadata"].get("namespace") == "pbsd", where
                assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pbsd", where
    claims = {o: _find(docs, "PersistentVolumeClaim", "pbsd-data") for o, docs in rendered.items()}
    assert claims["gpu"]["spec"]["resources"]["requests"]["storage"] == "2Ti"  # a 30B run's checkpoints
    assert claims["gpu"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for kind, name in (("Deployment", "scorer"), ("StatefulSet", "trainer")):  # 64 MiB by default
        (container,) = _find(rendered["gpu"], kind, name)["spec"]["template"]["spec"]["containers"]
        assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}, name


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
        for doc in docs:  # no walk over every checkpoint on the volume at each pod's start
            if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] != "sglang":
                context = doc["spec"]["template"]["spec"]["securityContext"]
                assert context.get("fsGroupChangePolicy") == "OnRootMismatch", doc["metadata"]["name"]
        # a scale-down takes one worker's groups in flight at a time, not every pod's at once
        assert hpa["spec"]["behavior"]["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": 300}
        ]
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
                    # readiness asks the service's health (SGLang's by a one-token generation);
                    # a worker's liveness only whether it runs, not its engine's health
                    ready = "/health_generate" if c["name"] == "sglang" else "/health"
                    live = "/livez" if c["name"] in ("rollout", "scorer") else "/health"
                    assert c["readinessProbe"]["httpGet"]["path"] == ready, (overlay, c["name"])
                    assert c["livenessProbe"]["httpGet"]["path"] == live, (overlay, c["name"])
                    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                        # Kubernetes' default timeout is 1 s, less than SGLang's /health_generate
                        # takes, or a worker's /health asking its engine
                        assert c.get(probe, {"timeoutSeconds": 5}).get("timeoutSeconds", 1) >= 5, (
                            overlay,
                            c["name"],
                            probe,
                        )
                    assert "requests" in c["resources"]
                    annotations = pod["metadata"].get("annotations", {})
                    assert annotations.get("prometheus.io/scrape") == "true"
                    assert annotations.get("prometheus.io/port") == str(port)
    gpu = rendered["gpu"]
    for kind, name in (("Deployment", "scorer"), ("StatefulSet", "trainer"), ("StatefulSet", "sglang")):
        assert containers(_find(gpu, kind, name))[-1]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the SGLang pods' names resolve while they load a version (not ready then)
    assert _find(gpu, "Service", "sglang")["spec"]["publishNotReadyAddresses"] is True
    # Redis refuses writes (waited out) before the kernel kills it: its cap under its limit, both overlays
    for overlay, cap in (("cpu", 6), ("gpu", 36)):
        redis = _find(rendered[overlay], "StatefulSet", "redis")
        assert '--maxmemory "${REDIS_MAXMEMORY:-6gb}"' in containers(redis)[0]["command"][-1]
        config = _find(rendered[overlay], "ConfigMap", "pbsd-config")["data"]
        assert config.get("REDIS_MAXMEMORY", "6gb") == f"{cap}gb"
        limit = containers(redis)[0]["resources"]["limits"]["memory"]
        assert int(limit.removesuffix("Gi")) >= cap * 1.25, (overlay, limit)
    assert (
        _find(gpu, "HorizontalPodAutoscaler", "rollout")["spec"]["metrics"][0]["external"]["metric"]["name"]
        == "pbsd_stream_outstanding"
    )
    assert (
        _find(rendered["cpu"], "HorizontalPodAutoscaler", "rollout")["spec"]["metrics"][0]["type"]
        == "Resource"
    )


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


def _grace(env: dict, service: str) -> float:
    """A service's own shutdown grace: its setting where the deployment sets it, else the default."""
    from services.rollout.settings import RolloutSettings
    from services.scorer.settings import ScorerSettings
    from services.trainer.settings import TrainerSettings

    settings = {"rollout": RolloutSettings, "scorer": ScorerSettings, "trainer": TrainerSettings}[service]
    set_to = env.get(f"PBSD_{service.upper()}_SHUTDOWN_GRACE_S")
    return float(set_to) if set_to is not None else settings.model_fields["shutdown_grace_s"].default


def _after_grace(service: str) -> float:
    """What a service may still take once its grace is out: a rollout worker keeps what it had done
    of its groups, then hands the prompts back, each bounded; a scorer hands back; the trainer's
    last checkpoint is inside its grace."""
    from services.policy_worker import PolicyWorker

    return {"rollout": 2, "scorer": 1, "trainer": 0}[service] * PolicyWorker.release_timeout_s


def test_every_service_finishes_its_shutdown_inside_the_orchestrators_grace(rendered):
    """A worker that cuts its work off long before it is killed throws work away (its group is
    sampled or scored again elsewhere); one that is killed first never acknowledges what it did,
    nor hands back what it had done."""
    for overlay, docs in rendered.items():
        config = _find(docs, "ConfigMap", "pbsd-config")["data"]
        for kind, name in (("Deployment", "rollout"), ("Deployment", "scorer"), ("StatefulSet", "trainer")):
            killed_at = _find(docs, kind, name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            grace = _grace(config, name)
            assert killed_at * 0.75 <= grace < killed_at - max(10, _after_grace(name)), (overlay, name, grace)
    for name, service in compose()["services"].items():
        kind = next((k for k in ("rollout", "scorer", "trainer") if name.startswith(k)), None)
        if kind is None:
            continue
        killed_at = {"2m": 120, "10m": 600}[service["stop_grace_period"]]
        grace = _grace(service.get("environment") or {}, kind)
        assert killed_at * 0.75 <= grace < killed_at - max(10, _after_grace(kind)), (name, grace, killed_at)
