"""Grounding: does the agent copy from what it has read, or make things up?

A search agent's actions should come from its context: a search query from the question or an
earlier result, a page address from an earlier result, the final answer from a page it read.
A weak policy (a small one early in training) gets the format right long before it does this; it
writes plausible names that appear nowhere. These counts measure that directly, per action, so
progress shows before accuracy moves:

- a search (a call with a ``q`` argument) is grounded when every name in its query (a word that
  starts with a capital letter or holds a digit: the part that can be made up; "painter" or
  "founded" are the agent's own words) appears in the question or in a tool result returned
  before the call;
- a read (a call with a ``url`` argument) is grounded when its URL appeared, whole, in an earlier
  result;
- an answer is grounded when its words appear, in order and next to each other, in some result
  (the question does not count: an answer copied from the question is not evidence).

Words are maximal runs of letters and digits, compared case-insensitively. The tool results are
the text the agent saw, so this works for any backend that returns text (the offline corpus,
Serper and Jina).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from agent.toolcall import parse_tool_call

__all__ = [
    "KINDS",
    "Grounding",
    "Verdict",
    "describe",
    "judge",
    "names",
    "ratio",
    "turn_verdicts",
    "urls",
    "words",
]

_WORD = re.compile(r"[^\W_]+")
# \b: a scheme starts a word, so a long run of letters is scanned once, not from every position; and
# at most 32 characters long, since "." "+" "-" start a word again: a run like "a.a.a..." was
# scanned to its end from each of its words (quadratic; seconds for a 60,000-character page)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s\"'<>()\[\]]+")


def words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


def names(text: str) -> set[str]:
    """The words of ``text`` that name something: capitalised, or with a digit (lower-cased)."""
    return {w.lower() for w in _WORD.findall(text) if w[0].isupper() or any(c.isdigit() for c in w)}


def urls(text: str) -> set[str]:
    """The addresses in ``text`` (JSON, markdown or plain), whole: a prefix of one is not one."""
    return {u.rstrip(".,;:") for u in _URL.findall(text)}


def _phrase(text: str) -> str:
    # its words, lower-cased, space-padded: "Rox" is not inside "Roxheim", "1773" is inside "in 1773."
    return " " + " ".join(_WORD.findall(text.lower())) + " "


# the kinds of action judged, in report order, with the words people read for one and for many
KINDS = {"queries": ("search", "searches"), "reads": ("read", "reads"), "answers": ("answer", "answers")}
Verdict = tuple[str, bool]  # (a key of KINDS, grounded)


def judge(
    question: str, turns: Iterable[tuple[str, str]], answer: str | None
) -> tuple[list[Verdict | None], Verdict | None]:
    """Per turn, the verdict on its search or read (None for a turn with neither), and the verdict
    on the trajectory's boxed answer (None without one). ``turns`` as in :meth:`Grounding.add`."""
    seen, links, results, verdicts = words(question), set(), [], []
    for text, result in turns:
        call = parse_tool_call(text).call  # a message that makes several calls is judged by its first
        verdict = None
        if call is not None:
            query, url = call.arguments.get("q"), call.arguments.get("url")
            if isinstance(query, str):
                verdict = ("queries", bool(query.strip()) and names(query) <= seen)
            elif isinstance(url, str):
                verdict = ("reads", bool(url.strip()) and url.strip() in links)
        verdicts.append(verdict)
        if result:
            results.append(result)
            seen |= words(result)
            links |= urls(result)
    answered = None
    if answer is not None and answer.strip():
        said = _phrase(answer)
        answered = ("answers", bool(said.strip()) and any(said in _phrase(r) for r in results))
    return verdicts, answered


def turn_verdicts(question: str, turns: list[tuple[str, str]], answer: str | None) -> list[Verdict | None]:
    """One verdict per turn: its search or read, or, for the last turn when it calls no tool, the
    boxed answer it writes (the one action class of every turn, as the credit viewer, the report
    and the scorer's sanity figures label turns)."""
    verdicts, answered = judge(question, turns, answer)
    if verdicts and verdicts[-1] is None:
        verdicts[-1] = answered
    return verdicts


class Grounding:
    """Grounded / total counts per kind over any number of trajectories (:meth:`add` each one)."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.grounded: Counter[str] = Counter()

    def add(
        self,
        question: str,
        turns: Iterable[tuple[str, str]],
        answer: str | None,
    ) -> None:
        """One trajectory: ``turns`` are (what the assistant wrote, the tool result that followed it
        or ""), in order; ``answer`` the boxed answer, if any."""
        per_turn, answered = judge(question, turns, answer)
        for verdict in [*per_turn, answered]:
            if verdict is not None:
                kind, grounded = verdict
                self.total[kind] += 1
                self.grounded[kind] += grounded

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            kind: {
                "total": self.total[kind],
                "grounded": self.grounded[kind],
                "fraction": self.grounded[kind] / self.total[kind] if self.total[kind] else 0.0,
            }
            for kind in KINDS
        }


def ratio(part: dict[str, float]) -> str:
    """``grounded/total`` of one kind of :meth:`Grounding.summary`."""
    return f"{int(part['grounded'])}/{int(part['total'])}"


def describe(summary: dict[str, dict[str, float]]) -> str:
    """One line for people: ``grounded searches 28/85, reads 13/49, answers 4/6``."""
    return "grounded " + ", ".join(f"{many} {ratio(summary[k])}" for k, (_, many) in KINDS.items())
