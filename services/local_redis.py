"""A private ``redis-server`` on a free loopback port, for tests and one-machine runs.

Production points every service at a real Redis through ``REDIS_URL``; on one
machine (the demo, the test suite) the project starts its own server in a
temporary directory so that nothing else on the machine is touched and nothing is
left behind.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from services.launcher import die_with_parent

__all__ = ["LocalRedis", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalRedis:
    """Start with ``with LocalRedis() as r: r.url``; stopped and cleaned up on exit."""

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        persist: bool = False,
        workdir: Path | None = None,
        maxmemory: str | None = None,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError(
                "redis-server is not installed; run scripts/bootstrap.sh (it installs it from the OS packages)"
            )
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.password = password
        self.persist = persist
        self.maxmemory = maxmemory
        self._own_dir = workdir is None
        # absolute: redis-server changes into --dir before it opens --logfile, so a relative
        # workdir would put the log file under workdir/workdir and the server would not start
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pbsd-redis-")).absolute()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.persist:
            args += ["--appendonly", "yes", "--save", "60 1"]
        else:
            args += ["--appendonly", "no", "--save", ""]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    log = (
                        (self.workdir / "redis.log").read_text(errors="replace")
                        if (self.workdir / "redis.log").exists()
                        else ""
                    )
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err or log}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not answer on {self.host}:{self.port} within {timeout}s"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
