"""The in-process engine: a transformers causal LM sampling on this machine (CPU or one GPU).

It keeps each trajectory's KV cache between turns: the next turn's input is the
previous input, the tokens just generated and the tool-result glue, so only the new
tokens are fed. The prompt's cache is shared by the G samples of a prompt (copied, not
recomputed). Sampling matches SGLang's semantics: log-probs are those of the
temperature-scaled distribution, top-p filters what may be sampled, and the stop
token is part of the output. Generation runs one request at a time in a worker
thread, so tool calls of other samples overlap with it.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

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


class InProcessEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        weight_version: int = 0,
        max_sessions: int = 64,
        share_prompts: bool = True,
        reuse_cache: bool = True,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.weight_version = weight_version
        self.max_sessions = max_sessions
        self.share_prompts = share_prompts
        self.reuse_cache = reuse_cache
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._prompts: OrderedDict[tuple[int, ...], _Session] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens_fed = 0  # prefill + decode tokens actually run through the model

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await asyncio.to_thread(self._generate, request)

    async def update_weights(self, path: str, version: int) -> None:
        def load() -> None:
            with self._lock:
                load_weights_into(self.model, path)
                self.weight_version = version
                self._sessions.clear()  # caches computed with the old weights are stale
                self._prompts.clear()

        await asyncio.to_thread(load)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        self._sessions.clear()
        self._prompts.clear()

    def forget(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    # -- generation -------------------------------------------------------------------
    def _start(self, request: GenerationRequest) -> _Session:
        """The longest cached prefix of the input: this trajectory's own, or its prompt's."""
        ids = request.input_ids
        if self.reuse_cache and request.session is not None:
            s = self._sessions.pop(request.session, None)
            if s is not None and len(s.ids) <= len(ids) and ids[: len(s.ids)] == s.ids:
                return s
        if self.reuse_cache and self.share_prompts:
            s = self._prompts.get(tuple(ids))
            if s is not None:
                self._prompts.move_to_end(tuple(ids))
                return _Session(list(s.ids), copy.deepcopy(s.cache), list(s.routes))
        return _Session([], DynamicCache(config=self.model.config), [])

    @torch.no_grad()
    def _forward(self, session: _Session, new_ids: list[int], recorder: RouteRecorder | None) -> torch.Tensor:
        """Feed ``new_ids`` after the session's tokens; returns the last position's logits."""
        start = len(session.ids)
        x = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(new_ids), device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=x, position_ids=pos, past_key_values=session.cache, use_cache=True, logits_to_keep=1
        )
        session.ids.extend(new_ids)
        if recorder is not None:
            session.routes.append(recorder.take())
        self.tokens_fed += len(new_ids)
        return out.logits[0, -1].float()

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        if not request.input_ids:
            raise ValueError("input_ids must not be empty")
        started = time.perf_counter()
        with self._lock:
            version = self.weight_version
            session = self._start(request)
            cached = len(session.ids)
            generator = torch.Generator(device="cpu")
            generator.manual_seed(
                request.seed if request.seed is not None else int.from_bytes(np.random.bytes(4), "little")
            )
            recorder = RouteRecorder(self.model) if request.return_routed_experts else None
            with recorder if recorder is not None else _null():
                pending = request.input_ids[cached:]
                if not pending:  # the whole input is cached: re-feed its last token to get its logits
                    session.cache.crop(-1)  # forget the last token; it is fed again below
                    session = _Session(
                        session.ids[:-1], session.cache, _crop_routes(session.routes, len(session.ids) - 1)
                    )
                    pending = request.input_ids[-1:]
                logits = self._forward(session, pending, recorder)
                if self.share_prompts and request.session is not None and cached == 0 and self.reuse_cache:
                    self._remember_prompt(session)
                output, logprobs, finish = [], [], "length"
                stops = set(request.stop_token_ids)
                while len(output) < request.max_new_tokens:
                    token, logprob = _sample(logits, request.temperature, request.top_p, generator)
                    output.append(token)
                    logprobs.append(logprob)
                    if token in stops:
                        finish = "stop"
                        break
                    if len(output) == request.max_new_tokens:
                        break
                    logits = self._forward(session, [token], recorder)
            routes = None
            if recorder is not None:
                all_routes = np.concatenate(session.routes, axis=0) if session.routes else None
                total = len(request.input_ids) + len(output) - 1  # every position but the last
                if all_routes is None or all_routes.shape[0] < total:
                    raise RuntimeError("routes were not recorded for every position")
                routes = all_routes[request.routed_experts_start_len : total]
            if request.session is not None and self.reuse_cache:
                self._sessions[request.session] = session
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
        return GenerationResult(
            output,
            logprobs,
            finish,
            version,
            routes,
            cached_tokens=cached,
            latency_s=time.perf_counter() - started,
        )

    def _remember_prompt(self, session: _Session) -> None:
        key = tuple(session.ids)
        if key not in self._prompts:
            self._prompts[key] = _Session(
                list(session.ids), copy.deepcopy(session.cache), list(session.routes)
            )
            while len(self._prompts) > 8:
                self._prompts.popitem(last=False)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _crop_routes(routes: list[np.ndarray], length: int) -> list[np.ndarray]:
    if not routes:
        return routes
    joined = np.concatenate(routes, axis=0)[:length]
    return [joined]


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
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # always keeps the top token
        filtered = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        probs = filtered / filtered.sum()
    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    return token, float(logp[token])
