"""The offline search index: its scores are bm25s's, its ranking and snippets are stable."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from proto.data import CorpusDocument
from services.search.corpus import OfflineCorpus, _scores
from services.search.extractive import passages, terms
from worldgen.build import build_world


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    world = tmp_path_factory.mktemp("search-world")
    build_world(world, seed=7, entities=400, n_rl=20, n_val=5, n_sft=5)
    return OfflineCorpus.from_jsonl(world / "corpus.jsonl"), world


def test_scores_are_bm25s_own(corpus):
    index, world = corpus
    questions = [
        json.loads(line)["question"] for line in (world / "questions" / "rl.jsonl").read_text().splitlines()
    ]
    queries = (
        [d.title for d in index.documents[:40]]
        + questions
        + ["city city river", "river " * 300, "zzz unknown", "the of"]
    )
    for bm25 in (index._body, index._title):
        for q in queries:
            words = [w for w in terms(q) if w in bm25.vocab_dict]
            ours = _scores(bm25, q)
            theirs = bm25.get_scores(words) if words else np.zeros_like(ours)
            # a repeated word is added once times its count: float32 rounds that a little
            # differently from bm25s's repeated additions (300 of them: 4e-6 relative)
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_ranking_is_by_score_then_corpus_order(corpus):
    index, _ = corpus
    for doc in index.documents[:20]:
        ranked = index.top_k(doc.title, 8)
        assert index.documents[ranked[0][0]].url == doc.url
        assert all((-a[1], a[0]) <= (-b[1], b[0]) for a, b in itertools.pairwise(ranked))
        assert all(score > 0 for _, score in ranked)
    assert index.top_k("the of and", 5) == [] and index.top_k("zzzunknownword", 5) == []


def test_the_cut_among_equal_scores_follows_the_corpus_order():
    """Many documents score alike for a vague query: the ones that make the cut are the first in
    the corpus, exactly the k best by (score, corpus order), whatever the selection algorithm."""
    from proto.data import CorpusDocument

    docs = [
        CorpusDocument(url=f"kb://c/{i}", title=f"Congress {i}", text="A congress was held.")
        for i in range(60)
    ]
    docs[37] = CorpusDocument(url="kb://c/37", title="Congress congress", text="A congress was held.")
    index = OfflineCorpus(docs)
    scores = _scores(index._body, "congress") + index.title_weight * _scores(index._title, "congress")
    exact = sorted(range(len(docs)), key=lambda i: (-scores[i], i))
    for k in (1, 3, 5, 8, 59):
        assert [i for i, _ in index.top_k("congress", k)] == exact[:k]
    assert [i for i, _ in index.top_k("congress", 3)] == [37, 0, 1]
    assert [h.position for h in index.search("congress", num=3, page=2)] == [4, 5, 6]


def test_continuations_stay_with_their_sentence():
    text = "Vienna is a city. It is big. Its river is the Danube. Paris too.\nSee also: Graz"
    assert passages(text) == ["Vienna is a city. It is big. Its river is the Danube.", "Paris too."]


def test_the_cut_follows_the_corpus_order_on_a_generated_world(corpus):
    """On a real corpus, for titles and vague queries alike, the k best are the first k of a full
    sort by (score descending, corpus order), also where the k-th score is shared: a partition
    alone picks among those ties by its algorithm, which NumPy chooses by CPU."""
    index, _ = corpus
    queries = [d.title for d in index.documents[:60]] + ["exhibition", "river city", "university founded"]
    cut_ties = 0
    for q, k in itertools.product(queries, (1, 3, 5, 10)):
        scores = _scores(index._body, q) + index.title_weight * _scores(index._title, q)
        order = np.lexsort((np.arange(len(scores)), -scores))
        expected = [(int(i), float(scores[i])) for i in order[:k] if scores[i] > 0]
        assert index.top_k(q, k) == expected, (q, k)
        cut_ties += k < len(order) and scores[order[k - 1]] == scores[order[k]] > 0
    assert cut_ties >= 10  # the cases where the rule matters were exercised


def test_a_corpus_whose_titles_hold_no_word_still_serves():
    """Titles of one letter (or of stopwords only) leave the title field with no word to index:
    bm25s raised on building it, and the gateway failed to start."""
    docs = [
        CorpusDocument(url="http://a.example/x", title="t", text="The Danube flows through Vienna."),
        CorpusDocument(url="http://a.example/y", title="u", text="the a"),
    ]
    corpus = OfflineCorpus(docs)
    assert [i for i, _ in corpus.top_k("danube vienna", 5)] == [0]
    assert corpus.top_k("t", 5) == []
