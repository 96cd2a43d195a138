"""The in-process engine: a transformers causal LM sampling on this machine (CPU or one GPU).

Continuous batching. One worker thread loops: it admits every waiting request (each prefilled
alone from its cached prefix, its first token sampled), then every sequence still generating
decodes one token in a single batched forward, and sequences that stopped leave the batch. A
request waits at most one decode step (and the prefills admitted with it) to join, never for
other requests to finish, so the trajectories of a step that are generating at the same time
share forwards whatever their tool calls are doing.

Batching never changes an output. Decoding is row-wise (``services/rollout/rowwise.py``: each
row's arithmetic is the same in any batch) and each request draws from its own generator
(``services/rollout/sampling.py``), so a request's tokens and log-probs are bitwise those it
gets alone, whatever ran beside it and whenever it arrived. What they do depend on: the
weights, the input, the seed, and the machine's floating-point kernels (another instruction
set or library version rounds differently).

KV caches persist between turns. Each trajectory (``session``) keeps its keys and values: the
next turn's input is the previous input, the tokens just generated and the tool-result glue,
so only the new tokens are fed. A first turn stores its prompt's cache up to the last token,
and the other G - 1 samples of the prompt copy it instead of recomputing it; every first turn
feeds that last token on its own, so a sample computes the same bits whether it found the
prompt cached or not. Sampling matches SGLang's semantics: log-probs are those of the
temperature-scaled distribution, top-p filters what may be sampled, and the stop token is part
of the output.

A session evicted from the cache (more than ``max_sessions`` trajectories alive) is prefilled
again in full: correct, slower, and no longer bitwise the same as incremental decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import queue
import threading
import time
from collections import OrderedDict, deque

import numpy as np
import torch
from transformers import PreTrainedModel

from services.model.checkpoint import load_weights_into
from services.model.routing import RouteRecorder
from services.rollout import rowwise
from services.rollout.engine import EngineError, GenerationRequest, GenerationResult
from services.rollout.jobs import STOP, Hold, Job, Reload, Session, crop_routes, set_exception, set_result
from services.rollout.sampling import sample_rows
from services.weights.receiver import TORN

__all__ = ["InProcessEngine"]


class InProcessEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        weight_version: int = 0,
        max_sessions: int = 128,
        share_prompts: bool = True,
        reuse_cache: bool = True,
        max_batch: int = 64,
    ) -> None:
        self.model = model.eval()
        rowwise.install(self.model)
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name
        # warns, and goes in 5.40); earlier 5.x know only the old one
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.device = next(model.parameters()).device
        self._layers = model.config.num_hidden_layers
        self._recorder = RouteRecorder(self.model)
        self.weight_version = weight_version
        self.max_sessions = max_sessions
        self.share_prompts = share_prompts
        self.reuse_cache = reuse_cache
        self.max_batch = max_batch
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._prompts: OrderedDict[tuple[int, ...], Session] = OrderedDict()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._forget: deque[str] = deque()
        self._hold: Hold | None = None
        self._deferred: list[Job] = []  # requests that came while the weights were torn
        self.tokens_fed = 0  # prefill + decode tokens run through the model
        self.decode_steps = 0  # batched decode forwards
        self.decoded_rows = 0  # rows over all decode forwards (/ decode_steps: the mean batch)

    # -- the async interface ----------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not request.input_ids:
            raise ValueError("input_ids must not be empty")
        loop = asyncio.get_running_loop()
        job = Job(request, loop.create_future(), loop, time.perf_counter())
        self._ensure_worker()
        self._queue.put(job)
        return await job.future

    async def update_weights(self, path: str, version: int, timeline: str = "") -> None:
        """Load new weights once the sequences decoding now have finished their turn (requests
        queued after this call wait for it); every cache is dropped. (The worker keeps
        ``timeline``: in-process weights are its own to tell apart.)"""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._ensure_worker()
        self._queue.put(Reload(path, version, done))
        await asyncio.wrap_future(done)

    # -- a receiver of broadcast weights (services.weights.receiver.Holdable) --------------------
    @property
    def weights_version(self) -> int:
        return self.weight_version

    async def hold(self) -> None:
        """Park the worker once the sequences decoding now have finished their turn."""
        self._hold = Hold()
        self._ensure_worker()
        self._queue.put(self._hold)
        await asyncio.wrap_future(self._hold.parked)

    async def release(self, version: int | None) -> None:
        """Resume; new weights drop every cache. Torn weights admit nothing until a reload."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.version = version
            hold.resume.set()

    async def health(self) -> bool:
        return self._worker is None or self._worker.is_alive()

    async def aclose(self) -> None:
        if self._worker is not None:
            self._queue.put(STOP)
            await asyncio.to_thread(self._worker.join, 30)
            self._worker = None
        self._sessions.clear()
        self._prompts.clear()

    def forget(self, session: str) -> None:
        """Drop a finished trajectory's cache (before the next step: never blocks the caller)."""
        self._forget.append(session)

    # -- the worker ------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._serve, name="inprocess-engine", daemon=True)
            self._worker.start()

    def _serve(self) -> None:
        running: list[Job] = []
        control = None  # a reload or the stop, carried out once the running sequences finish
        with torch.no_grad():
            while True:
                jobs = []
                torn = self.weight_version == TORN
                if control is None:
                    ready = bool(self._deferred) and not torn
                    jobs, control = self._take(
                        block=not (running or ready), room=self.max_batch - len(running)
                    )
                jobs, self._deferred = ([], self._deferred + jobs) if torn else (self._deferred + jobs, [])
                while self._forget:
                    self._sessions.pop(self._forget.popleft(), None)
                if jobs:
                    running += self._guarded(jobs, self._admit)
                if running:
                    running = self._guarded(running, self._step)
                if running or control is None:
                    continue
                if control is STOP:
                    self._fail_queued()
                    return
                self._park(control) if isinstance(control, Hold) else self._reload(control)
                control = None

    def _take(self, *, block: bool, room: int) -> tuple[list[Job], object]:
        """Waiting requests, up to ``room`` (blocking for the first when nothing runs), and the
        reload or stop found behind them, which closes admission."""
        jobs: list[Job] = []
        while len(jobs) < room:
            try:
                item = self._queue.get() if block and not jobs else self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                jobs.append(item)
            else:
                return jobs, item
        return jobs, None

    def _guarded(self, jobs: list[Job], work) -> list[Job]:
        """``work(jobs)``; if it raises, those requests fail, not the engine."""
        try:
            return work(jobs)
        except Exception as exc:  # handed to every caller of the failed forward
            for j in jobs:
                j.loop.call_soon_threadsafe(set_exception, j.future, exc)
            return []

    def _park(self, hold: Hold) -> None:
        if not set_result(hold.parked, None):  # its holder gave up: no one would resume the engine
            return
        hold.resume.wait()
        if hold.version is not None:
            self._new_weights(hold.version)

    def _fail_queued(self) -> None:
        for job in self._deferred:
            job.loop.call_soon_threadsafe(set_exception, job.future, EngineError("engine closed"))
        self._deferred = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                item.loop.call_soon_threadsafe(set_exception, item.future, EngineError("engine closed"))
            elif isinstance(item, Reload):
                set_exception(item.done, EngineError("engine closed"))
            elif isinstance(item, Hold):
                set_exception(item.parked, EngineError("engine closed"))

    def _reload(self, reload: Reload) -> None:
        if reload.done.cancelled():  # its caller gave up (a worker stopping): the weights stay
            return
        try:
            load_weights_into(self.model, reload.path)
        except Exception as exc:  # the caller gets it
            set_exception(reload.done, exc)
            return
        self._new_weights(reload.version)
        set_result(reload.done, None)

    def _new_weights(self, version: int) -> None:
        self.weight_version = version
        self._sessions.clear()  # caches computed with the old weights are stale
        self._prompts.clear()

    # -- admission: a prefill per request ---------------------------------------------------
    def _admit(self, jobs: list[Job]) -> list[Job]:
        ready, logits = [], []
        for j in jobs:
            if j.future.cancelled():  # its caller left while it queued
                continue
            r = j.request
            j.version = self.weight_version
            j.generator = torch.Generator(device="cpu")
            seed = r.seed if r.seed is not None else int.from_bytes(np.random.bytes(4), "little")
            j.generator.manual_seed(seed)
            try:
                j.session, j.cached = self._start(r)
                logits.append(self._prefill(j))
            except Exception as exc:  # this request fails, not the others
                j.loop.call_soon_threadsafe(set_exception, j.future, exc)
                continue
            ready.append(j)
        if not ready:
            return []
        self._sample(ready, torch.stack(logits))
        return self._retire(ready)

    def _start(self, request: GenerationRequest) -> tuple[Session, int]:
        """The longest cached prefix of the input: this trajectory's own, or its prompt's."""
        ids = request.input_ids
        if self.reuse_cache and request.session is not None:
            s = self._sessions.pop(request.session, None)
            if s is not None and len(s.ids) <= len(ids) and ids[: len(s.ids)] == s.ids:
                if len(s.ids) == len(ids):  # the last input token is fed again for its logits
                    s.kv.crop(len(ids) - 1)
                    s.ids = s.ids[:-1]
                    s.routes = crop_routes(s.routes, len(s.ids))
                return s, len(s.ids)
        if self._shares_prompt():
            s = self._prompts.get(tuple(ids[:-1]))
            if s is not None:
                self._prompts.move_to_end(tuple(ids[:-1]))
                return s.copy(), len(s.ids)
        return Session([], rowwise.SequenceKV(self._layers)), 0

    def _shares_prompt(self) -> bool:
        return self.reuse_cache and self.share_prompts

    def _prefill(self, job: Job) -> torch.Tensor:
        s = job.session
        pending = job.request.input_ids[len(s.ids) :]
        record = job.request.return_routed_experts
        if job.cached == 0 and self._shares_prompt() and len(pending) > 1:
            # the prompt's cache ends before its last token, so that every sample of the prompt,
            # whether it computed the cache or copied it, gets its first logits the same way
            self._feed([s], [pending[:-1]], record)
            self._remember_prompt(s)
            pending = pending[-1:]
        return self._feed([s], [pending], record)[0]

    def _remember_prompt(self, session: Session) -> None:
        key = tuple(session.ids)
        if key not in self._prompts:
            self._prompts[key] = session.copy()
            while len(self._prompts) > 8:
                self._prompts.popitem(last=False)

    # -- decoding: one token for every running sequence --------------------------------------
    def _step(self, jobs: list[Job]) -> list[Job]:
        record = any(j.request.return_routed_experts for j in jobs)
        with rowwise.batch_invariant():
            logits = self._feed([j.session for j in jobs], [[j.output[-1]] for j in jobs], record)
        self.decode_steps += 1
        self.decoded_rows += len(jobs)
        self._sample(jobs, logits)
        return self._retire(jobs)

    def _feed(self, sessions: list[Session], tokens: list[list[int]], record: bool) -> torch.Tensor:
        """Run ``tokens`` (the same count for every sequence) after each sequence's cache; the
        logits of each sequence's last position ``[rows, vocab]``, float32."""
        width = len(tokens[0])
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)
        starts = torch.tensor([[s.kv.length] for s in sessions], dtype=torch.long, device=self.device)
        positions = starts + torch.arange(width, device=self.device)
        cache = rowwise.RowsCache([s.kv for s in sessions])
        kwargs = dict(input_ids=x, position_ids=positions, attention_mask=rowwise.NO_MASK, use_cache=True)
        with self._recorder if record else contextlib.nullcontext():
            out = self.model(logits_to_keep=1, **kwargs, **{self._cache_arg: cache})
        cache.advance(width)
        routes = self._recorder.take() if record else None
        for b, (s, t) in enumerate(zip(sessions, tokens, strict=True)):
            s.ids.extend(t)
            if routes is not None:
                s.routes.append(routes[b * width : (b + 1) * width])
        self.tokens_fed += width * len(sessions)
        return out.logits[:, -1].float()

    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> None:
        rs = [j.request for j in jobs]
        tokens, logprobs = sample_rows(
            logits.cpu(), [r.temperature for r in rs], [r.top_p for r in rs], [j.generator for j in jobs]
        )
        for j, token, logprob in zip(jobs, tokens, logprobs, strict=True):
            j.output.append(token)
            j.logprobs.append(logprob)
            if token in j.request.stop_token_ids:
                j.finish = "stop"
            elif len(j.output) >= j.request.max_new_tokens:
                j.finish = "length"

    def _retire(self, jobs: list[Job]) -> list[Job]:
        """Deliver the jobs that finished; the ones still generating. A job whose caller is gone
        (cancelled: its worker stopping, or its prompt taken over by another) decodes no further."""
        for j in jobs:
            if j.finish is not None:
                self._finish(j)
        return [j for j in jobs if j.finish is None and not j.future.cancelled()]

    def _finish(self, job: Job) -> None:
        r = job.request
        routes = None
        if r.return_routed_experts:
            all_routes = np.concatenate(job.session.routes, axis=0) if job.session.routes else None
            total = len(r.input_ids) + len(job.output) - 1  # every position but the last
            if all_routes is None or all_routes.shape[0] < total:
                error = RuntimeError("routes were not recorded for every position")
                job.loop.call_soon_threadsafe(set_exception, job.future, error)
                return
            routes = all_routes[r.routed_experts_start_len : total]
        if r.session is not None and self.reuse_cache:
            self._sessions[r.session] = job.session
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        result = GenerationResult(
            job.output,
            job.logprobs,
            job.finish or "length",
            job.version,
            routes,
            cached_tokens=job.cached,
            latency_s=time.perf_counter() - job.queued,
        )
        job.loop.call_soon_threadsafe(set_result, job.future, result)
