"""Just enough of ``kustomize build`` to render deploy/k8s for the tests (no kustomize binary
here): resources (files and directories), namespace, labels, images and strategic-merge
patches, with the merge keys the Kubernetes API declares for the lists we patch."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# patchMergeKey of the list fields we patch; any other list is replaced, as the API says
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(target.get(key), list):
            merge_key = MERGE_KEYS[key]
            for item in value:
                match = next((t for t in target[key] if t.get(merge_key) == item.get(merge_key)), None)
                if match is None:
                    target[key].append(copy.deepcopy(item))
                else:
                    merge(match, item)
        else:
            target[key] = copy.deepcopy(value)


def _containers(doc: dict):
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get(
        "spec", spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec")
    )
    if not pod:
        return
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def build(directory: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in k.get("resources", []):
        path = directory / resource
        docs += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        for p in yaml.safe_load_all((directory / patch["path"]).read_text()):
            matches = [
                d for d in docs if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]
            ]
            if len(matches) != 1:
                raise ValueError(
                    f"patch {patch['path']}: {p['kind']}/{p['metadata']['name']} matches {len(matches)}"
                )
            merge(matches[0], p)
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in k.get("images", []):
        for d in docs:
            for c in _containers(d):
                name = c["image"].split(":")[0]
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', 'latest')}"
    return docs


def containers(doc: dict) -> list[dict]:
    return list(_containers(doc))
