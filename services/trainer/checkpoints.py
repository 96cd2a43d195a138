"""A run's resumable state on disk: full checkpoints, the step records, the saved groups.

A full checkpoint ``runs/<id>/checkpoints/step-<n>/`` holds the model, the optimiser and
schedule state (``state.pt``), and ``trainer.json``: the :class:`TrainState` (with the
weights timeline it was written in), the data position, the ids of every trajectory trained
so far, and whether it was taken as the
trainer shut down (``interrupted``: nothing happened after it, so a resume from it has
nothing to redo). ``checkpoints/latest`` names the newest complete one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from proto.base import encode
from proto.messages import ScoredGroup

__all__ = [
    "TrainState",
    "latest_checkpoint",
    "prompt_index",
    "read_checkpoint",
    "save_groups",
    "truncate_lines",
    "write_checkpoint",
]


@dataclass
class TrainState:
    step: int = 0
    version: int = 0
    next_index: int = 0
    dropped: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    # prompts trained on: step x prompts_per_step, but for a last, smaller batch at the end of the
    # data (None in a checkpoint that does not record it: every step of such a run is whole)
    trained_prompts: int | None = None
    dropped_indices: list[int] = field(default_factory=list)  # the prompts of the groups dropped
    # the weights timeline this state was reached in, and its lineage (services.trainer.timelines)
    timeline: str = ""
    lineage: dict[str, int] = field(default_factory=dict)

    def prompts_trained(self, prompts_per_step: int) -> int:
        return self.trained_prompts if self.trained_prompts is not None else self.step * prompts_per_step


def prompt_index(task_or_trajectory_id: str) -> int | None:
    """The prompt index in ``{run_id}:{index}`` or ``{run_id}:{index}/{sample}`` (controller ids);
    None for an id the controller did not make."""
    try:
        index = int(task_or_trajectory_id.rsplit(":", 1)[1].split("/", 1)[0])
    except (IndexError, ValueError):
        return None
    return index if index >= 0 else None  # a negative one would be read as a place in the data


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    return path if (path / "state.pt").exists() else None


def read_checkpoint(path: Path) -> tuple[TrainState, dict[str, Any]]:
    """The state and the whole ``trainer.json`` record of a checkpoint."""
    saved = json.loads((path / "trainer.json").read_text())
    return TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved}), saved


def write_checkpoint(
    path: Path, state: TrainState, *, next_index: int, trained_ids: list[str], interrupted: bool
) -> None:
    """``trainer.json`` beside the model and ``state.pt`` the caller saved, then ``latest`` to it:
    the pointer moves only once the checkpoint is whole."""
    saved = {
        **asdict(state),
        "interrupted": interrupted,
        "next_index": next_index,
        "trained_ids": trained_ids,
    }
    (path / "trainer.json").write_text(json.dumps(saved))
    (path.parent / "latest").write_text(path.name)


def truncate_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of a JSONL file (the step records a resume keeps)."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        if len(lines) > keep:
            path.write_text("".join(lines[:keep]))


def save_groups(out: Path, step: int, groups: list[ScoredGroup]) -> None:
    """The scored groups of a step, for the report and the credit viewer (msgpack, one file a step)."""
    import msgpack

    (out / "groups").mkdir(parents=True, exist_ok=True)
    payload = msgpack.packb([encode(g) for g in groups], use_bin_type=True)
    (out / "groups" / f"step-{step:06d}.msgpack").write_bytes(payload)
