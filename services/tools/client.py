"""How the agent loop reaches its tools: the gateway over HTTP, or a gateway in this process.

This module is the gateway's published client, the one part of ``services/tools`` another
service imports. Importing it loads no part of the gateway itself: the in-process mode
(:meth:`LocalTools.offline`) builds one on demand.

The HTTP client is aiohttp: every turn of every trajectory makes a tool call, and on this path
aiohttp spends about a seventh of httpx's CPU a request (0.14-0.22 ms against 1.0-1.2 ms,
measured on loopback against the gateway; ``benchmarks/README.md``), which bounded the agent loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from agent.toolcall import format_tool_failure

if TYPE_CHECKING:
    from services.tools.gateway import ToolGateway

__all__ = ["GatewayClient", "LocalTools", "ToolReply", "Tools"]

_JSON = {"Content-Type": "application/json"}

# How long the client keeps an idle connection for reuse. The gateway keeps one for longer
# (ToolsSettings.keep_alive_s, 75 s), so the client always drops an idle connection first and
# never sends on one the gateway is closing: with aiohttp's 15 s against uvicorn's 5 s, a call
# made 5 to 15 s after the last one on that connection could meet the gateway's close and fail
# as "unreachable", failing its trajectory, which happened in a test run between two tool calls
# 8 s apart.
KEEP_ALIVE_S = 30.0
# What a send on a connection the other side had closed raises.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


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
        self,
        server_name: str,
        tool_name: str,
        arguments: dict[str, Any],
        *,
        trajectory_id: str | None = None,
        call_index: int | None = None,
    ) -> ToolReply: ...

    async def aclose(self) -> None: ...


class GatewayClient:
    """The gateway over HTTP/1.1: one session, its keep-alive connections reused by every call.

    The session is opened on the first request, in the event loop that makes it (aiohttp binds a
    session to its loop), so a client can be built outside one.

    ``timeout_s`` bounds each wait for the gateway's answer (a socket read), not the call as a
    whole: aiohttp's total timeout also counts the wait for a free connection, and with more calls
    in flight than ``connections`` (a worker runs up to concurrency x G trajectories) a call queued
    behind slow ones would time out before it is sent, read as an unreachable gateway, and fail its
    trajectory. The gateway bounds every call itself (its deadline)."""

    def __init__(self, base_url: str, *, timeout_s: float = 300.0, connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections, keepalive_timeout=KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=self.timeout_s),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def catalogue(self) -> list[dict[str, Any]]:
        async with self.session.get(f"{self.base_url}/tools") as response:
            response.raise_for_status()
            return json.loads(await response.read())["servers"]

    async def call(
        self,
        server_name: str,
        tool_name: str,
        arguments: dict[str, Any],
        *,
        trajectory_id: str | None = None,
        call_index: int | None = None,
    ) -> ToolReply:
        """Never raises for the agent's sake: every failure becomes a tool result it can read."""
        fields = {
            "server_name": server_name,
            "tool_name": tool_name,
            "arguments": arguments,
            "trajectory_id": trajectory_id,
        }
        if call_index is not None:  # a gateway older than the field refuses it, even as null
            fields["call_index"] = call_index
        body = json.dumps(fields).encode()
        try:
            status, raw = await self._post(body)
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason = f"tool gateway unreachable ({type(exc).__name__})"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason), unreachable=True)
        if status in (404, 422):
            reason = _validation_errors(raw) or f"HTTP {status}"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason))
        if status >= 400:
            reason = f"tool gateway answered HTTP {status}"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason), unreachable=True)
        try:
            data = json.loads(raw)
            return ToolReply(
                bool(data["ok"]), data["text"], bool(data.get("cached")), float(data.get("latency_s", 0.0))
            )
        except (ValueError, KeyError, TypeError) as exc:  # not the gateway's answer (a proxy's page)
            reason = f"tool gateway answered HTTP {status} with an unreadable body ({type(exc).__name__})"
            return ToolReply(False, format_tool_failure(server_name, tool_name, reason), unreachable=True)

    async def _post(self, body: bytes, *, again: bool = True) -> tuple[int, bytes]:
        """POST /call, sent once more on a fresh connection if the connection was found closed (a
        proxy's idle connection, a restarted gateway's). A call the gateway had begun then runs
        twice; every tool call is a read, and the gateway caches its results."""
        try:
            async with self.session.post(f"{self.base_url}/call", data=body, headers=_JSON) as response:
                return response.status, await response.read()
        except _STALE_CONNECTION:
            if not again:
                raise
        return await self._post(body, again=False)


def _validation_errors(raw: bytes) -> str:
    """FastAPI's 404/422 detail as ``field: message; ...`` ("" when the body is not one)."""
    try:
        detail = json.loads(raw).get("detail", [])
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail)
    except (ValueError, AttributeError, TypeError):
        return ""


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
        self,
        server_name: str,
        tool_name: str,
        arguments: dict[str, Any],
        *,
        trajectory_id: str | None = None,
        call_index: int | None = None,
    ) -> ToolReply:
        try:
            out = await self.gateway.call(
                server_name, tool_name, arguments, trajectory_id=trajectory_id, call_index=call_index
            )
        except self._invalid as exc:
            return ToolReply(False, format_tool_failure(server_name, tool_name, str(exc)))
        return ToolReply(out.ok, out.text, out.cached, out.latency_s)
