"""The container engine and the Compose implementation that `make test-deploy` drives.

Docker when its daemon answers (with `docker compose`); otherwise podman, through its
Docker-compatible API (`podman system service` on a private unix socket, stopped afterwards),
with podman-compose. Either way the harness speaks to the engine with the `docker` SDK.

Podman runs a container's health check from a systemd timer. On a host without systemd (a
container, a VM with another init) nothing runs them and every status stays "starting", so
:class:`HealthTicker` runs each container's own check at its own interval (`podman healthcheck
run`) for as long as the stack is up: the checks are the compose file's, only their clock is ours.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
from docker.errors import DockerException

__all__ = ["Engine", "HealthTicker", "start_engine"]


@dataclass
class Engine:
    name: str  # "docker" or "podman"
    client: docker.DockerClient
    compose: list[str]  # the Compose command, before its global options
    _service: subprocess.Popen | None = field(default=None, repr=False)

    def close(self) -> None:
        self.client.close()
        if self._service is not None:  # podman's API service: ours, stopped by its own id
            self._service.terminate()
            try:
                self._service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._service.kill()
                self._service.wait()

    def needs_health_ticker(self) -> bool:
        return self.name == "podman" and not Path("/run/systemd/system").exists()


def _docker() -> Engine | None:
    if os.environ.get("PBSD_ENGINE") == "podman":
        return None
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except DockerException:
        return None
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        client.close()
        raise RuntimeError("Docker answers but has no Compose plugin (`docker compose`)")
    return Engine("docker", client, ["docker", "compose"])


def _podman(workdir: Path) -> Engine:
    sock = workdir / "podman.sock"
    log = (workdir / "podman-service.log").open("ab")
    # --time=0: no idle timeout; the service lives exactly as long as this harness needs it
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            client = docker.DockerClient(base_url=f"unix://{sock}", timeout=600)
            client.ping()
            break
        except DockerException:
            if service.poll() is not None or time.monotonic() > deadline:
                service.kill()
                raise RuntimeError(
                    f"podman system service did not answer; see {workdir}/podman-service.log"
                ) from None
            time.sleep(0.5)
    compose = shutil.which("podman-compose", path=str(Path(sys.executable).parent)) or "podman-compose"
    return Engine("podman", client, [compose], service)


def start_engine(workdir: Path) -> Engine:
    """Docker if it works here, else podman (set up by scripts/deploy-setup.sh beforehand)."""
    return _docker() or _podman(workdir)


class HealthTicker:
    """Runs the health check of every running container of ``project`` at its interval."""

    def __init__(self, engine: Engine, project: str):
        self.engine, self.project = engine, project
        self._stop = threading.Event()
        self._due: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="health-ticker", daemon=True)

    def __enter__(self) -> HealthTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                containers = self.engine.client.containers.list(
                    filters={"label": f"com.docker.compose.project={self.project}"}
                )
            except DockerException:
                continue  # the engine is busy (a build, a restart): next second
            now = time.monotonic()
            for c in containers:
                check = (c.attrs.get("Config") or {}).get("Healthcheck") or {}
                if not check.get("Test") or now < self._due.get(c.id, 0.0):
                    continue
                interval = (check.get("Interval") or 30_000_000_000) / 1e9
                self._due[c.id] = now + interval
                # the check's own timeout bounds it; the exit status is recorded by podman
                subprocess.run(["podman", "healthcheck", "run", c.id], capture_output=True, timeout=120)
