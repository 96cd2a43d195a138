"""Tool backends: one implementation of the catalogue's two tools per source of pages, all
returning the result shapes of :mod:`services.search.offline`.

A backend raises only when the tool itself failed (an upstream down after retries);
a page that does not exist is a normal, unsuccessful read result.
"""

from __future__ import annotations

from typing import Any, Protocol

from agent.catalogue import GoogleSearchArgs, ScrapeArgs
from services.search.corpus import OfflineCorpus
from services.search.offline import OfflineTools
from services.tools.cpu import CpuPool

__all__ = ["Backend", "OfflineBackend"]


class Backend(Protocol):
    name: str

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]: ...

    async def read(self, args: ScrapeArgs) -> dict[str, Any]: ...


class OfflineBackend:
    """The offline tools over a local corpus, run in the gateway's CPU pool: BM25 over a large
    corpus and snippet building take about a millisecond of CPU a call."""

    name = "offline"

    def __init__(self, corpus: OfflineCorpus, cpu: CpuPool | None = None) -> None:
        self.tools = OfflineTools(corpus)
        self.cpu = cpu or CpuPool()

    async def search(self, args: GoogleSearchArgs) -> dict[str, Any]:
        return await self.cpu.run(self.tools.search, args)

    async def read(self, args: ScrapeArgs) -> dict[str, Any]:
        return await self.cpu.run(self.tools.read, args)
