"""Extractive reading: the passages of a page most relevant to a goal, no model needed.

Used by the offline backend (with the corpus's inverse document frequencies) and by
the web backend when no summariser LLM is configured (with a flat weight).
Passages are sentences, except that a sentence opening with a pronoun ("It is
headquartered in X.") stays attached to the one before, so what "It" is never gets lost.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["STOPWORDS", "Extraction", "IdfTable", "extract", "passages", "rank_passages", "terms"]

_WORD = re.compile(r"\w+", re.UNICODE)
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[])|\n+")
_CONTINUATION = re.compile(r"^(It|Its|He|She|They|Their|The species|This)\b")
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "for",
        "from",
        "has",
        "he",
        "her",
        "his",
        "in",
        "is",
        "it",
        "its",
        "of",
        "on",
        "or",
        "that",
        "the",
        "their",
        "they",
        "this",
        "to",
        "was",
        "were",
        "what",
        "which",
        "who",
        "whom",
        "with",
        "where",
        "when",
        "how",
        "did",
        "does",
        "do",
        "name",
    ]
)


def terms(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


# a page's "word" can be 60K letters long, and the cache keeps what it is given
_CACHED_WORD = 48


def stem(word: str) -> str:
    """A crude suffix stripper so "founded" matches "found" and "cities" matches "city"."""
    return _stem_cached(word) if len(word) <= _CACHED_WORD else _stem(word)


def _stem(word: str) -> str:
    if len(word) > 5 and word.endswith("ies"):
        return word[:-3] + "y"
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix) and not word.endswith("ss"):
            return word[: -len(suffix)]
    return word


_stem_cached = functools.lru_cache(maxsize=1 << 16)(_stem)  # snippets stem every word of every hit


def passages(text: str) -> list[str]:
    """The text's passages, in time linear in its length (a run of continuations is joined once)."""
    out: list[list[str]] = []
    for s in _SENTENCE.split(text):
        s = s.strip()
        if not s or s.startswith("See also:"):
            continue
        if out and _CONTINUATION.match(s):
            out[-1].append(s)
        else:
            out.append([s])
    return [" ".join(p) for p in out]


class IdfTable:
    """Inverse document frequencies of a corpus; unseen words weigh the most."""

    def __init__(self, documents: Iterable[str] = ()) -> None:
        df: Counter[str] = Counter()
        n = 0
        for text in documents:
            df.update({stem(w) for w in terms(text)})
            n += 1
        self.n = n
        self.idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self.unseen = math.log(1 + (n + 0.5) / 0.5) if n else 1.0

    def weight(self, stemmed: str) -> float:
        return self.idf.get(stemmed, self.unseen) if self.n else 1.0


@dataclass(frozen=True)
class Extraction:
    evidence: list[str]  # the chosen passages, in page order
    summary: str  # the single most relevant passage, or a note that nothing matched
    found: bool


def rank_passages(
    text: str, query: str, idf: IdfTable, *, limit: int, max_chars: int
) -> list[tuple[str, int]]:
    """Up to ``limit`` passages sharing words with ``query``, best first, as (passage, position)."""
    wanted = {stem(w) for w in terms(query)}
    if not wanted:
        return []
    scored = []
    items = passages(text)
    for i, p in enumerate(items):
        # fsum: exactly rounded whatever the set's order, which follows the strings' hashes (salted
        # per process), so equal word sets score equal and ties fall to page order
        score = math.fsum(idf.weight(w) for w in wanted.intersection(map(stem, terms(p))))
        if score > 0:
            scored.append((-score, i))
    scored.sort()
    chosen: list[tuple[str, int]] = []
    used = 0
    for _neg, i in scored[:limit]:
        if chosen and used + len(items[i]) > max_chars:
            break
        chosen.append((_cut(items[i], max_chars), i))
        used += len(items[i]) + 1
    return chosen


# A page's passage, which is what lies between two full stops, can be the page: a hostile page
# made each read 100,000 characters, cached for a week. The best passage is kept whole up to
# this many times the extraction's budget (the embedded world's longest is under 2x).
PASSAGE_BUDGETS = 4


def _cut(passage: str, max_chars: int) -> str:
    most = PASSAGE_BUDGETS * max_chars
    return passage if len(passage) <= most else passage[:most] + " …"


def extract(
    text: str, goal: str, idf: IdfTable, *, title: str = "", max_chars: int = 600, limit: int = 4
) -> Extraction:
    ranked = rank_passages(text, goal, idf, limit=limit, max_chars=max_chars)
    if not ranked:
        first = [_cut(p, max_chars) for p in passages(text)[:1]]
        return Extraction(
            first, f"The page {title or ''} does not mention what was asked.".replace("  ", " "), found=False
        )
    return Extraction([p for p, _ in sorted(ranked, key=lambda x: x[1])], ranked[0][0], found=True)
