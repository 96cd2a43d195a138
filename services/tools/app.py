"""The tool gateway's HTTP API.

    GET  /health   ready when the backend is loaded
    GET  /tools    the catalogue: servers, tools, descriptions, JSON input schemas
    POST /call     {server_name, tool_name, arguments, trajectory_id?} -> {ok, text, cached, ...}
    GET  /metrics  Prometheus

A tool failure is a 200 whose ``text`` says so (the agent reads it and carries on);
an unknown tool is a 404 and invalid arguments a 422, each naming the field.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from services.bus import redis_client
from services.llm import ChatClient, LlmSettings
from services.telemetry import add_metrics_route, setup_logging
from services.tools.backends import OfflineBackend
from services.tools.corpus import OfflineCorpus
from services.tools.fetch import PlainFetcher
from services.tools.gateway import InvalidCall, ToolGateway
from services.tools.resilience import Upstream, UpstreamLimits
from services.tools.settings import ToolsSettings
from services.tools.store import MemoryStore, RedisStore
from services.tools.web import JinaReader, LlmSummariser, SerperSearch, WebBackend
from services.upstream import RetryPolicy


class CallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server_name: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    trajectory_id: str | None = Field(
        default=None, max_length=200, description="counts the call against this trajectory's budget"
    )


class CallResponse(BaseModel):
    ok: bool
    text: str
    cached: bool
    merged: bool
    latency_s: float
    error: str | None = None


def build_backend(settings: ToolsSettings, http: httpx.AsyncClient):
    if settings.backend == "offline":
        return OfflineBackend(OfflineCorpus.from_jsonl(settings.corpus))
    fetcher = PlainFetcher(
        allow=tuple(settings.allow_hosts),
        max_bytes=settings.fetch_max_bytes,
        timeout_s=settings.fetch_timeout_s,
    )
    serper = SerperSearch(
        http,
        Upstream("serper", UpstreamLimits(settings.serper_concurrency, settings.serper_rate_per_s)),
        base_url=settings.serper_url,
        api_key=settings.serper_api_key,
        blocked_hosts=tuple(settings.blocked_result_hosts),
    )
    jina = None
    if settings.use_jina:
        jina = JinaReader(
            http,
            Upstream(
                "jina",
                UpstreamLimits(
                    settings.jina_concurrency, settings.jina_rate_per_s, retry=RetryPolicy(max_attempts=2)
                ),
            ),
            base_url=settings.jina_url,
            api_key=settings.jina_api_key,
        )
    summariser = None
    if settings.summariser_base_url:
        llm = LlmSettings(
            settings.summariser_base_url,
            settings.summariser_model,
            settings.summariser_api_key,
            timeout_s=settings.upstream_timeout_s,
        )
        summariser = LlmSummariser(
            ChatClient(llm, http=http, name="summariser"),
            max_content_chars=settings.summariser_max_content_chars,
            concurrency=settings.summariser_concurrency,
            temperature=None if settings.summariser_omit_temperature else settings.summariser_temperature,
        )
    return WebBackend(serper, jina, fetcher, summariser)


def create_app(settings: ToolsSettings | None = None) -> FastAPI:
    settings = settings or ToolsSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        setup_logging(settings.log_level, settings.secrets())
        http = httpx.AsyncClient(timeout=settings.upstream_timeout_s)
        # no retries: while Redis is out of reach the store answers from the process at once
        client = redis_client(settings.redis_url) if settings.use_redis else None
        store = RedisStore(client, settings.stream_prefix) if client else MemoryStore()
        backend = build_backend(settings, http)
        app.state.gateway = ToolGateway(
            backend,
            store,
            search_ttl_s=settings.search_ttl_s,
            read_ttl_s=settings.read_ttl_s,
            max_result_chars=settings.max_result_chars,
            call_budget=settings.call_budget,
            deadline_s=settings.call_deadline_s,
        )
        try:
            yield
        finally:
            if hasattr(backend, "aclose"):
                await backend.aclose()
            await http.aclose()
            if client is not None:
                await client.aclose()

    app = FastAPI(title="pbsd tool gateway", version="0.1.0", lifespan=lifespan)
    add_metrics_route(app)

    @app.exception_handler(InvalidCall)
    async def invalid_call(request: Request, exc: InvalidCall) -> JSONResponse:
        return JSONResponse({"detail": exc.errors}, status_code=exc.status)

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        return {"status": "ok", "backend": request.app.state.gateway.backend.name}

    @app.get("/tools")
    async def tools(request: Request) -> dict[str, Any]:
        return {"servers": request.app.state.gateway.catalogue()}

    @app.post("/call", response_model=CallResponse)
    async def call(body: CallRequest, request: Request) -> CallResponse:
        gw: ToolGateway = request.app.state.gateway
        out = await gw.call(
            body.server_name, body.tool_name, body.arguments, trajectory_id=body.trajectory_id
        )
        return CallResponse(
            ok=out.ok,
            text=out.text,
            cached=out.cached,
            merged=out.merged,
            latency_s=out.latency_s,
            error=out.error,
        )

    return app
