"""Weights timelines: which ``(timeline, version)`` pairs name the weights a run trains on now.

Each opening of a run (its start, and every resume) draws a timeline nonce, and the trainer
announces every version as ``(timeline, version)`` (:class:`proto.messages.WeightsPublished`).
A resume from the checkpoint of version c, written in timeline W, descends from W's versions up
to c and from none of W's later ones: those were lost with the crash, and the resumed run trains
other weights under their numbers. A timeline opened after that checkpoint was written (and
gone before it wrote one) opened from the same checkpoint: of it, only version c holds. The
lineage of the timeline now open maps every earlier timeline of the run to the newest of its
versions that still holds::

    resume from a checkpoint (version c, written in W, whose lineage was L):
        lineage = L + {W: c} + {T: c for every other timeline opened since W opened}
    start, or resume without a checkpoint (the run begins again from its model):
        lineage = {T: 0 for every timeline opened before}

A group sampled under ``{timeline: newest version}`` (``TrajectoryGroup.policy_timelines``) was
sampled with weights the run still trains on when every entry is the timeline now open, or an
earlier one at a version its lineage keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["lineage", "lost_weights"]


def lineage(
    opened: Iterable[str], *, checkpoint: tuple[str, int, Mapping[str, int]] | None
) -> dict[str, int]:
    """The lineage of a timeline about to open. ``opened``: every timeline the run opened before;
    ``checkpoint``: the timeline that wrote the checkpoint it resumes from, that checkpoint's
    version and its lineage (None: no checkpoint)."""
    if checkpoint is None:
        return {t: 0 for t in opened}
    writer, version, saved = checkpoint
    out = dict(saved)
    for t in opened:
        out.setdefault(t, version)
    if writer:
        out[writer] = version
    return out


def lost_weights(
    policy_timelines: Mapping[str, int], *, current: str, lineage: Mapping[str, int]
) -> tuple[str, int] | None:
    """The first ``(timeline, version)`` a group was sampled with that the run no longer trains on
    (a version a resume discarded, or a timeline the run never had), or None."""
    for timeline, version in policy_timelines.items():
        if timeline == current:
            continue
        if version > lineage.get(timeline, -1):
            return timeline, version
    return None
