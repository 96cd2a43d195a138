"""A run's resumable state on disk: full checkpoints, the step records, the saved groups.

A full checkpoint ``runs/<id>/checkpoints/step-<n>/`` holds the model, the optimiser and
schedule state (``state.pt``), and ``trainer.json``: the :class:`TrainState` (with the
weights timeline it was written in), the data position, the ids of every trajectory trained
so far, and whether it was taken as the
trainer shut down (``interrupted``: nothing happened after it, so a resume from it has
nothing to redo; the opening that resumes from it clears the mark, since things happen after
it from then on). ``checkpoints/latest`` names the newest complete one.

Nothing a checkpoint or its pointer holds is ever rewritten in place. A checkpoint is written
whole into a fresh folder, flushed to disk and renamed into place; ``latest`` is replaced by a
rename too. A trainer killed at any moment (a rolling restart's grace period runs out during a
multi-GB write) leaves the last whole checkpoint and a pointer to it, or to the new one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from proto.base import encode
from proto.messages import ScoredGroup

log = logging.getLogger(__name__)

__all__ = [
    "TrainState",
    "flush_to_disk",
    "json_record",
    "keep_steps",
    "latest_checkpoint",
    "mark_resumed",
    "prompt_index",
    "read_checkpoint",
    "save_groups",
    "write_checkpoint",
    "write_records",
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


def _whole(path: Path) -> bool:
    """A checkpoint is whole once its ``trainer.json`` is in: it is written last."""
    return (path / "trainer.json").is_file() and (path / "state.pt").exists() and (path / "model").is_dir()


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``latest`` names; where the pointer is missing or names no whole checkpoint
    (a kill between the rename of a checkpoint and of its pointer, or a checkpoint an older pbsd
    was writing in place), the newest whole one, so that a run never quietly starts over from its
    base model while a checkpoint of it is on disk. None: there is no whole checkpoint."""
    folder = out / "checkpoints"
    pointer = folder / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if named and _whole(folder / named):
        return folder / named
    whole = sorted(p for p in folder.glob("step-*") if _whole(p))  # zero-padded: by step
    if whole:
        log.warning(
            "checkpoints/latest names %r, not a whole checkpoint: resuming from %s", named, whole[-1].name
        )
        return whole[-1]
    return None


def read_checkpoint(path: Path) -> tuple[TrainState, dict[str, Any]]:
    """The state and the whole ``trainer.json`` record of a checkpoint."""
    saved = json.loads((path / "trainer.json").read_text())
    return TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved}), saved


def write_checkpoint(
    path: Path,
    state: TrainState,
    *,
    next_index: int,
    trained_ids: list[str],
    interrupted: bool,
    save: Callable[[Path], None] | None,
    keep: int | None = None,
    announced: str | None = None,
) -> Path:
    """Checkpoint ``path`` (``checkpoints/step-<n>``), then ``latest`` to it. ``save(folder)``
    writes the model and ``state.pt`` into a fresh folder; ``trainer.json`` goes in last, the
    whole is flushed to disk and renamed to ``path`` (a folder of that name, from weights a crash
    discarded, is replaced). ``save`` None: ``path`` holds these very weights and optimiser state
    already (this opening wrote or loaded it, and took no step since), and only its
    ``trainer.json`` is replaced. ``keep``: then only the newest ``keep`` checkpoints stay (None:
    every one); older ones go only once ``latest`` names the new one, but for the one holding
    ``announced``, the copy the newest weights event names, which a receiver that restarts loads."""
    saved = {
        **asdict(state),
        "interrupted": interrupted,
        "next_index": next_index,
        "trained_ids": trained_ids,
    }
    if save is None:
        _replace(path / "trainer.json", json.dumps(saved))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        for left in [*path.parent.glob(".*.partial"), *path.parent.glob(".*.stale")]:
            shutil.rmtree(left, ignore_errors=True)  # what a kill left of an earlier write
        fresh = path.with_name(f".{path.name}.partial")
        fresh.mkdir()
        save(fresh)
        (fresh / "trainer.json").write_text(json.dumps(saved))
        _sync(fresh)
        if path.exists():  # latest never names it: this opening neither wrote nor loaded it
            path.rename(path.with_name(f".{path.name}.stale"))
        fresh.rename(path)
    _replace(path.parent / "latest", path.name)
    if keep is not None:
        # zero-padded: by step. One newer than this (a kill left it before latest named it) is
        # neither counted nor removed: this run writes that step again. Renamed stale first, out of
        # latest_checkpoint's sight, then removed with the others
        older = [p for p in sorted(path.parent.glob("step-*")) if p.name <= path.name]
        for old in older[:-keep]:
            if announced is None or not Path(announced).is_relative_to(old):
                old.rename(old.with_name(f".{old.name}.stale"))
    for stale in path.parent.glob(".*.stale"):  # only once latest names the new one
        shutil.rmtree(stale, ignore_errors=True)
    return path


def mark_resumed(path: Path, saved: dict[str, Any]) -> None:
    """Clear a clean shutdown's mark on the checkpoint a run resumes from (``saved``: its record, as
    :func:`read_checkpoint` read it): a crash after this opening must find steps it may have lost,
    not a checkpoint that nothing happened after."""
    if saved.get("interrupted"):
        _replace(path / "trainer.json", json.dumps({**saved, "interrupted": False}))


def _replace(path: Path, text: str | bytes) -> None:
    """``path`` now holds ``text``, or still what it held: a new file flushed, then renamed over it."""
    fresh = path.with_name(f".{path.name}.new")
    with fresh.open("wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(fresh, path)
    _sync_dir(path.parent)


def flush_to_disk(*paths: Path) -> None:
    """Flush files and folders (what is under them too) to disk; a path that is not there is passed
    over. What a checkpoint or a run's end counts on: a step's record before the checkpoint that a
    resume keeps that many records by, the final weights before the run is marked completed."""
    for path in paths:
        if path.is_dir():
            _sync(path)
        elif path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
            _sync_dir(path.parent)  # its entry too: the file may be new since the last flush


def _sync(folder: Path) -> None:
    """Flush every file under ``folder``, and the folders, to disk before the rename publishes them."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(root))
    _sync_dir(folder.parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_steps(path: Path, step: int) -> None:
    """Keep the records of a JSONL series (``metrics.jsonl``, ``evals.jsonl``) whose ``step`` is at
    most ``step``: a resume from that step's checkpoint records the steps after it again."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = [
            line for line in lines if (record := json_record(line)) is not None and record["step"] <= step
        ]
        if len(kept) < len(lines):  # rewritten whole: a crash now leaves the old file, not half of it
            _replace(path, "".join(kept))


def write_records(path: Path, records: list[dict]) -> None:
    """Make ``path`` the JSONL series ``records``, replaced whole (a crash leaves the old file)."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if not path.exists() or path.read_text() != text:
        _replace(path, text)


def json_record(line: str) -> dict | None:
    """A JSONL line's record; None for a blank line or one a crash tore mid-append (the file's last:
    the machine went down between the write and the flush), which would otherwise stop every
    resume of the run, or every read of its records, for good."""
    try:
        record = json.loads(line)
    except ValueError:
        if line.strip():
            log.warning("a torn JSONL record is dropped: %.80r", line)
        return None
    return record if isinstance(record, dict) else None


def save_groups(out: Path, step: int, groups: list[ScoredGroup]) -> None:
    """The scored groups of a step, for the report and the credit viewer (msgpack, one file a step)."""
    import msgpack

    (out / "groups").mkdir(parents=True, exist_ok=True)
    payload = msgpack.packb([encode(g) for g in groups], use_bin_type=True)
    # whole or not at all: a step file cut off by a crash fails every read of the run's groups
    _replace(out / "groups" / f"step-{step:06d}.msgpack", payload)
