"""The tool gateway's core, independent of HTTP: validate a call, enforce the trajectory's
call budget, answer from the cache or merge with an identical call in flight, run the
backend, render and truncate the result.

What the agent reads is always text: the backend's JSON result, or, when the tool
itself failed (an upstream down, a budget exhausted), ``Tool call to T on S failed.
Error: ...``. Only malformed calls (unknown tool, invalid arguments) are errors of
the caller, raised as :class:`InvalidCall`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from agent.catalogue import READ, SEARCH, TOOLS, ToolSpec, catalogue, find_tool
from agent.toolcall import DEFAULT_MAX_RESULT_CHARS, format_tool_failure, format_tool_result
from services.http_guard import field_errors
from services.search.offline import render
from services.tools import metrics
from services.tools.backends import Backend
from services.tools.store import Store
from services.upstream import UpstreamError

log = logging.getLogger(__name__)

__all__ = ["CallOutcome", "InvalidCall", "ToolGateway"]


class InvalidCall(Exception):
    """A call the gateway cannot run: ``status`` 404 (unknown tool) or 422 (bad arguments)."""

    def __init__(self, status: int, errors: list[dict[str, Any]]) -> None:
        # the message names fields as the agent wrote them: "arguments.num", not "body.arguments.num"
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in errors))
        self.status = status
        self.errors = errors


@dataclass(frozen=True)
class CallOutcome:
    ok: bool
    text: str
    cached: bool = False
    merged: bool = False
    latency_s: float = 0.0
    error: str | None = None


# one encoder for every key: json.dumps with options builds a new one per call
_KEY_ENCODER = json.JSONEncoder(sort_keys=True, ensure_ascii=False)


def _canonical(spec: ToolSpec, args: BaseModel) -> str:
    data = args.model_dump()
    if spec is SEARCH:
        data["q"] = " ".join(data["q"].lower().split())
    elif spec is READ:
        data["url"] = data["url"].strip()
        data["info_to_extract"] = " ".join(data["info_to_extract"].lower().split())
    return _KEY_ENCODER.encode(data)


class ToolGateway:
    def __init__(
        self,
        backend: Backend,
        store: Store,
        *,
        search_ttl_s: int = 86_400,
        read_ttl_s: int = 7 * 86_400,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        call_budget: int = 300,
        budget_ttl_s: int = 6 * 3600,
        deadline_s: float = 240.0,
        answers_tag: str = "",
    ) -> None:
        self.backend = backend
        # in every cache key: answers cached under another configuration are not this one's
        # (ToolsSettings.answers_tag)
        self.answers_tag = answers_tag
        # one call's limit, retries and fallbacks included, inside the rollout client's 300 s: past
        # it the agent gets a failed call and goes on, instead of its client timing out and the
        # whole trajectory ending as an error
        self.deadline_s = deadline_s
        self.store = store
        self.ttl = {SEARCH.name: search_ttl_s, READ.name: read_ttl_s}
        self.max_result_chars = max_result_chars
        self.call_budget = call_budget
        self.budget_ttl_s = budget_ttl_s
        self._inflight: dict[str, asyncio.Future[tuple[bool, str, str | None]]] = {}
        for spec in TOOLS:  # every series at zero from the start: an error ratio of 0, not "no data"
            for outcome in ("ok", "error"):
                metrics.CALLS.labels(spec.name, backend.name, outcome)
            for result in ("hit", "miss"):
                metrics.CACHE.labels(spec.name, result)
            metrics.MERGED.labels(spec.name)

    def catalogue(self) -> list[dict[str, Any]]:
        return catalogue(TOOLS)

    def validate(self, server_name: str, tool_name: str, arguments: Any) -> tuple[ToolSpec, BaseModel]:
        spec = find_tool(server_name, tool_name)
        if spec is None:
            known = ", ".join(f"{t.name} on {t.server_name}" for t in TOOLS)
            field = "server_name" if all(t.server_name != server_name for t in TOOLS) else "tool_name"
            raise InvalidCall(
                404,
                [
                    {
                        "loc": ["body", field],
                        "msg": f"unknown tool {tool_name!r} on server {server_name!r}; known: {known}",
                        "type": "unknown_tool",
                    }
                ],
            )
        if not isinstance(arguments, dict):
            raise InvalidCall(
                422,
                [
                    {
                        "loc": ["body", "arguments"],
                        "msg": "arguments must be a JSON object",
                        "type": "dict_type",
                    }
                ],
            )
        try:
            return spec, spec.args_model.model_validate(arguments)
        except ValidationError as exc:
            raise InvalidCall(422, field_errors(exc.errors(), ("body", "arguments"))) from None

    async def call(
        self,
        server_name: str,
        tool_name: str,
        arguments: Any,
        *,
        trajectory_id: str | None = None,
        call_index: int | None = None,
    ) -> CallOutcome:
        """``call_index``: the call's place among its trajectory's calls (from 0). With it the budget
        is the place (the call at place ``call_budget`` or later is refused), so a call sent again,
        by a client's retry or a trajectory resumed after its worker died, counts once; without
        it, every call under ``trajectory_id`` counts."""
        spec, args = self.validate(server_name, tool_name, arguments)
        started = time.perf_counter()
        outcome = await self._call(spec, args, trajectory_id, call_index)
        elapsed = time.perf_counter() - started
        metrics.child(metrics.CALL_SECONDS, spec.name, self.backend.name).observe(elapsed)
        metrics.child(metrics.CALLS, spec.name, self.backend.name, "ok" if outcome.ok else "error").inc()
        return CallOutcome(outcome.ok, outcome.text, outcome.cached, outcome.merged, elapsed, outcome.error)

    async def _call(
        self, spec: ToolSpec, args: BaseModel, trajectory_id: str | None, call_index: int | None
    ) -> CallOutcome:
        digest = hashlib.sha256(_canonical(spec, args).encode()).hexdigest()
        key = f"cache:{self.backend.name}:{self.answers_tag}:{spec.name}:{digest}"
        if call_index is not None:  # the place alone decides, before any round trip
            used, hit = call_index + 1, None
            if used <= self.call_budget:
                hit = await self.store.get(key)
        elif trajectory_id is not None:  # one round trip: the budget's count and the cache lookup
            used, hit = await self.store.incr_and_get(f"budget:{trajectory_id}", self.budget_ttl_s, key)
        else:
            used, hit = 0, await self.store.get(key)
        if used > self.call_budget:
            metrics.BUDGET_EXHAUSTED.inc()
            error = f"the call budget of {self.call_budget} tool calls for this trajectory is used up"
            return CallOutcome(False, format_tool_failure(spec.server_name, spec.name, error), error=error)
        if hit is not None:
            metrics.child(metrics.CACHE, spec.name, "hit").inc()
            return CallOutcome(True, hit, cached=True)
        metrics.child(metrics.CACHE, spec.name, "miss").inc()

        if key in self._inflight:  # the same call is already running: share its answer
            metrics.MERGED.labels(spec.name).inc()
            ok, text, error = await asyncio.shield(self._inflight[key])
            return CallOutcome(ok, text, merged=True, error=error)
        future: asyncio.Future[tuple[bool, str, str | None]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            ok, text, error = await self._run(spec, args, key)
            future.set_result((ok, text, error))
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else needs to
            raise
        finally:
            del self._inflight[key]
        return CallOutcome(ok, text, error=error)

    async def _run(self, spec: ToolSpec, args: BaseModel, key: str) -> tuple[bool, str, str | None]:
        try:
            async with asyncio.timeout(self.deadline_s):
                result = await (self.backend.search(args) if spec is SEARCH else self.backend.read(args))
        except UpstreamError as exc:
            error = str(exc)
        except TimeoutError:
            error = f"no answer within {self.deadline_s:g} s"
        except Exception as exc:  # a bug or a case no backend foresaw: a failed call, not an HTTP 500
            log.exception("%s failed unexpectedly", spec.name)
            error = f"internal error in the tool gateway ({type(exc).__name__})"
        else:
            # cut before it is cached: the cache holds what the agent is shown, not a 5 MB page
            text = format_tool_result(render(result), self.max_result_chars)
            if spec is SEARCH or result.get("success"):  # failed reads may be transient: never cached
                await self.store.set(key, text, self.ttl[spec.name])
            return True, text, None
        log.warning("%s failed: %s", spec.name, error)
        failure = format_tool_failure(spec.server_name, spec.name, error)
        return False, format_tool_result(failure, self.max_result_chars), error
