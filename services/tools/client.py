"""How the agent loop reaches its tools: the gateway over HTTP, or a gateway in this process.

This module is the gateway's published client, the one part of ``services/tools`` another
service imports. Importing it loads no part of the gateway itself: the in-process mode
(:meth:`LocalTools.offline`) builds one on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from agent.toolcall import format_tool_failure

if TYPE_CHECKING:
    from services.tools.gateway import ToolGateway

__all__ = ["GatewayClient", "LocalTools", "ToolReply", "Tools"]


@dataclass(frozen=True)
class ToolReply:
    ok: bool
    text: str  # what the agent reads next
    cached: bool = False
    latency_s: float = 0.0
    unreachable: bool = False  # the gateway itself could not be reached: the trajectory cannot go on


class Tools(Protocol):
    async def catalogue(self) -> list[dict[str, Any]]: ...

    async def call(
        self, server_name: str, tool_name: str, arguments: dict[str, Any], *, trajectory_id: str | None = None
    ) -> ToolReply: ...

    async def aclose(self) -> None: ...


class GatewayClient:
    def __init__(
        self, base_url: str, *, timeout_s: float = 300.0, http: httpx.AsyncClient | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = http is None
        self.http = http or httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    async def catalogue(self) -> list[dict[str, Any]]:
        response = await self.http.get(f"{self.base_url}/tools")
        response.raise_for_status()
        return response.json()["servers"]

    async def call(
        self, server_name: str, tool_name: str, arguments: dict[str, Any], *, trajectory_id: str | None = None
    ) -> ToolReply:
        """Never raises for the agent's sake: every failure becomes a tool result it can read."""
        body = {
            "server_name": server_name,
            "tool_name": tool_name,
            "arguments": arguments,
            "trajectory_id": trajectory_id,
        }
        try:
            response = await self.http.post(f"{self.base_url}/call", json=body)
        except httpx.HTTPError as exc:
            reason = f"tool gateway unreachable ({type(exc).__name__})"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason), unreachable=True)
        if response.status_code in (404, 422):
            detail = response.json().get("detail", [])
            reason = "; ".join(
                f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail
            )
            return ToolReply(
                False, format_tool_failure(server_name, tool_name, reason or f"HTTP {response.status_code}")
            )
        if response.status_code >= 400:
            reason = f"tool gateway answered HTTP {response.status_code}"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason), unreachable=True)
        data = response.json()
        return ToolReply(
            bool(data["ok"]), data["text"], bool(data.get("cached")), float(data.get("latency_s", 0.0))
        )


class LocalTools:
    """A gateway running in this process (evaluation and tests without the HTTP service)."""

    def __init__(self, gateway: ToolGateway) -> None:
        from services.tools.gateway import InvalidCall

        self.gateway = gateway
        self._invalid = InvalidCall

    @classmethod
    def offline(cls, corpus: str | Path) -> LocalTools:
        """The offline backend over a JSONL corpus, with an in-process cache."""
        from services.search.corpus import OfflineCorpus
        from services.tools.backends import OfflineBackend
        from services.tools.gateway import ToolGateway
        from services.tools.store import MemoryStore

        return cls(ToolGateway(OfflineBackend(OfflineCorpus.from_jsonl(corpus)), MemoryStore()))

    async def aclose(self) -> None:
        return None

    async def catalogue(self) -> list[dict[str, Any]]:
        return self.gateway.catalogue()

    async def call(
        self, server_name: str, tool_name: str, arguments: dict[str, Any], *, trajectory_id: str | None = None
    ) -> ToolReply:
        try:
            out = await self.gateway.call(server_name, tool_name, arguments, trajectory_id=trajectory_id)
        except self._invalid as exc:
            return ToolReply(False, format_tool_failure(server_name, tool_name, str(exc)))
        return ToolReply(out.ok, out.text, out.cached, out.latency_s)
