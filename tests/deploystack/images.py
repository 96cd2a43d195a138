"""What the image builds need on this machine: base images and pip's packages.

Base images: the official ones when the engine can pull them; otherwise the stand-ins that
scripts/deploy-setup.sh builds from Debian's packages (deploy/standin/images.env names them).

Packages: where the official images can be pulled, the builds read PyPI and PyTorch's CPU index
themselves. Where they cannot, neither can a build container be trusted to reach an index, so
deploy/docker/wheels/ is filled first and the builds install from it alone (PIP_OPTIONS=--no-index):
torch's +cpu wheel through this machine's pip (its configured indexes and wheel directories, or
PyTorch's CPU index), then everything else by the image's own Python (so environment markers such
as `python_full_version < "3.11.3"` are decided by the interpreter that will run them), on the
host's network with the host's CA certificates.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from docker.errors import DockerException

from tests.deploystack.engine import Engine

__all__ = ["ROOT", "TORCH", "build_settings", "fill_wheelhouse", "standins_needed"]

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "deploy/docker/wheels"
TORCH = "torch==2.13.0+cpu"  # base.Dockerfile's TORCH_VERSION, the CPU build
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OFFICIAL_PYTHON = ("python", "3.11.11-slim-bookworm")


def standins_needed(engine: Engine) -> bool:
    """PBSD_STANDINS=1/0 decides; otherwise: can the engine pull the official Python image?"""
    if "PBSD_STANDINS" in os.environ:
        return os.environ["PBSD_STANDINS"] == "1"
    try:
        engine.client.images.pull(*OFFICIAL_PYTHON)
        return False
    except DockerException:
        return True


def standin_images() -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in (ROOT / "deploy/standin/images.env").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def build_settings(standins: bool) -> dict[str, str]:
    """The compose settings the builds and the base images take on this machine."""
    if not standins:
        return {}
    return {**standin_images(), "PIP_OPTIONS": "--no-index"}


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the base image installs "/src[data]"; setuptools builds the project from its source
    return ["setuptools>=77", *project["dependencies"], *project["optional-dependencies"]["data"]]


def fill_wheelhouse(engine: Engine, python_image: str) -> None:
    """deploy/docker/wheels/ with every wheel the CPU base image installs."""
    WHEELS.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(WHEELS), TORCH]
    if subprocess.run(pip, capture_output=True).returncode != 0:
        subprocess.run([*pip, "--extra-index-url", TORCH_CPU_INDEX], check=True, capture_output=True)
    script = (
        "python -m venv /tmp/venv && /tmp/venv/bin/pip download --quiet --disable-pip-version-check "
        '--no-cache-dir -d /wheels --find-links /wheels "$@"'
    )
    certs = Path("/etc/ssl/certs")
    env = {"PIP_CERT": str(certs / "ca-certificates.crt")} if (certs / "ca-certificates.crt").exists() else {}
    try:
        engine.client.containers.run(
            python_image,
            ["sh", "-c", script, "sh", TORCH, *_requirements()],
            network_mode="host",
            volumes={
                str(WHEELS): {"bind": "/wheels", "mode": "rw"},
                str(certs): {"bind": str(certs), "mode": "ro"},
            },
            environment=env,
            user=f"{os.getuid()}:{os.getgid()}",
            remove=True,
        )
    except DockerException as e:
        raise RuntimeError(f"filling {WHEELS} with {python_image}'s pip failed: {e}") from e
