"""Driving ``wrk`` (Debian's ``wrk`` package) from the benchmarks: a C load generator with one
event-loop thread, light enough that on 2 cores the server, not the client, sets the figure
(the Python client it replaces managed 197 calls/s against a bare endpoint that answers
2,000).

Each run uses one wrk thread (``-t1``), so a list of request bodies is sent in order and
each body at most once while fewer requests than bodies are sent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Load", "require_wrk", "start_wrk"]

# Bodies, one per line, sent in order; the summary as one JSON line (latencies in microseconds).
_SCRIPT = """
local bodies, i = {}, 0
local pace = 0
init = function(args)
  pace = tonumber(args[2] or "0")
  if args[1] and args[1] ~= "-" then
    wrk.method = "POST"
    wrk.headers["Content-Type"] = "application/json"
    for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
  end
end
delay = function()
  return pace
end
request = function()
  if #bodies == 0 then return wrk.request() end
  i = i + 1
  if i > #bodies then i = 1 end
  return wrk.format(nil, nil, nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "non_2xx": %d, "socket_errors": %d, "timeouts": %d, '
    .. '"p50_us": %d, "p99_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True)
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx answers, socket errors and timeouts

    @property
    def rate(self) -> float:
        return self.requests / self.seconds


def require_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: `apt-get install -y wrk` (Debian) and run again")
    return path


class _Run:
    def __init__(self, process: subprocess.Popen, workdir: tempfile.TemporaryDirectory) -> None:
        self.process = process
        self.workdir = workdir

    def result(self) -> Load:
        out, err = self.process.communicate(timeout=120)
        self.workdir.cleanup()
        if self.process.returncode != 0:
            raise RuntimeError(f"wrk failed ({self.process.returncode}): {err.strip() or out.strip()}")
        summary = json.loads(out.strip().splitlines()[-1])
        return Load(
            requests=summary["requests"],
            seconds=summary["duration_us"] / 1e6,
            p50_ms=summary["p50_us"] / 1000,
            p99_ms=summary["p99_us"] / 1000,
            errors=summary["non_2xx"] + summary["socket_errors"] + summary["timeouts"],
        )


def start_wrk(
    url: str,
    *,
    connections: int,
    seconds: int,
    bodies: list[str] | None = None,
    pace_ms: int = 0,
    timeout_s: int = 10,
) -> _Run:
    """wrk against ``url`` in the background (POST each of ``bodies`` in turn, else GET), each
    connection waiting ``pace_ms`` between an answer and its next request (a probe, not load);
    ``.result()`` waits for it. Several can run at once against one server."""
    workdir = tempfile.TemporaryDirectory(prefix="pbsd-wrk-")
    script = Path(workdir.name) / "bench.lua"
    script.write_text(_SCRIPT)
    args = [
        require_wrk(),
        "-t1",
        f"-c{connections}",
        f"-d{seconds}s",
        f"--timeout={timeout_s}s",
        "-s",
        str(script),
    ]
    args.append(url)
    path = "-"
    if bodies:
        path = Path(workdir.name) / "bodies.txt"
        path.write_text("\n".join(bodies) + "\n")
    args += ["--", str(path), str(pace_ms)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _Run(process, workdir)
