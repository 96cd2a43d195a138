"""The services as processes on one Redis, as the slow fault tests start them: the tool gateway
on a world's corpus, and rollout workers of a name each (a pod each)."""

from __future__ import annotations

import time
from pathlib import Path

from services.launcher import ServiceProcess
from services.local_redis import free_port


def common_env(redis_url: str, prefix: str) -> dict[str, str]:
    """What every service of one test shares: its Redis, its streams' prefix, one thread."""
    return {
        "REDIS_URL": redis_url,
        "PBSD_STREAM_PREFIX": prefix,
        "PBSD_LOG_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
    }


def tools_process(common: dict[str, str], world: Path, logs: Path) -> ServiceProcess:
    return ServiceProcess(
        "tools",
        port=free_port(),
        log=logs / "tools.log",
        env={**common, "PBSD_TOOLS_CORPUS": str(world / "corpus.jsonl")},
    )


def rollout_process(
    common: dict[str, str], model: Path, tools: ServiceProcess, name: str, logs: Path, **env: str
) -> ServiceProcess:
    """A rollout worker named ``name`` on the in-process engine; ``env``: its other settings."""
    return ServiceProcess(
        "rollout",
        port=free_port(),
        log=logs / f"{name}.log",
        env={
            **common,
            "PBSD_ROLLOUT_MODEL": str(model),
            "PBSD_ROLLOUT_TOOLS_URL": tools.url,
            "PBSD_ROLLOUT_WORKER_NAME": name,
            **env,
        },
    )


def until(what: str, check, timeout: float = 300.0, every: float = 0.2):
    """``check()``'s first truthy value, polled every ``every`` seconds for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(every)
    return found
