"""The rollout's client for the tool gateway."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from agent.toolcall import format_tool_failure

__all__ = ["GatewayClient", "ToolReply"]


@dataclass(frozen=True)
class ToolReply:
    ok: bool
    text: str  # what the agent reads next
    cached: bool = False
    latency_s: float = 0.0


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
            return ToolReply(
                False,
                format_tool_failure(
                    server_name, tool_name, f"tool gateway unreachable ({type(exc).__name__})"
                ),
            )
        if response.status_code in (404, 422):
            detail = response.json().get("detail", [])
            reason = "; ".join(
                f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail
            )
            return ToolReply(
                False, format_tool_failure(server_name, tool_name, reason or f"HTTP {response.status_code}")
            )
        if response.status_code >= 400:
            return ToolReply(
                False,
                format_tool_failure(
                    server_name, tool_name, f"tool gateway answered HTTP {response.status_code}"
                ),
            )
        data = response.json()
        return ToolReply(
            bool(data["ok"]), data["text"], bool(data.get("cached")), float(data.get("latency_s", 0.0))
        )
