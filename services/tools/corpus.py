"""The offline corpus: full-text search, reading by URL and goal-directed extraction over a
local corpus (the generated world, or any JSONL of ``{url, title, text}`` documents).

Search is BM25 (bm25s: measured fastest of bm25s, tantivy and SQLite FTS5 on a
100,000-document world, see benchmarks/README.md). Snippets are the sentences of a
hit that best match the query, as a web search engine shows them. The extractive
summariser keeps the passages of a page most relevant to the reader's goal, weighted
by inverse document frequency, in page order.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import bm25s
import numpy as np

from proto.data import CorpusDocument
from worldgen.formats import load_corpus

__all__ = ["Extraction", "OfflineCorpus", "SearchHit"]

_WORD = re.compile(r"\w+", re.UNICODE)
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[])|\n+")
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


def _content(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.startswith("See also:"))


def _bm25(texts: list[str]) -> bm25s.BM25:
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stopwords=sorted(STOPWORDS), show_progress=False), show_progress=False)
    return index


def _stem(word: str) -> str:
    """A crude suffix stripper so "founded" matches "found" and "cities" matches "city"."""
    if len(word) > 5 and word.endswith("ies"):
        return word[:-3] + "y"
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix) and not word.endswith("ss"):
            return word[: -len(suffix)]
    return word


def _scores(index: bm25s.BM25, query: str) -> np.ndarray:
    """BM25 score of every document; words the index never saw contribute nothing."""
    words = [w for w in terms(query) if w in index.vocab_dict]
    if not words:
        return np.zeros(index.scores["num_docs"], dtype=np.float32)
    return index.get_scores(words)


def terms(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


_CONTINUATION = re.compile(r"^(It|Its|He|She|They|Their|The species|This)\b")


def sentences(text: str) -> list[str]:
    """Passages: sentences, with a sentence that opens with a pronoun kept on the one before,
    so "It is headquartered in X." never loses what "It" is."""
    out: list[str] = []
    for s in _SENTENCE.split(text):
        s = s.strip()
        if not s:
            continue
        if out and _CONTINUATION.match(s):
            out[-1] = f"{out[-1]} {s}"
        else:
            out.append(s)
    return out


@dataclass(frozen=True)
class SearchHit:
    title: str
    link: str
    snippet: str
    position: int
    score: float


@dataclass(frozen=True)
class Extraction:
    evidence: list[str]  # the chosen passages, in page order
    summary: str  # the single most relevant passage, or a note that nothing matched
    found: bool


class OfflineCorpus:
    """An in-memory BM25 index plus a URL table over a list of documents."""

    def __init__(self, documents: list[CorpusDocument], *, title_weight: float = 2.0) -> None:
        if not documents:
            raise ValueError("the corpus is empty")
        self.documents = documents
        self.by_url = {d.url: i for i, d in enumerate(documents)}
        # BM25F-style fields: a title match weighs ``title_weight`` times a body match, so the page
        # *about* an entity outranks short pages that merely mention it. Cross-reference lines
        # ("See also: ...") are navigation, not content, and stay out of the index.
        self.title_weight = title_weight
        bodies = [_content(d.text) for d in documents]
        self._body = _bm25([f"{d.title}\n{b}" for d, b in zip(documents, bodies, strict=True)])
        self._title = _bm25([d.title for d in documents])
        texts = bodies
        df: Counter[str] = Counter()
        for t in texts:
            df.update(set(terms(t)))
        n = len(texts)
        self._idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self._max_idf = math.log(1 + (n + 0.5) / 0.5)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> OfflineCorpus:
        report = load_corpus(path)
        report.raise_if_empty(Path(path))
        return cls(report.items)

    def __len__(self) -> int:
        return len(self.documents)

    # -- search ---------------------------------------------------------------------
    def search(self, query: str, *, num: int = 10, page: int = 1) -> list[SearchHit]:
        """Hits ``(page - 1) * num`` to ``page * num`` for ``query``, best first."""
        if num < 1 or page < 1:
            raise ValueError("num and page must be >= 1")
        if not terms(query):
            return []
        scores = _scores(self._body, query) + self.title_weight * _scores(self._title, query)
        k = min(num * page, len(self.documents))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.lexsort((top, -scores[top]))]  # best first; ties by corpus order, deterministic
        hits = []
        for rank in range((page - 1) * num, k):
            i = int(top[rank])
            if scores[i] <= 0:
                break
            d = self.documents[i]
            hits.append(SearchHit(d.title, d.url, self.snippet(d, query), rank + 1, float(scores[i])))
        return hits

    def snippet(self, doc: CorpusDocument, query: str, max_chars: int = 200) -> str:
        best = self._best_sentences(doc.text, query, limit=2, max_chars=max_chars)
        text = " ".join(best) if best else doc.text
        return text if len(text) <= max_chars else text[: max_chars - 3].rsplit(" ", 1)[0] + "..."

    # -- reading --------------------------------------------------------------------
    def get(self, url: str) -> CorpusDocument | None:
        i = self.by_url.get(url.strip())
        return None if i is None else self.documents[i]

    def extract(self, doc: CorpusDocument, goal: str, *, max_chars: int = 600) -> Extraction:
        """The page's passages most relevant to ``goal`` (in page order), and a summary of them."""
        ranked = self._ranked_sentences(doc.text, goal, limit=4, max_chars=max_chars)
        if not ranked:
            first = sentences(doc.text)[:1]
            return Extraction(first, f"The page {doc.title} does not mention what was asked.", found=False)
        return Extraction(sorted(ranked, key=ranked.get), next(iter(ranked)), found=True)

    def _best_sentences(self, text: str, query: str, *, limit: int, max_chars: int) -> list[str]:
        ranked = self._ranked_sentences(text, query, limit=limit, max_chars=max_chars)
        return sorted(ranked, key=ranked.get)

    def _ranked_sentences(self, text: str, query: str, *, limit: int, max_chars: int) -> dict[str, int]:
        """Best-matching sentences, best first, mapped to their position in the page."""
        wanted = {_stem(w): w for w in terms(query)}
        if not wanted:
            return []
        sents = [s for s in sentences(text) if not s.startswith("See also:")]
        scored = []
        for i, s in enumerate(sents):
            stems = {_stem(w) for w in terms(s)}
            score = sum(self._idf.get(w, self._max_idf) for st, w in wanted.items() if st in stems)
            if score > 0:
                scored.append((score, i))
        scored.sort(key=lambda x: (-x[0], x[1]))
        chosen: dict[str, int] = {}
        used = 0
        for _score, i in scored[:limit]:
            if chosen and used + len(sents[i]) > max_chars:
                break
            chosen.setdefault(sents[i], i)
            used += len(sents[i]) + 1
        return chosen
