"""Starting the services as separate processes on one machine, exactly as in production
(``pbsd serve <name>``), waiting until they answer ``/health``, and stopping them cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

__all__ = ["ServiceProcess", "die_with_parent", "sigterm_as_interrupt"]


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt inside the block, as Ctrl-C does. Python's default for
    SIGTERM is to die on the spot, skipping every ``finally``: the services would then only learn
    of it through ``die_with_parent`` after Redis had gone, and a trainer mid-step would ride the
    outage for its whole shutdown grace. (The main thread only; elsewhere signals cannot be set.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies. A service runs in its own
    session so that stopping it reaches its whole group; that also means nobody stops it if the
    parent is killed outright (SIGKILL, a CI timeout) rather than exiting through its clean-up."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServiceProcess:
    """``pbsd serve <name>`` in its own process group, with its output in ``log``."""

    def __init__(self, name: str, *, port: int, env: dict[str, str], log: Path | None = None) -> None:
        self.name = name
        self.port = port
        self.env = {**os.environ, **env}
        self.log = log
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        out = subprocess.DEVNULL
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = self.log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pbsd.cli", "serve", self.name, "--port", str(self.port)],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return self

    def check_alive(self) -> None:
        """Raise if the process has exited (pointing at its log)."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with code {self.process.returncode if self.process else '?'}"
                + (f"; see {self.log}" if self.log else "")
            )

    def cpu_seconds(self) -> float | None:
        """CPU time the process has used so far (user and system, its threads and its reaped
        children), from ``/proc``; None off Linux or once it has gone. On a machine shared with
        other jobs this, unlike wall time, measures the service's own work."""
        if self.process is None:
            return None
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return None
        # fields 14-17 (utime, stime, cutime, cstime), counted after the parenthesised command name
        fields = stat.rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become healthy within {timeout:.0f}s")
            time.sleep(0.2)

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> ServiceProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
