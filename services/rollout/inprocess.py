"""The in-process engine: a transformers causal LM sampling on this machine (CPU or one GPU).

It keeps each trajectory's KV cache between turns: the next turn's input is the
previous input, the tokens just generated and the tool-result glue, so only the new
tokens are fed. The prompt's cache is shared by the G samples of a prompt (copied, not
recomputed). Sampling matches SGLang's semantics: log-probs are those of the
temperature-scaled distribution, top-p filters what may be sampled, and the stop
token is part of the output.

Requests are served in waves by one worker thread: every request waiting when a wave
starts is prefilled on its own (from its cached prefix), then all of them decode
together, one token per row per forward, their caches left-padded into one batch and
split back when the wave ends. The G samples of a prompt move through their turns
roughly together, so a wave is usually G wide; tool calls of other trajectories
overlap with it.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import inspect
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from services.model.checkpoint import load_weights_into
from services.model.routing import RouteRecorder
from services.rollout.engine import GenerationRequest, GenerationResult

__all__ = ["InProcessEngine"]


@dataclass
class _Session:
    ids: list[int]  # tokens whose keys and values are in ``cache``
    cache: DynamicCache
    routes: list[np.ndarray]  # routes of those tokens, in chunks


@dataclass
class _Job:
    request: GenerationRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    session: _Session | None = None
    cached: int = 0
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    started: float = 0.0


class InProcessEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        weight_version: int = 0,
        max_sessions: int = 64,
        share_prompts: bool = True,
        reuse_cache: bool = True,
        max_batch: int = 16,
    ) -> None:
        self.model = model.eval()
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name
        # warns, and goes in 5.40); earlier 5.x know only the old one
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.device = next(model.parameters()).device
        self.weight_version = weight_version
        self.max_sessions = max_sessions
        self.share_prompts = share_prompts
        self.reuse_cache = reuse_cache
        self.max_batch = max_batch
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._prompts: OrderedDict[tuple[int, ...], _Session] = OrderedDict()
        self._lock = threading.Lock()  # the model and the caches belong to one wave (or one reload) at a time
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._forget: collections.deque[str] = collections.deque()
        self.tokens_fed = 0  # prefill + decode tokens run through the model
        self.waves = 0

    # -- the async interface ----------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not request.input_ids:
            raise ValueError("input_ids must not be empty")
        loop = asyncio.get_running_loop()
        job = _Job(request, loop.create_future(), loop)
        self._ensure_worker()
        self._queue.put(job)
        return await job.future

    async def update_weights(self, path: str, version: int) -> None:
        def load() -> None:
            with self._lock:
                load_weights_into(self.model, path)
                self.weight_version = version
                self._sessions.clear()  # caches computed with the old weights are stale
                self._prompts.clear()

        await asyncio.to_thread(load)

    async def health(self) -> bool:
        return self._worker is None or self._worker.is_alive()

    async def aclose(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._worker.join, 30)
            self._worker = None
        self._sessions.clear()
        self._prompts.clear()

    def forget(self, session: str) -> None:
        """Drop a finished trajectory's cache (at the start of the next wave: never blocks the caller)."""
        self._forget.append(session)

    # -- the worker ------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._serve, name="inprocess-engine", daemon=True)
            self._worker.start()

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < self.max_batch:  # everything already waiting joins this wave
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
            try:
                with self._lock:
                    self._wave(jobs)
            except BaseException as exc:  # a failed wave fails its requests, not the engine
                for j in jobs:
                    if not j.future.done():
                        j.loop.call_soon_threadsafe(_set_exception, j.future, exc)

    @torch.no_grad()
    def _wave(self, jobs: list[_Job]) -> None:
        while self._forget:
            self._sessions.pop(self._forget.popleft(), None)
        self.waves += 1
        version = self.weight_version
        record = any(j.request.return_routed_experts for j in jobs)
        recorder = RouteRecorder(self.model) if record else None
        with recorder if recorder is not None else _null():
            logits = []
            for j in jobs:
                j.started = time.perf_counter()
                j.generator = torch.Generator(device="cpu")
                seed = (
                    j.request.seed
                    if j.request.seed is not None
                    else int.from_bytes(np.random.bytes(4), "little")
                )
                j.generator.manual_seed(seed)
                j.session, j.cached = self._start(j.request)
                pending = j.request.input_ids[len(j.session.ids) :]
                logits.append(self._prefill(j, pending, recorder))
            for j, lg in zip(jobs, logits, strict=True):
                self._sample(j, lg)
            active = [j for j in jobs if j.finish is None]
            if active:
                self._decode(active, recorder)
        for j in jobs:
            self._finish(j, version)

    def _start(self, request: GenerationRequest) -> tuple[_Session, int]:
        """The longest cached prefix of the input: this trajectory's own, or its prompt's."""
        ids = request.input_ids
        if self.reuse_cache and request.session is not None:
            s = self._sessions.pop(request.session, None)
            if s is not None and len(s.ids) <= len(ids) and ids[: len(s.ids)] == s.ids:
                return self._usable(s, ids), len(s.ids)
        if self.reuse_cache and self.share_prompts:
            s = self._prompts.get(tuple(ids))
            if s is not None:
                self._prompts.move_to_end(tuple(ids))
                copied = _Session(list(s.ids), copy.deepcopy(s.cache), list(s.routes))
                return self._usable(copied, ids), len(s.ids)
        return _Session([], DynamicCache(config=self.model.config), []), 0

    @staticmethod
    def _usable(s: _Session, ids: list[int]) -> _Session:
        """A session whose cache covers the whole input forgets its last token, which is fed again
        to get the logits of the first new token."""
        if len(s.ids) == len(ids):
            s.cache.crop(-1)
            s.ids = s.ids[:-1]
            s.routes = _crop_routes(s.routes, len(s.ids))
        return s

    def _prefill(self, job: _Job, tokens: list[int], recorder: RouteRecorder | None) -> torch.Tensor:
        s = job.session
        start = len(s.ids)
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        out = self.model(
            input_ids=x, position_ids=pos, use_cache=True, logits_to_keep=1, **{self._cache_arg: s.cache}
        )
        s.ids.extend(tokens)
        if recorder is not None:
            s.routes.append(recorder.take())
        self.tokens_fed += len(tokens)
        if self.share_prompts and self.reuse_cache and job.request.session is not None and job.cached == 0:
            self._remember_prompt(s)
        return out.logits[0, -1].float()

    def _sample(self, job: _Job, logits: torch.Tensor) -> None:
        r = job.request
        token, logprob = _sample(logits, r.temperature, r.top_p, job.generator)
        job.output.append(token)
        job.logprobs.append(logprob)
        if token in r.stop_token_ids:
            job.finish = "stop"
        elif len(job.output) >= r.max_new_tokens:
            job.finish = "length"

    def _decode(self, jobs: list[_Job], recorder: RouteRecorder | None) -> None:
        """Decode the jobs together until every one has finished; a finished row takes its cache
        out of the batch and leaves it, so later forwards run only the rows still generating."""
        lengths = [len(j.session.ids) for j in jobs]
        width = max(lengths)
        batch = _merge_caches([j.session.cache for j in jobs], lengths, width, self.model.config)
        mask = torch.zeros((len(jobs), width), dtype=torch.long, device=self.device)
        for b, n in enumerate(lengths):
            mask[b, width - n :] = 1
        starts = [width - n for n in lengths]  # each row's first real column
        rows = list(jobs)
        while rows:
            tokens = torch.tensor([[j.output[-1]] for j in rows], dtype=torch.long, device=self.device)
            positions = torch.tensor([[len(j.session.ids)] for j in rows], device=self.device)
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=self.device)], dim=1)
            out = self.model(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                **{self._cache_arg: batch},
            )
            step_routes = recorder.take() if recorder is not None else None
            self.tokens_fed += len(rows)
            for b, j in enumerate(rows):
                j.session.ids.append(j.output[-1])
                if step_routes is not None:
                    j.session.routes.append(step_routes[b : b + 1])
                self._sample(j, out.logits[b, -1].float())
            keep = [b for b, j in enumerate(rows) if j.finish is None]
            if len(keep) == len(rows):
                continue
            for b, j in enumerate(rows):
                if j.finish is not None:
                    j.session.cache = _split_cache(batch, b, starts[b], mask.shape[1], self.model.config)
            if keep:
                batch.batch_select_indices(torch.tensor(keep, device=self.device))
                mask = mask[keep]
            rows = [rows[b] for b in keep]
            starts = [starts[b] for b in keep]

    def _finish(self, job: _Job, version: int) -> None:
        r = job.request
        routes = None
        if r.return_routed_experts:
            all_routes = np.concatenate(job.session.routes, axis=0) if job.session.routes else None
            total = len(r.input_ids) + len(job.output) - 1  # every position but the last
            if all_routes is None or all_routes.shape[0] < total:
                raise RuntimeError("routes were not recorded for every position")
            routes = all_routes[r.routed_experts_start_len : total]
        if r.session is not None and self.reuse_cache:
            self._sessions[r.session] = job.session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        result = GenerationResult(
            job.output,
            job.logprobs,
            job.finish or "length",
            version,
            routes,
            cached_tokens=job.cached,
            latency_s=time.perf_counter() - job.started,
        )
        job.loop.call_soon_threadsafe(_set_result, job.future, result)

    def _remember_prompt(self, session: _Session) -> None:
        key = tuple(session.ids)
        if key not in self._prompts:
            self._prompts[key] = _Session(
                list(session.ids), copy.deepcopy(session.cache), list(session.routes)
            )
            while len(self._prompts) > 8:
                self._prompts.popitem(last=False)


def _merge_caches(caches: list[DynamicCache], lengths: list[int], width: int, config) -> DynamicCache:
    """One batch cache: each row's keys and values left-padded with zeros to ``width``."""
    merged = DynamicCache(config=config)
    for layer in range(len(caches[0].layers)):
        keys, values = [], []
        for cache, n in zip(caches, lengths, strict=True):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
            pad = width - n
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
        merged.update(torch.cat(keys), torch.cat(values), layer)
    return merged


def _split_cache(batch: DynamicCache, row: int, start: int, end: int, config) -> DynamicCache:
    """Row ``row``'s keys and values from ``start`` (its first real position) to ``end``."""
    cache = DynamicCache(config=config)
    for layer in range(len(batch.layers)):
        k = batch.layers[layer].keys[row : row + 1, :, start:end].clone()
        v = batch.layers[layer].values[row : row + 1, :, start:end].clone()
        cache.update(k, v, layer)
    return cache


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _crop_routes(routes: list[np.ndarray], length: int) -> list[np.ndarray]:
    if not routes:
        return routes
    return [np.concatenate(routes, axis=0)[:length]]


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[int, float]:
    """One token and its log-prob under the temperature-scaled distribution."""
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return token, float(logp[token])


# Tokens the nucleus is first looked for among: sorting the whole vocabulary for every sampled
# token was a third of an evaluation's time here (top-p 0.95, a 4096-token vocabulary).
NUCLEUS_CANDIDATES = 64


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` outside the top-p nucleus set to zero, renormalised: a token is kept when the
    tokens more likely than it hold less than ``top_p`` (so the top token always is). The top
    ``NUCLEUS_CANDIDATES`` tokens hold the whole nucleus whenever they hold ``top_p`` (the token
    after them has at least that before it); otherwise the whole vocabulary is sorted."""
    ranked, order = torch.topk(probs, min(NUCLEUS_CANDIDATES, probs.numel()))
    mass = torch.cumsum(ranked, dim=-1)
    if float(mass[-1]) < top_p + 1e-6 and ranked.numel() < probs.numel():  # the margin: rounding
        ranked, order = torch.sort(probs, descending=True)
        mass = torch.cumsum(ranked, dim=-1)
    keep = mass - ranked < top_p
    filtered = torch.zeros_like(probs).scatter_(0, order[keep], ranked[keep])
    return filtered / filtered.sum()
