"""Rename a conversation's invented words consistently, so SFT teaches copying, not recall.

A tiny policy supervised on one world's oracle trajectories can lower its loss two ways:
copy the names the question and the tool results show it, or memorise which name answers
which question. Memorising is easier for 2 layers and fails on held-out questions, whose
answers (the rarest ones, see ``worldgen.splits``) it has hardly seen: the committed policy
wrote the right name into ``\\boxed{}`` for 23 of 30 of its training conversations but 10 of 40
validation ones, teacher-forced, with the name five tokens earlier.

Renaming removes the second way. Each conversation gets its own fresh word for every
invented word it contains (same syllables as ``worldgen.names``, so the tokenizer splits
them alike; none is a word of the world), applied everywhere it occurs: question, thoughts,
tool arguments and results, page addresses (lower-case, in the slug) and the boxed answer.
The conversation stays self-consistent (searching a name finds that name's page, whose
text names the next entity), but nothing in it can be recalled, only copied.

Fixed words stay: organisation suffixes, title words, event kinds, and any word the
templates themselves use ("So", "Next", ...), found by scanning their source, so that an
invented given name that happens to be "So" does not rename the oracle's "So the ...".
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable, Iterable
from functools import lru_cache

from worldgen import documents, names, questions
from worldgen.graph import EVENT_KINDS, Graph

_WORD = re.compile(r"[A-Za-z]+")
_URL = re.compile(r"kb://[a-z]+/[a-z0-9-]+")


@lru_cache(maxsize=1)
def _fixed_words() -> frozenset[str]:
    words = {"The", "of"}
    words.update(w for suffix in names.ORG_SUFFIXES.values() for s in suffix for w in s.split())
    words.update(names.TITLE_ADJECTIVES, names.TITLE_NOUNS)
    words.update(kind.title() for kind in EVENT_KINDS)
    from agent import prompt
    from worldgen import oracle  # imports this module: late, to keep the import acyclic

    for module in (documents, oracle, questions, prompt):
        words.update(_WORD.findall(inspect.getsource(module)))
    return frozenset(words)


def invented_words(graph: Graph) -> frozenset[str]:
    """Every word of an entity name or alias that the name generator made up (3+ letters)."""
    fixed = _fixed_words()
    found: set[str] = set()
    for e in graph.entities.values():
        for form in (e.name, *e.aliases):
            found.update(w for w in _WORD.findall(form) if len(w) >= 3 and w not in fixed)
    return frozenset(found)


class Renamer:
    """Draws one fresh word per invented word of a conversation and rewrites its text."""

    def __init__(self, invented: frozenset[str], rng: random.Random) -> None:
        self.invented = invented
        self.by_lower = {w.lower(): w for w in invented}
        self.rng = rng
        self.maker = names.NameMaker(rng)

    def _fresh(self, word: str, taken: set[str]) -> str:
        ending = next((e for e in names.PLACE_ENDINGS if word.endswith(e) and len(word) > len(e) + 2), "")
        syllables = max(1, round((len(word) - len(ending)) / 4))
        for _ in range(100):
            new = self.maker.word(syllables) + ending
            new = new.capitalize() if word[0].isupper() else new.lower()
            if new.lower() not in taken:  # taken starts as the world's words: none is reused
                taken.add(new.lower())
                return new
        raise RuntimeError(f"could not draw a fresh word for {word!r}")

    def mapping(self, texts: Iterable[str]) -> dict[str, str]:
        """Invented word -> fresh word, for every invented word in the texts (lower-case in slugs too)."""
        seen: list[str] = []
        for text in texts:
            seen.extend(w for w in _WORD.findall(text) if w in self.invented)
            for url in _URL.findall(text):
                seen.extend(self.by_lower[p] for p in url.split("/")[-1].split("-") if p in self.by_lower)
        taken = set(self.by_lower)
        out: dict[str, str] = {}
        for w in dict.fromkeys(seen):  # first-seen order: reproducible for a given seed
            out[w] = self._fresh(w, taken)
        return out

    @staticmethod
    def rewriter(mapping: dict[str, str]) -> Callable[[str], str]:
        """A function applying ``mapping`` to a text: to whole words, and lower-case inside slugs."""
        lower = {k.lower(): v.lower() for k, v in mapping.items()}

        def url(m: re.Match) -> str:
            head, slug = m.group(0).rsplit("/", 1)
            return head + "/" + "-".join(lower.get(p, p) for p in slug.split("-"))

        def rewrite(text: str) -> str:
            return _WORD.sub(lambda m: mapping.get(m.group(0), m.group(0)), _URL.sub(url, text))

        return rewrite


def rename_trajectory(row: dict, renamer: Renamer) -> dict:
    """A copy of an oracle trajectory row with its invented words renamed everywhere."""
    texts = [
        row["question"],
        row["answer"],
        *row.get("support", ()),
        *(m["content"] for m in row["messages"]),
    ]
    mapping = renamer.mapping(texts)
    rewrite = renamer.rewriter(mapping)
    return {
        **row,
        "question": rewrite(row["question"]),
        "answer": rewrite(row["answer"]),
        "support": [rewrite(fact) for fact in row.get("support", ())],
        "messages": [{**m, "content": rewrite(m["content"])} for m in row["messages"]],
        "renamed": len(mapping),
    }
