"""Where a run's DeepSpeed config would make the trainer write: refused in a spec.

DeepSpeed writes where its config says: the flops profiler's ``output_file`` (opened for writing,
truncating what is there), the monitors' ``output_path`` and the ``job_name`` under it, NVMe
offload's ``nvme_path``, autotuning's ``results_dir``, Nebula's ``persistent_storage_path``. A spec
comes from a client of the REST API, and the trainer writes only under its runs folder, so a config
that names a file or folder is refused, inline (at submission) or as a file (at submission and
again as the run opens). The trainer's own metrics (Prometheus, ``metrics.jsonl``) stand in for
DeepSpeed's monitors.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["file_keys"]

# a key that names a file or folder: output_file, output_path, nvme_path, results_dir, ...
_FILE_KEY = re.compile(r"(path|paths|file|files|dir|dirs|directory|folder)$", re.IGNORECASE)


def file_keys(config: Any) -> list[str]:
    """The dotted keys of ``config`` whose value names a file or folder: a key named so (``*_path``,
    ``*_file``, ``*_dir``, ``*_folder``) that is not empty, or any string that holds a path
    separator or is ``..`` (a ``job_name`` joined under a path). Iterative: depth is checked apart."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str):
            named = _FILE_KEY.search(key.rsplit(".", 1)[-1]) is not None and value.strip() != ""
            if named or "/" in value or "\\" in value or value.strip() == "..":
                found.append(key)
        elif value is not None and not isinstance(value, (bool, int, float)):
            found.append(key)  # nothing a JSON config holds
    return sorted(found)
