"""Conversations in the teacher's format for ``pbsd sft``: the warm start of a teacher that reads x*.

A PBSD teacher is the policy itself, prompted with x*: the question rewritten by a teacher template
(:mod:`agent.privileged`) that states the verified answer and, with ``{support}``, the facts it
rests on. A pretrained LLM reads such a note; a small model trained from scratch has never seen
one, and its teacher lowers everything after x* a little and favours nothing. ``pbsd sft
--teacher-format NAME:FRACTION`` therefore also lays that share of the conversations out after x*,
id for id as the scorer builds it.

That alone teaches the format, not the note's use: in an oracle trajectory every name the assistant
writes is already in the context (the search result or page it just read), so nothing is left
for the note to explain and the loss does not ask the model to look at it. ``teacher_contradict``
asks: that share of the teacher-format copies has every tool result name a decoy in place of the
answer (another answer of the data, of the same kind: a name for a name, a year for a year). The
note is then the only place that states the answer, and the assistant's turns, which name the
answer as the oracle wrote them, are learnable only by reading it. The assistant's turns are
never changed, and the student's format never sees a contradicted conversation, so the policy
does not learn to disregard what it reads.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from agent.chat import ChatTokenizer
from agent.privileged import teacher_prompt_ids
from proto.templates import TEACHER_TEMPLATES

__all__ = [
    "TeacherCopies",
    "contradict",
    "decoy_pools",
    "parse_teacher_formats",
    "pick_decoy",
    "swap_words",
    "teacher_format",
]


def parse_teacher_formats(options: list[str]) -> tuple[tuple[str, float], ...]:
    """``NAME:FRACTION`` (``pbsd sft --teacher-format``; NAME one of ``proto.templates.TEACHER_TEMPLATES``,
    FRACTION 1 when left out) as ``SftConfig.teacher_formats``; ValueError names a bad one."""
    out = []
    for option in options:
        name, _, fraction = option.partition(":")
        if name not in TEACHER_TEMPLATES:
            raise ValueError(f"teacher format {option!r}: the name is one of {sorted(TEACHER_TEMPLATES)}")
        try:
            out.append((TEACHER_TEMPLATES[name], float(fraction or 1)))
        except ValueError:
            raise ValueError(f"teacher format {option!r}: the fraction is a number in (0, 1]") from None
    return tuple(out)


def teacher_format(
    tok: ChatTokenizer, row: dict, ids: list[int], mask: list[int], template: str
) -> tuple[list[int], list[int]]:
    """A conversation's (ids, mask) with its prompt replaced by x*, built exactly as the scorer
    builds it for the teacher pass; what follows the prompt is unchanged, id for id."""
    messages = row["messages"]
    prompt = len(tok.prompt_ids(messages[0]["content"], messages[1]["content"]))
    privileged = teacher_prompt_ids(tok, ids[:prompt], row["answer"], template, row.get("support", ()))
    return privileged + ids[prompt:], [0] * len(privileged) + mask[prompt:]


def decoy_pools(rows: list[dict]) -> dict[bool, list[str]]:
    """The answers of ``rows`` a decoy is drawn from (:func:`kind_pools`)."""
    return kind_pools(r["answer"] for r in rows)


def kind_pools(names: Iterable[str]) -> dict[bool, list[str]]:
    """``names`` by kind (a year for a year, a name for a name: keyed by ``name.isdigit()``), each
    sorted so that a seeded draw is the same run after run."""
    unique = sorted(set(names))
    return {kind: [a for a in unique if a.isdigit() == kind] for kind in (True, False)}


def pick_decoy(pools: dict[bool, list[str]], answer: str, rng: random.Random) -> str | None:
    """A decoy for ``answer`` drawn from ``pools`` (:func:`decoy_pools`) with ``rng``: another answer
    of its kind; None, and no draw, when there is none."""
    others = [a for a in pools[answer.isdigit()] if a != answer]
    return rng.choice(others) if others else None


def contradict(row: dict, decoy: str, hops: Mapping[str, str] | None = None) -> dict | None:
    """``row`` with ``decoy`` in place of its answer, and each of ``hops``'s decoys in place of its
    name (the hop entities, for a teacher taught to read the note's supporting facts), as whole words
    in every tool result (the user messages after the question); None when no tool result names the
    answer."""
    swaps = {**(hops or {}), row["answer"]: decoy}
    messages, changed = list(row["messages"][:2]), 0
    for message in row["messages"][2:]:
        if message["role"] == "user":
            content, counts = swap_words(message["content"], swaps)
            message, changed = {**message, "content": content}, changed + counts[row["answer"]]
        messages.append(message)
    return {**row, "messages": messages} if changed else None


def swap_words(text: str, swaps: Mapping[str, str]) -> tuple[str, Counter]:
    """``text`` with each key of ``swaps`` replaced by its value as a whole word, and how many times
    each was. One pass, the longest name tried first, so that a replacement is never replaced again."""
    names = sorted(swaps, key=len, reverse=True)
    pattern = re.compile("|".join(rf"(?<!\w){re.escape(n)}(?!\w)" for n in names))
    counts: Counter = Counter()

    def swap(match: re.Match) -> str:
        counts[match.group(0)] += 1
        return swaps[match.group(0)]

    return pattern.sub(swap, text), counts


class TeacherCopies:
    """Which teacher-format copies each conversation gets: one per format drawn with its fraction,
    contradicted with probability ``contradict_frac``. Seeded: the same rows, settings and seed
    give the same copies."""

    def __init__(
        self, formats: tuple[tuple[str, float], ...], contradict_frac: float, rows: list[dict], seed: int
    ) -> None:
        self.formats = formats
        self.contradict_frac = contradict_frac
        self.draws = random.Random(f"pbsd-sft-teacher-formats-{seed}")
        self.picks = random.Random(f"pbsd-sft-decoys-{seed}")  # apart: a pick moves no draw
        # only contradicted copies take decoys, and only teacher formats need each row's answer
        self.decoys = decoy_pools(rows) if formats and contradict_frac else {}

    def draw(self, row: dict) -> Iterator[tuple[int, dict]]:
        """(format index, the row to lay out after that format's x*) for each copy ``row`` gets."""
        for f, (_, fraction) in enumerate(self.formats):
            # both draws are made for every format of every conversation, so that one setting's
            # choice moves no other's
            drawn, contradicted = self.draws.random() < fraction, self.draws.random() < self.contradict_frac
            if not drawn:
                continue
            copy = row
            if contradicted:
                decoy = pick_decoy(self.decoys, row["answer"], self.picks)
                copy = (contradict(row, decoy) if decoy is not None else None) or row
            yield f, copy
