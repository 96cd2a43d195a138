"""The offline corpus: full-text search and reading by URL over local documents (the
generated world, or any JSONL of ``{url, title, text}`` documents).

Search is BM25 with bm25s. Measured on a 100,000-document world (benchmarks/README.md):
tantivy ranks short queries faster and builds faster, bm25s ranks long natural-language
queries ~4x faster, SQLite FTS5 is far behind both; both leaders cost well under a
millisecond a query, far below the gateway's HTTP overhead, and bm25s needs no query
language (no escaping of what the agent types) and no compiled dependency. Title and body are separate fields:
a title match weighs ``title_weight`` times a body match (BM25F-style), so the page
*about* an entity outranks short pages that merely mention it. Cross-reference lines
("See also: ...") are navigation, not content, and stay out of the index. Snippets
are the passages of a hit that best match the query, as a web engine shows them.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proto.data import CorpusDocument
from services.search.extractive import (
    STOPWORDS,
    Extraction,
    IdfTable,
    extract,
    passages,
    rank_passages,
    terms,
)
from worldgen.formats import load_corpus

__all__ = ["OfflineCorpus", "SearchHit"]


def _bm25s_without_jax():
    """bm25s, kept from starting JAX. Where JAX is installed, ``import bm25s`` imports ``jax.lax``
    and runs a ``top_k`` to warm it up (bm25s/selection.py), which starts JAX on the GPU and
    preallocates most of its memory: the services beside the gateway then die of out-of-memory
    at start-up. Scoring and selection here are NumPy's (bm25s builds the index), so JAX is
    hidden while bm25s loads (an import of it fails) and bm25s settles on its NumPy backend."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hidden = {name: sys.modules.get(name) for name in ("jax", "jax.lax")}
    sys.modules.update(dict.fromkeys(hidden))  # None: "import jax" raises ImportError
    try:
        import bm25s
    finally:
        for name, module in hidden.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module
    return bm25s


bm25s = _bm25s_without_jax()
logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG


@dataclass(frozen=True)
class SearchHit:
    title: str
    link: str
    snippet: str
    position: int
    score: float


def _bm25(texts: list[str]) -> bm25s.BM25 | None:
    """The field's index; None when no text has a word it keeps (titles of one letter, bodies of
    stopwords): bm25s cannot build an index of no words, and such a field matches no query."""
    tokens = bm25s.tokenize(texts, stopwords=sorted(STOPWORDS), show_progress=False)
    if not tokens.vocab:
        return None
    index = bm25s.BM25()  # the "lucene" variant: a document's score is a sum over the query's words
    index.index(tokens, show_progress=False)
    return index


def _scores(index: bm25s.BM25, query: str) -> np.ndarray:
    """BM25 score of every document, as ``index.get_scores`` computes it: the sum, over the
    query's words, of each document's stored weight for the word; words the index never saw
    contribute nothing. A word's postings hold each document once, so a plain indexed add does
    what bm25s's ``np.add.at`` does, several times faster on a common word's long postings. A word
    the query repeats is added once, times its count: a 2,048-character query of one common word
    would otherwise walk that word's postings some 680 times."""
    postings = index.scores
    indptr, indices, weights = postings["indptr"], postings["indices"], postings["data"]
    out = np.zeros(postings["num_docs"], dtype=weights.dtype)
    vocab = index.vocab_dict
    for word, count in Counter(terms(query)).items():
        word_id = vocab.get(word)
        if word_id is not None:
            start, end = indptr[word_id], indptr[word_id + 1]
            out[indices[start:end]] += weights[start:end] if count == 1 else weights[start:end] * count
    return out


class OfflineCorpus:
    def __init__(self, documents: list[CorpusDocument], *, title_weight: float = 2.0) -> None:
        if not documents:
            raise ValueError("the corpus is empty")
        self.documents = documents
        self.by_url = {d.url: i for i, d in enumerate(documents)}
        self.title_weight = title_weight
        bodies = ["\n".join(passages(d.text)) for d in documents]
        self._body = _bm25([f"{d.title}\n{b}" for d, b in zip(documents, bodies, strict=True)])
        self._title = _bm25([d.title for d in documents])
        self.idf = IdfTable(bodies)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> OfflineCorpus:
        report = load_corpus(path)
        report.raise_if_empty(Path(path))
        return cls(report.items)

    def __len__(self) -> int:
        return len(self.documents)

    def _field(self, index: bm25s.BM25 | None, query: str) -> np.ndarray:
        return np.zeros(len(self.documents), dtype=np.float32) if index is None else _scores(index, query)

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """(document index, score) of the ``k`` best matches, best first; ties by corpus order."""
        if not terms(query):
            return []
        scores = self._field(self._body, query) + self.title_weight * self._field(self._title, query)
        # only documents sharing a word with the query can rank: usually a small fraction of them
        matches = np.flatnonzero(scores > 0)
        if k < len(matches):
            # the k-th best score, then every document above it and the first ones at it: which
            # of several equal documents make the cut is the corpus order's choice, not that of
            # the selection algorithm (argpartition's pick among ties varies with NumPy's version)
            ranked = -scores[matches]
            kth = np.partition(ranked, k - 1)[k - 1]
            above = matches[ranked < kth]
            matches = np.concatenate([above, matches[ranked == kth][: k - len(above)]])
        top = matches[np.lexsort((matches, -scores[matches]))]
        return [(int(i), float(scores[i])) for i in top]

    def search(self, query: str, *, num: int = 10, page: int = 1) -> list[SearchHit]:
        """Hits ``(page - 1) * num`` to ``page * num`` for ``query``, best first."""
        if num < 1 or page < 1:
            raise ValueError("num and page must be >= 1")
        ranked = self.top_k(query, num * page)[(page - 1) * num :]
        return [
            SearchHit(
                self.documents[i].title,
                self.documents[i].url,
                self.snippet(self.documents[i], query),
                (page - 1) * num + rank + 1,
                score,
            )
            for rank, (i, score) in enumerate(ranked)
        ]

    def snippet(self, doc: CorpusDocument, query: str, max_chars: int = 200) -> str:
        best = rank_passages(doc.text, query, self.idf, limit=2, max_chars=max_chars)
        text = " ".join(p for p, _ in sorted(best, key=lambda x: x[1])) if best else doc.text
        return text if len(text) <= max_chars else text[: max_chars - 3].rsplit(" ", 1)[0] + "..."

    def get(self, url: str) -> CorpusDocument | None:
        i = self.by_url.get(url.strip())
        return None if i is None else self.documents[i]

    def extract(self, doc: CorpusDocument, goal: str, *, max_chars: int = 600) -> Extraction:
        """The page's passages most relevant to ``goal`` (in page order), and the best one."""
        return extract(doc.text, goal, self.idf, title=doc.title, max_chars=max_chars)
