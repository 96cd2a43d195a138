"""The tag a weights receiver is told its weights carry: SGLang's ``weight_version``, a free
string that every answer and ``/model_info`` repeat, written ``<version>@<timeline>``.

The version alone does not name weights. A run resumed from a checkpoint numbers its versions
again from the checkpoint's, with other weights, under a new timeline
(:mod:`services.trainer.timelines`): a server left out of the weight group that still held an
abandoned timeline's version, numbered at or past the new timeline's, passed for current by
its number and sampled with the lost weights under the new timeline's name. With the timeline
in the tag it is told apart and loads the disk copy.

A tag that is a bare number (a publisher that names no timeline, or a receiver that reports
only its number: our own, whose worker keeps the timeline itself) names no timeline; SGLang's
``"default"`` names the weights the server started with."""

from __future__ import annotations

__all__ = ["read_tag", "same_timeline", "same_weights", "weights_tag"]


def weights_tag(version: int, timeline: str = "") -> str:
    """What a receiver is told it serves: ``version`` of ``timeline`` (the bare number without one)."""
    return f"{version}@{timeline}" if timeline else str(version)


def read_tag(tag: object) -> tuple[int, str] | None:
    """``(version, timeline)`` of a tag (timeline "" for a bare number); None for no tag or one
    that names no version of ours (``"default"``)."""
    if tag is None:
        return None
    number, _, timeline = str(tag).partition("@")
    return (int(number), timeline) if number.isascii() and number.isdigit() else None


def same_weights(tag: object, version: int, timeline: str) -> bool:
    """Whether ``tag`` names ``version`` of ``timeline``: a tag that names no timeline is judged by
    its number (a receiver that keeps its timeline elsewhere reports only that)."""
    read = read_tag(tag)
    return read is not None and read[0] == version and same_timeline(read, timeline)


def same_timeline(read: tuple[int, str], timeline: str) -> bool:
    """Whether a read tag is of ``timeline``, or names none: our receivers report the bare number,
    and a trainer older than the tags sent bare numbers, which the rest must follow through a
    rolling upgrade (workers first, the trainer last: docs/weights.md)."""
    return read[1] in ("", timeline)
