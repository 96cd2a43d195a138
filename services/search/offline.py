"""The two tools over a local corpus, synchronously, and the result shapes every backend returns,
so an agent trained offline does not notice the switch to the web:

* search -> ``{"organic": [{"title", "link", "snippet", "position"}], "answerBox"?, "knowledgeGraph"?}``
* read   -> ``{"success", "url", "extracted_info": {"evidence", "summary"}, "error"}``

A page that does not exist is a normal, unsuccessful read result.
"""

from __future__ import annotations

import json
from typing import Any

from agent.catalogue import GoogleSearchArgs, ScrapeArgs
from services.search.corpus import OfflineCorpus

__all__ = ["OfflineTools", "read_result", "render"]


def render(result: dict[str, Any]) -> str:
    """A result as the text the agent reads."""
    return json.dumps(result, ensure_ascii=False)


def read_result(url: str, *, evidence: str = "", summary: str = "", error: str = "") -> dict[str, Any]:
    return {
        "success": not error,
        "url": url,
        "extracted_info": {"evidence": evidence, "summary": summary} if not error else {},
        "error": error,
    }


class OfflineTools:
    """Search and read over a local corpus; extraction is extractive (no LLM). CPU-bound: the
    gateway runs these off its event loop."""

    def __init__(self, corpus: OfflineCorpus, *, extract_chars: int = 600) -> None:
        self.corpus = corpus
        self.extract_chars = extract_chars

    def search(self, args: GoogleSearchArgs) -> dict[str, Any]:
        hits = self.corpus.search(args.q, num=args.num, page=args.page)
        return {
            "organic": [
                {"title": h.title, "link": h.link, "snippet": h.snippet, "position": h.position} for h in hits
            ]
        }

    def read(self, args: ScrapeArgs) -> dict[str, Any]:
        doc = self.corpus.get(args.url)
        if doc is None:
            return read_result(args.url, error=f"no page found at {args.url}")
        ex = self.corpus.extract(doc, args.info_to_extract, max_chars=self.extract_chars)
        return read_result(args.url, evidence=" ".join(ex.evidence), summary=ex.summary)
