"""A run's saved scored groups (``--save-groups``: ``groups/step-NNNNNN.msgpack``, one file a step),
read whole or a step file at a time.

The credit viewer pages a run of any length: :func:`index_groups` reads every file once, one at a
time, and keeps of each group only its place, its size and what the page's sanity figures sum
(:class:`GroupIndex`); :func:`shown_indices` picks the groups a page holds from their sizes; and
:meth:`GroupIndex.load` decodes those alone. A long run's groups never sit in memory together.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from proto.base import decode
from proto.messages import ScoredGroup
from proto.runs import PbsdSpec
from proto.sanity import NoiseFloor, TeacherSanity

__all__ = [
    "GroupIndex",
    "GroupsChanged",
    "UnreadableGroups",
    "index_groups",
    "iter_groups",
    "load_groups",
    "shown_groups",
    "shown_indices",
    "signature",
    "step_files",
]


def step_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, file) of every step whose groups were saved, in step order."""
    return [(int(p.stem.split("-")[1]), p) for p in sorted((Path(run_dir) / "groups").glob("step-*.msgpack"))]


def signature(run_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """What the saved groups are made of: each step file's name, size and modification time. A
    page made of the same signature is the same page."""
    return tuple((p.name, *_stat(p)) for _, p in step_files(run_dir))


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


class GroupsChanged(RuntimeError):
    """A step file changed between the index and the load (a resumed run writes its steps again)."""


class UnreadableGroups(ValueError):
    """A step file that is not a list of saved scored groups (cut off, or another file)."""


def _read(path: Path) -> list[ScoredGroup]:
    try:
        return [decode(ScoredGroup, raw) for raw in msgpack.unpackb(path.read_bytes(), raw=False)]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # ValueError: pydantic's too
        raise UnreadableGroups(f"{path}: not a step's saved scored groups ({type(exc).__name__})") from None


def load_groups(run_dir: Path) -> list[tuple[int, ScoredGroup]]:
    """(step, scored group) for every group the trainer saved, in step order."""
    return list(iter_groups(run_dir))


def iter_groups(run_dir: Path) -> Iterator[tuple[int, ScoredGroup]]:
    """The same, a step file at a time: what a pass over a long run holds is one step's groups."""
    for step, path in step_files(run_dir):
        for g in _read(path):
            yield step, g


@dataclass
class GroupIndex:
    """Every group's place and size, and the sums of the scored ones' sanity figures: of a run's
    step files (:func:`index_groups`), or of groups in memory (:meth:`of`)."""

    places: list[tuple[int, Path | None, int]] = field(default_factory=list)  # step, file, index in it
    stats: dict[Path, tuple[int, int]] = field(default_factory=dict)  # each file's size and mtime, as read
    sizes: list[int] = field(default_factory=list)  # trajectories of each group
    scored: int = 0  # groups with evidence
    sanity: TeacherSanity = field(default_factory=TeacherSanity)
    noise: NoiseFloor = field(default_factory=NoiseFloor)
    turns: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # scored groups' (s, tokens)
    pbsd_specs: int = 0  # scored groups under PBSD, and how many of them kept a deadband
    with_deadband: int = 0

    @classmethod
    def of(cls, groups: list[tuple[int, ScoredGroup]]) -> GroupIndex:
        index = cls()
        for i, (step, g) in enumerate(groups):
            index.add(step, None, i, g)
        return index

    @property
    def bare(self) -> bool:
        """Every PBSD group scored without a deadband (eps+ = eps- = 0): the null pass's share of
        turns "outside the deadband" then reads as a floor far above a run's with the paper's."""
        return self.pbsd_specs > 0 and self.with_deadband == 0

    def shown(self, limit: int) -> list[int]:
        """:func:`shown_indices` of the indexed groups."""
        return shown_indices([(p[0], n) for p, n in zip(self.places, self.sizes, strict=True)], limit)

    def add(self, step: int, path: Path | None, index: int, g: ScoredGroup) -> None:
        self.places.append((step, path, index))
        self.sizes.append(len(g.group.trajectories))
        if not g.scored:
            return
        self.scored += 1
        self.sanity += g.diagnostics.sanity
        self.noise += g.diagnostics.noise
        self.turns.append(g.scored_turns())  # a float per turn: small beside the groups
        if isinstance(g.group.algorithm, PbsdSpec):
            self.pbsd_specs += 1
            self.with_deadband += bool(g.group.algorithm.deadband)

    def step_totals(self) -> dict[int, int]:
        """Trajectories a step had, over all its saved groups."""
        totals: dict[int, int] = {}
        for (step, _, _), size in zip(self.places, self.sizes, strict=True):
            totals[step] = totals.get(step, 0) + size
        return totals

    def load(self, indices: list[int]) -> list[tuple[int, ScoredGroup]]:
        """The indexed files' groups at ``indices`` (in their order), decoding only the files that
        hold them; :class:`GroupsChanged` when one of those files changed since it was indexed."""
        wanted: dict[Path, list[int]] = {}
        for i in indices:
            wanted.setdefault(self.places[i][1], []).append(i)
        found: dict[int, ScoredGroup] = {}
        for path, among in wanted.items():
            try:
                if _stat(path) != self.stats[path]:
                    raise GroupsChanged(path)
                groups = _read(path)
                for i in among:
                    found[i] = groups[self.places[i][2]]
            except (FileNotFoundError, IndexError) as exc:
                raise GroupsChanged(path) from exc
        return [(self.places[i][0], found[i]) for i in indices]


def index_groups(run_dir: Path) -> GroupIndex:
    """The index of a run's saved groups, read a step file at a time."""
    index = GroupIndex()
    for step, path in step_files(run_dir):
        index.stats[path] = _stat(path)  # before the read: a write after it shows as a change
        for i, g in enumerate(_read(path)):
            index.add(step, path, i, g)
    return index


def shown_indices(sizes: list[tuple[int, int]], limit: int) -> list[int]:
    """Which of the groups, given as (step, trajectories), a page of about ``limit`` trajectories
    holds: all of them when they fit; else every step's first groups, whole (a group's samples are
    compared with each other), up to the step's equal share of ``limit`` and at least one; where
    even one group a step does not fit, that for evenly spaced steps, the first and the last
    among them."""
    if sum(n for _, n in sizes) <= limit:
        return list(range(len(sizes)))
    by_step: dict[int, list[int]] = {}
    for i, (step, _) in enumerate(sizes):
        by_step.setdefault(step, []).append(i)
    steps = sorted(by_step)
    mean_size = sum(sizes[ids[0]][1] for ids in by_step.values()) / len(steps)
    if len(steps) * mean_size > limit:
        keep = max(1, int(limit // mean_size))
        steps = sorted({steps[round(i)] for i in np.linspace(0, len(steps) - 1, keep)})
    share = limit / len(steps)
    picked: list[int] = []
    for step in steps:
        taken = 0
        for i in by_step[step]:
            if taken and taken + sizes[i][1] > share:
                break
            picked.append(i)
            taken += sizes[i][1]
    return picked


def shown_groups(groups: list[tuple[int, ScoredGroup]], limit: int) -> list[tuple[int, ScoredGroup]]:
    """:func:`shown_indices` of groups already in memory."""
    return [groups[i] for i in shown_indices([(s, len(g.group.trajectories)) for s, g in groups], limit)]
