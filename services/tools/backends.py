"""Tool backends: one implementation of the catalogue's two tools per source of pages.

Every backend returns the same result shapes, so an agent trained offline does not
notice the switch to the web:

* search -> ``{"organic": [{"title", "link", "snippet", "position"}], "answerBox"?, "knowledgeGraph"?}``
* read   -> ``{"success", "url", "extracted_info": {"evidence", "summary"}, "error"}``

A backend raises only when the tool itself failed (an upstream down after retries);
a page that does not exist is a normal, unsuccessful read result.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from services.tools.catalogue import GoogleSearchArgs, ScrapeArgs
from services.tools.corpus import OfflineCorpus

__all__ = ["Backend", "OfflineBackend", "read_result", "render"]


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


class Backend(Protocol):
    name: str

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]: ...

    async def read(self, args: ScrapeArgs) -> dict[str, Any]: ...


class OfflineBackend:
    """Search and read over a local corpus; extraction is extractive (no LLM)."""

    name = "offline"

    def __init__(self, corpus: OfflineCorpus, *, snippet_chars: int = 200, extract_chars: int = 600) -> None:
        self.corpus = corpus
        self.snippet_chars = snippet_chars
        self.extract_chars = extract_chars

    def search_sync(self, args: GoogleSearchArgs) -> dict[str, Any]:
        hits = self.corpus.search(args.q, num=args.num, page=args.page)
        return {
            "organic": [
                {"title": h.title, "link": h.link, "snippet": h.snippet, "position": h.position} for h in hits
            ]
        }

    def read_sync(self, args: ScrapeArgs) -> dict[str, Any]:
        doc = self.corpus.get(args.url)
        if doc is None:
            return read_result(args.url, error=f"no page found at {args.url}")
        ex = self.corpus.extract(doc, args.info_to_extract, max_chars=self.extract_chars)
        return read_result(args.url, evidence=" ".join(ex.evidence), summary=ex.summary)

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]:
        # BM25 over a large corpus takes milliseconds of CPU: keep the event loop free.
        return await asyncio.to_thread(self.search_sync, args)

    async def read(self, args: ScrapeArgs) -> dict[str, Any]:
        return await asyncio.to_thread(self.read_sync, args)
