r"""The rule-based verifier: final-answer extraction, normalised exact match, token F1.

The agent's final answer is the content of the last ``\boxed{...}`` in its last
message (nested braces handled). Answers are compared after normalisation:
Unicode folded to ASCII where possible, lower case, LaTeX text wrappers removed,
punctuation dropped, the articles a/an/the dropped, acronym dots removed ("U.S.A." = "USA"), digit group separators removed
("1,000" = "1000"), trailing ".0" dropped, and number words up to twenty turned into
digits. The reward is 1 when the normalised prediction equals the normalised answer
or one of its aliases, else 0. Token F1 (SQuAD-style, best over answer and aliases)
is reported alongside as a softer diagnostic.

A text *mentions* the answer when the normalised answer (or an alias) appears in the normalised
text as a run of whole words: ``"... \boxed{The Danube} ..."`` mentions "Danube", "Danubes"
does not. The scorer's sanity figures use it to tell turns that contain the answer from turns
that do not.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Verdict", "boxes", "exact_match", "extract_boxed", "mentions", "normalize", "token_f1", "verify"]

_BOXED = re.compile(r"\\boxed\s*\{")
_LATEX_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|textit|mathbf|operatorname)\s*\{([^{}]*)\}")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ACRONYM = re.compile(r"(?<!\w)(?:[A-Za-z]\.){2,}")
_DIGIT_GROUPS = re.compile(r"(?<=\d)[,\u00a0 ](?=\d{3}\b)")
_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}


def boxes(text: str) -> list[tuple[int, int, int]]:
    r"""Every ``\boxed{...}`` that closes, as (where ``\boxed`` starts, where its content starts, where
    its closing brace is), in the order they close; braces nest, and ``\{`` and ``\}`` are no braces.

    One pass with a stack of open braces, from the first box on: scanning from every ``\boxed{`` to
    its close took time quadratic in the number of boxes left open (a degenerate final message of
    thousands of them held the rollout's event loop for seconds)."""
    starts = {m.end() - 1: m.start() for m in _BOXED.finditer(text)}  # a box's "{" -> its "\boxed"
    found: list[tuple[int, int, int]] = []
    stack: list[int] = []  # positions of the braces still open
    i = min(starts, default=len(text))
    while i < len(text):
        ch = text[i]
        if ch == "\\" and text[i + 1 : i + 2] in ("{", "}"):
            i += 2
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack and (opened := stack.pop()) in starts:
            found.append((starts[opened], opened + 1, i))
        i += 1
    return found


def extract_boxed(text: str | None) -> str | None:
    r"""Content of the last ``\boxed{...}`` (the one that starts last) that closes, with nested braces;
    None if there is none or it never closes."""
    closed = boxes(text) if text else []
    if not closed:
        return None
    _, start, close = max(closed, key=lambda b: b[1])
    return text[start:close].strip()


def normalize(text: str) -> str:
    s = unicodedata.normalize("NFKD", text)
    s = "".join(ch for ch in s if not unicodedata.combining(ch))
    for _ in range(3):  # \text{\textbf{x}}
        s = _LATEX_WRAPPER.sub(r"\1", s)
    s = s.replace("\\{", "{").replace("\\}", "}").replace("\\", " ")
    s = _ACRONYM.sub(
        lambda m: m.group(0).replace(".", ""), s
    )  # U.S.A. -> USA, before "a" reads as an article
    s = s.lower()
    s = _DIGIT_GROUPS.sub("", s)
    s = re.sub(r"(?<=\d)\.0+\b", "", s)  # 3.0 -> 3, 12.50 stays 12.50
    s = re.sub(r"(?<!\d)\.(?!\d)|[^\w\s.]", " ", s)  # punctuation, but keep decimal points
    s = _ARTICLES.sub(" ", s)
    words = [_NUMBER_WORDS.get(w, w) for w in s.split()]
    return " ".join(words)


def _golds(answer: str, aliases: Iterable[str]) -> list[str]:
    return [answer, *[a for a in aliases if a]]


def exact_match(prediction: str | None, answer: str, aliases: Iterable[str] = ()) -> bool:
    if prediction is None:
        return False
    p = normalize(prediction)
    return bool(p) and any(p == normalize(g) for g in _golds(answer, aliases))


def mentions(text: str, answer: str, aliases: Iterable[str] = ()) -> bool:
    """Whether normalised ``text`` holds the normalised answer or an alias as whole words (an answer
    that normalises to nothing, such as "The", is mentioned by nothing)."""
    padded = f" {normalize(text)} "
    return any(g and f" {g} " in padded for g in (normalize(x) for x in _golds(answer, aliases)))


def token_f1(prediction: str | None, answer: str, aliases: Iterable[str] = ()) -> float:
    if prediction is None:
        return 0.0
    pred = normalize(prediction).split()
    best = 0.0
    for g in _golds(answer, aliases):
        gold = normalize(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True)
class Verdict:
    extracted: str | None
    correct: bool
    f1: float

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


def verify(response: str | None, answer: str, aliases: Iterable[str] = ()) -> Verdict:
    """Grade the agent's final message against the verified answer and its aliases."""
    aliases = tuple(aliases)
    extracted = extract_boxed(response)
    return Verdict(extracted, exact_match(extracted, answer, aliases), token_f1(extracted, answer, aliases))
