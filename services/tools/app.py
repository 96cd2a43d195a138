"""The tool gateway's HTTP API.

    GET  /health   ready when the backend is loaded
    GET  /tools    the catalogue: servers, tools, descriptions, JSON input schemas
    POST /call     {server_name, tool_name, arguments, trajectory_id?, call_index?} -> {ok, text, cached, ...}
    GET  /metrics  Prometheus

A tool failure is a 200 whose ``text`` says so (the agent reads it and carries on);
an unknown tool is a 404 and invalid arguments a 422, each naming the field; a body over
``max_body_bytes`` is a 413 before it is read. The gateway has no authentication: it serves
the rollout workers inside the cluster and is never exposed beyond it.

``/call`` is the hot path of every rollout. It reads and validates its body itself (pydantic's
JSON parser straight from the bytes), answers pre-encoded JSON, and its route hands it the
request directly (:class:`DirectRoute`): FastAPI's per-request dependency solving and response
handling would cost more than a cached answer does. Its error bodies never echo the input, so a
NaN or an infinity in a request cannot break the answer.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.bus import redis_client
from services.gc_freeze import frozen_while_serving
from services.http_guard import field_errors
from services.llm import ChatClient, LlmSettings
from services.search.corpus import OfflineCorpus
from services.telemetry import add_metrics_route, setup_logging
from services.tools.backends import OfflineBackend
from services.tools.cpu import CpuPool
from services.tools.fetch import PlainFetcher
from services.tools.gateway import InvalidCall, ToolGateway
from services.tools.resilience import Upstream, UpstreamLimits
from services.tools.settings import ToolsSettings
from services.tools.store import MemoryStore, RedisStore
from services.tools.web import JinaReader, LlmSummariser, SerperSearch, WebBackend
from services.upstream import RetryPolicy


class CallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server_name: str = Field(min_length=1, max_length=200)
    tool_name: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)
    trajectory_id: str | None = Field(
        default=None, max_length=200, description="counts the call against this trajectory's budget"
    )
    call_index: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000_000,
        description="the call's place among its trajectory's calls, from 0: the budget refuses places "
        "past it, and a call sent again under the same place counts once",
    )


class CallResponse(BaseModel):
    ok: bool
    text: str
    cached: bool
    merged: bool
    latency_s: float
    error: str | None = None


class BodyTooLarge(Exception):
    pass


class DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns the ``Response`` itself: it keeps
    its OpenAPI description (request and response models, status codes) but skips the dependency
    solving and response validation FastAPI runs for every call of an ordinary route."""

    def get_route_handler(self):
        return self.endpoint


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (BodyTooLarge) past ``limit`` bytes before more is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def build_backend(settings: ToolsSettings, http: httpx.AsyncClient, cpu: CpuPool):
    if settings.backend == "offline":
        return OfflineBackend(OfflineCorpus.from_jsonl(settings.corpus), cpu)
    fetcher = PlainFetcher(
        allow=tuple(settings.allow_hosts),
        max_bytes=settings.fetch_max_bytes,
        timeout_s=settings.fetch_timeout_s,
        cpu=cpu,
        resolver_threads=settings.resolver_threads,
    )
    serper = SerperSearch(
        http,
        Upstream("serper", UpstreamLimits(settings.serper_concurrency, settings.serper_rate_per_s)),
        base_url=settings.serper_url,
        api_key=settings.serper_api_key,
        blocked_hosts=tuple(settings.blocked_result_hosts),
        max_num=settings.serper_max_num,
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
            max_bytes=settings.fetch_max_bytes,
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
    return WebBackend(
        serper, jina, fetcher, summariser, max_content_chars=settings.summariser_max_content_chars
    )


def create_app(settings: ToolsSettings | None = None) -> FastAPI:
    settings = settings or ToolsSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        setup_logging(settings.log_level, settings.secrets())
        http = httpx.AsyncClient(timeout=settings.upstream_timeout_s)
        # no retries: while Redis is out of reach the store answers from the process at once
        client = redis_client(settings.redis_url) if settings.use_redis else None
        store = (
            RedisStore(
                client,
                settings.stream_prefix,
                near_items=settings.near_cache_items,
                near_bytes=settings.near_cache_mb << 20,
                near_ttl_s=settings.near_cache_ttl_s,
                redis_share=settings.cache_redis_share,
            )
            if client
            else MemoryStore(max_bytes=settings.near_cache_mb << 20)
        )
        cpu = CpuPool(settings.cpu_workers, nice=settings.cpu_nice)
        backend = build_backend(settings, http, cpu)
        app.state.gateway = ToolGateway(
            backend,
            store,
            search_ttl_s=settings.search_ttl_s,
            read_ttl_s=settings.read_ttl_s,
            max_result_chars=settings.max_result_chars,
            call_budget=settings.call_budget,
            deadline_s=settings.call_deadline_s,
            answers_tag=settings.answers_tag(),
        )
        try:
            # the corpus is millions of objects that live as long as the process
            with frozen_while_serving("the tool gateway"):
                yield
        finally:
            if hasattr(backend, "aclose"):
                await backend.aclose()
            await http.aclose()
            if client is not None:
                await client.aclose()
            cpu.close()

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

    async def call(request: Request) -> Response:
        try:
            body = CallRequest.model_validate_json(await read_body(request, settings.max_body_bytes))
        except BodyTooLarge:
            return JSONResponse(
                {"detail": f"the request body is over {settings.max_body_bytes} bytes"}, status_code=413
            )
        except ValidationError as exc:
            return JSONResponse({"detail": field_errors(exc.errors(), ("body",))}, status_code=422)
        gw: ToolGateway = request.app.state.gateway
        out = await gw.call(
            body.server_name,
            body.tool_name,
            body.arguments,
            trajectory_id=body.trajectory_id,
            call_index=body.call_index,
        )
        answer = CallResponse(
            ok=out.ok,
            text=out.text,
            cached=out.cached,
            merged=out.merged,
            latency_s=out.latency_s,
            error=out.error,
        )
        return Response(answer.model_dump_json(), media_type="application/json")

    app.router.add_api_route(
        "/call",
        call,
        methods=["POST"],
        route_class_override=DirectRoute,
        response_model=CallResponse,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": CallRequest.model_json_schema()}},
            }
        },
        responses={413: {"description": "the body is over the size limit"}, 404: {}, 422: {}},
    )
    # routes are matched in order: the hot path first, before the documentation's routes
    app.router.routes.insert(0, app.router.routes.pop())
    return app
