"""SGLang over HTTP: ``/generate`` with input ids, log-probs and routed experts; weight updates.

Request (SGLang's ``GenerateReqInput``): ``input_ids``, ``sampling_params``
(``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids``,
``skip_special_tokens: false``, ``no_stop_trim: true``, ``sampling_seed``: honoured only by
servers started with ``--enable-deterministic-inference``, ignored otherwise),
``return_logprob: true`` (``logprob_start_len`` -1: output tokens only),
``return_routed_experts`` with ``routed_experts_start_len``.

Response: ``{"text", "output_ids", "meta_info"}``; ``meta_info.output_token_logprobs``
is a list of ``[logprob, token_id, text|null]``, ``finish_reason`` is
``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length": n}`` or
``{"type": "abort", "message": ...}``, ``routed_experts`` is base64 of int32
``[tokens - 1 - routed_experts_start_len, layers, top_k]``, ``weight_version`` the
server's tag of the weights that sampled the last token, and ``weight_versions`` the spans
``[{"version", "start", "end"}]`` of output tokens each version sampled.

A weight update pauses the servers with ``retract``: running requests give up their KV cache
and are prefilled again under the new weights, keeping the tokens and log-probs sampled so
far. Such a turn mixes versions; it is labelled with the oldest (its staleness is that of its
oldest token), and its routed experts all come from the new weights, since SGLang reads them
from the re-prefilled cache.

The output log-probs are of softmax(logits / T), SGLang's default, and the trainer's ratios
assume it (it divides by the run's temperature too): do not start the servers with
``SGLANG_RETURN_ORIGINAL_LOGPROB``, which reports them before temperature scaling.

Several servers are load-balanced with session affinity (a trajectory's turns go to
the same server, where its prefix is cached); a server that fails is skipped for a
cool-down and the request goes to the next one.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import re
import time

import httpx
import numpy as np

from services.rollout.engine import ContextFull, EngineError, GenerationRequest, GenerationResult
from services.sglang_control import (
    Guard,
    WeightsRefused,
    follow_broadcast,
    load_each,
    load_weights_from_disk,
    model_info,
    settle_flush,
    tag_version,
    unguarded,
)
from services.upstream import RetryPolicy, UpstreamError, http_client, send_with_retries

log = logging.getLogger(__name__)

# SGLang 0.5.23's refusals of a request for its context length (TokenizerManager._validate_one_request):
# input plus max_new_tokens past it, or the input alone at it
_CONTEXT_FULL = re.compile(
    r"exceeds the model's maximum context length of (\d+) tokens|is longer than the model's context length \((\d+) tokens\)"
)

__all__ = ["SglangEngine"]


class SglangEngine:
    def __init__(
        self,
        urls: list[str],
        *,
        http: httpx.AsyncClient | None = None,
        timeout_s: float = 3600.0,
        retry: RetryPolicy | None = None,
        cooldown_s: float = 30.0,
        layers: int | None = None,
        top_k: int | None = None,
        pause_mode: str = "retract",
        guard: Guard = unguarded,
    ) -> None:
        if not urls:
            raise ValueError("at least one SGLang URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._own = http is None
        self.http = http or http_client(timeout_s)
        self.retry = retry or RetryPolicy(max_attempts=3, base_delay_s=1.0)
        self.cooldown_s = cooldown_s
        self.pause_mode = pause_mode
        self.guard = guard  # one replica at a time pauses and loads a server (sglang_control.load_each)
        # the shape of the routed experts: SGLang's /model_info does not report it, so give one
        self.layers, self.top_k = layers, top_k
        self.weight_version = 0
        self._down_until: dict[str, float] = {}
        self._update_lock = asyncio.Lock()
        # what a server's refusal said its context length is (shorter than a request needed): later
        # requests to it ask for no more than fits. Forgotten at each weight update, so a server
        # restarted with a longer --context-length is asked for the whole budget again.
        self._context: dict[str, int] = {}

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    def _order(self, session: str | None) -> list[str]:
        """Servers to try, the session's own first; servers in cool-down last."""
        start = int(hashlib.sha1((session or str(time.monotonic_ns())).encode()).hexdigest(), 16) % len(
            self.urls
        )
        order = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return sorted(order, key=lambda u: self._down_until.get(u, 0) > now)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        sampling = {
            "temperature": request.temperature,
            "top_p": request.top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if request.stop_token_ids:
            sampling["stop_token_ids"] = list(request.stop_token_ids)
        if request.seed is not None:
            sampling["sampling_seed"] = request.seed
        payload = {"input_ids": request.input_ids, "sampling_params": sampling, "return_logprob": True}
        if request.return_routed_experts:
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = request.routed_experts_start_len
        errors = []
        for url in self._order(request.session):
            try:
                result = await self._generate_on(url, payload, request)
            except (UpstreamError, ValueError, KeyError, TypeError) as exc:
                errors.append(str(exc))
                if isinstance(exc, UpstreamError) and exc.status is not None and 400 <= exc.status < 500:
                    raise EngineError(str(exc)) from None  # a bad request fails the same everywhere
                self._down_until[url] = time.monotonic() + self.cooldown_s
                log.warning("sglang %s failed (%s); trying the next server", url, exc)
                continue
            return result
        raise EngineError("every SGLang server failed: " + " | ".join(errors))

    async def _generate_on(self, url: str, payload: dict, request: GenerationRequest) -> GenerationResult:
        """One server's answer, asking for no more new tokens than fit the context it has said it has.
        Refused for its context length, it is asked once more for what fits; :class:`ContextFull`
        when nothing does."""
        started = time.perf_counter()
        for _ in range(2):
            limit = self._context.get(url)
            new = request.max_new_tokens
            if limit is not None:
                new = min(new, limit - len(request.input_ids))
                if new <= 0:
                    raise ContextFull(f"sglang {url}: the input fills its {limit}-token context", limit)
            body = {**payload, "sampling_params": {**payload["sampling_params"], "max_new_tokens": new}}
            response = await send_with_retries(
                f"sglang {url}", lambda b=body: self.http.post(f"{url}/generate", json=b), self.retry
            )
            if response.status_code == 400 and (full := _CONTEXT_FULL.search(response.text)):
                self._learn_context(url, int(full.group(1) or full.group(2)))
                continue
            if response.status_code >= 400:
                raise UpstreamError(
                    f"sglang {url}",
                    f"HTTP {response.status_code}: {response.text[:300]}",
                    status=response.status_code,
                )
            result = self._parse(response.json(), request, time.perf_counter() - started)
            return dataclasses.replace(result, context_limited=new < request.max_new_tokens)
        raise ContextFull(
            f"sglang {url} refused what its context length leaves room for", self._context.get(url)
        )

    def _learn_context(self, url: str, limit: int) -> None:
        if self._context.get(url) != limit:
            log.error(
                "sglang %s: its context is %d tokens, shorter than the run's requests need: trajectories "
                "end at it (as max_context). Start it with --context-length >= rollout.max_context",
                url,
                limit,
            )
        self._context[url] = limit

    def _parse(self, data: dict, request: GenerationRequest, latency: float) -> GenerationResult:
        meta = data["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        output_ids = [int(x) for x in data.get("output_ids") or [e[1] for e in entries]]
        if len(entries) != len(output_ids) or any(
            int(e[1]) != t for e, t in zip(entries, output_ids, strict=True)
        ):
            raise ValueError("output_token_logprobs do not match output_ids")
        logprobs = [float(e[0]) for e in entries]
        finish = meta.get("finish_reason") or {"type": "length"}
        kind = finish.get("type", "length")
        if kind not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {finish!r}")
        routes = None
        if request.return_routed_experts and kind != "abort":
            routes = self._routes(meta.get("routed_experts"), request, len(output_ids))
        return GenerationResult(
            output_ids,
            logprobs,
            kind,
            self._version(meta),
            routes,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            message=str(finish.get("message", "")),
            latency_s=latency,
        )

    def _version(self, meta: dict) -> int:
        """The oldest weights that sampled any token of this turn (see the module docstring and
        :func:`tag_version`); ours where the server names none."""
        tags = [span.get("version") for span in meta.get("weight_versions") or []]
        named = [v for t in [*tags, meta.get("weight_version")] if (v := tag_version(t)) is not None]
        return min(named, default=self.weight_version)

    def _routes(self, encoded: str | None, request: GenerationRequest, n_out: int) -> np.ndarray:
        if not encoded:
            raise ValueError("routed_experts missing: start SGLang with --enable-return-routed-experts")
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        positions = len(request.input_ids) + n_out - 1 - request.routed_experts_start_len
        if positions <= 0 or flat.size % positions:
            raise ValueError(f"routed_experts has {flat.size} values for {positions} positions")
        per = flat.size // positions
        top_k = self.top_k or (per // self.layers if self.layers else None)
        if top_k is None or per % top_k:
            raise ValueError("set layers/top_k to decode routed_experts")
        return flat.reshape(positions, per // top_k, top_k)

    async def update_weights(self, path: str, version: int, timeline: str = "") -> None:
        """Pause each server that does not serve the checkpoint yet, load it, flush caches, continue."""
        async with self._update_lock:
            await load_each(self, path, version, self._reload, timeline=timeline)
            self.weight_version = version
            self._context.clear()

    async def recheck(self, path: str, version: int, timeline: str = "") -> None:
        """Load the checkpoint on each server that no longer serves it: one restarted serves the
        model it started with (``PolicyWorker._recheck``)."""
        async with self._update_lock:
            await load_each(self, path, version, self._reload_restarted, timeline=timeline)

    async def _reload_restarted(self, url: str, path: str, version: int, timeline: str) -> None:
        self._context.pop(url, None)  # restarted, perhaps with another --context-length
        await self._reload(url, path, version, timeline)

    async def follow_broadcast(self, version: int, path: str, disk_version: int, timeline: str = "") -> None:
        """The trainer broadcast ``version`` of ``timeline`` to the servers in its weight group; the
        ones that missed it load the disk copy (``path``, ``disk_version``). The engine's version is
        the oldest served."""
        async with self._update_lock:
            oldest = await follow_broadcast(
                self, version, (path, disk_version), self._reload, timeline=timeline
            )
            if oldest is not None:
                self.weight_version = oldest

    async def _reload(self, url: str, path: str, version: int, timeline: str) -> None:
        await self._post(url, "/pause_generation", {"mode": self.pause_mode})
        try:
            try:
                unflushed = await load_weights_from_disk(
                    self.http, url, path, version, self.retry, timeline=timeline
                )
            finally:
                await self._post(url, "/continue_generation", {})
            if unflushed:  # flushed once the requests the pause held have finished
                await settle_flush(self.http, url, path, version, self.retry, timeline=timeline)
        except WeightsRefused as exc:
            raise EngineError(str(exc)) from None

    async def _post(self, url: str, path: str, body: dict) -> dict:
        response = await send_with_retries(
            f"sglang {url}", lambda: self.http.post(f"{url}{path}", json=body), self.retry
        )
        if response.status_code >= 400:
            raise EngineError(f"{url}{path}: HTTP {response.status_code} {response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            return {}

    async def health(self) -> bool:
        ok = False
        for url in self.urls:
            try:
                r = await self.http.get(f"{url}/health", timeout=5)
                healthy = r.status_code == 200
            except httpx.HTTPError:
                healthy = False
            ok = ok or healthy
        return ok

    async def model_info(self) -> dict:
        return await model_info(self.http, self.urls[0], self.retry)
