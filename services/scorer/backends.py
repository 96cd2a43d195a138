"""Where the scorer's likelihoods come from: the model in this process, or an SGLang server.

Both take the same requests (token ids, positions to score) and give the log-probs of
the tokens at those positions. A trajectory's passes (student, teacher, null; ``pairs``) see the
same weights: the local model scores a whole call under one lock, and SGLang gets each pair on
one server and checks the weight version every answer names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import httpx
import numpy as np
from torch._dynamo.exc import BackendCompilerFailed
from transformers import PreTrainedModel

from services.model.checkpoint import load_weights_into
from services.model.lm_head import HeadPath
from services.scorer.evidence import LogProbs
from services.scorer.logprobs import kernel_path, sequence_logprobs
from services.scorer.replay import RoutedRequest, replayed_logprobs
from services.sglang_control import (
    Guard,
    WeightsRefused,
    follow_broadcast,
    load_each,
    load_weights_from_disk,
    settle_flush,
    tag_version,
    unguarded,
)
from services.tasks import gather_or_cancel, thread_to_the_end
from services.upstream import RetryPolicy, UpstreamError, http_client, send_with_retries
from services.weights.receiver import TORN

__all__ = ["LocalScorer", "SglangScorer"]

log = logging.getLogger(__name__)


class LocalScorer:
    """Packed, chunked passes through a local model (see :mod:`services.scorer.logprobs`). Every call
    takes the one :class:`KernelPath` fixed here, so student and teacher always share it."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        token_budget: int = 16_384,
        chunk_size: int = 1024,
        pack: bool | None = None,
        head: HeadPath | None = None,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        # Packing pays off with flex attention's document mask or flash attention's varlen kernels;
        # with SDPA a packed mask is dense and costs the square of its length.
        self.path = kernel_path(model, pack=pack, head=head)
        self.version = version
        self._lock = asyncio.Lock()
        self._whole = asyncio.Event()  # cleared while a broken broadcast leaves the weights torn
        self._whole.set()

    async def __call__(
        self, requests: Sequence[tuple[Sequence[int], np.ndarray]], pairs: Sequence[int] | None = None
    ) -> LogProbs:
        self._check_ids(ids for ids, _ in requests)
        async with self._whole_weights():  # the version is the one these passes ran with
            try:
                return LogProbs(await thread_to_the_end(self._score, requests), self.version)
            except BackendCompilerFailed as exc:
                if self.path.attention != "flex_attention":
                    raise
                # Inductor cannot build flex attention for every shape, dtype and GPU (on an H100 with
                # torch 2.11 it found no kernel for the tiny policy's 16-wide bf16 heads): the scorer
                # then runs SDPA one sequence per forward from this call on, so every log-prob it
                # returns, student's and teacher's alike, still comes from one path.
                self.model.set_attn_implementation("sdpa")
                self.path = kernel_path(self.model, pack=False, head=self.path.head)
                log.warning(
                    "flex attention failed to compile (%s); scoring kernel path now %s", exc, self.path
                )
                return LogProbs(await thread_to_the_end(self._score, requests), self.version)

    @contextlib.asynccontextmanager
    async def _whole_weights(self) -> AsyncIterator[None]:
        """The lock, held while the weights are whole: a broadcast holds the lock while it writes,
        and one that fails leaves them torn as it lets go, so a call that waited for the lock
        looks again, and waits for the next whole copy."""
        while True:
            await self._whole.wait()
            await self._lock.acquire()
            if self._whole.is_set():
                break
            self._lock.release()
        try:
            yield
        finally:
            self._lock.release()

    def _check_ids(self, sequences) -> None:
        """A token id outside the model's embedding is refused before any forward: on a GPU the
        embedding's gather would fail with a device-side assert, which poisons the process for good,
        so one bad group would fail every group after it."""
        vocab = self.model.get_input_embeddings().num_embeddings
        for ids in sequences:
            arr = np.asarray(ids)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                raise ValueError(
                    f"token ids outside the model's vocabulary of {vocab}: {arr.min()}..{arr.max()}"
                )

    def _score(self, requests: Sequence[tuple[Sequence[int], np.ndarray]]) -> list[np.ndarray]:
        return sequence_logprobs(
            self.model,
            requests,
            token_budget=self.token_budget,
            chunk_size=self.chunk_size,
            pack=self.path.pack,
            head=self.path.head,
        )

    async def replayed(self, requests: Sequence[RoutedRequest]) -> LogProbs:
        """The same with each request's MoE routes forced (the ``evidence_routing`` replay ablation)."""
        self._check_ids(r[0] for r in requests)
        async with self._whole_weights():
            values = await thread_to_the_end(
                replayed_logprobs, self.model, requests, chunk_size=self.chunk_size, head=self.path.head
            )
            return LogProbs(values, self.version)

    async def update_weights(self, path: str, version: int, timeline: str = "") -> None:
        """(The worker keeps ``timeline``: in-process weights are its own to tell apart.)"""
        async with self._lock:
            await thread_to_the_end(load_weights_into, self.model, path)
            self.version = version
            self._whole.set()

    # -- a receiver of broadcast weights (services.weights.receiver.Holdable) ---------------------
    @property
    def weights_version(self) -> int:
        return self.version

    async def hold(self) -> None:
        await self._lock.acquire()  # the pass in progress ends first; no other starts

    async def release(self, version: int | None) -> None:
        if version is not None:
            self.version = version
            if version == TORN:  # scoring waits for a whole copy (the next publication's disk load)
                self._whole.clear()
            else:
                self._whole.set()
        self._lock.release()


class SglangScorer:
    """Prompt log-probs from SGLang: ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len``
    one before the first scored position (the prefix before it stays in SGLang's radix cache);
    ``input_token_logprobs`` then align with ``input_ids[logprob_start_len:]``, the first entry null.

    A pair's requests go to one server (pairs spread over the servers, the spread turning with each
    call), and each answer names the weights that scored it (``meta_info.weight_version``). A pair
    whose answers name two versions (a reload came between them) is scored again, up to
    ``PAIR_ATTEMPTS`` times: its evidence would otherwise be one version's teacher minus another's
    student. A server that names no version in its answers cannot be checked so."""

    PAIR_ATTEMPTS = 3

    def __init__(
        self,
        urls: list[str],
        *,
        concurrency: int = 32,
        http: httpx.AsyncClient | None = None,
        retry: RetryPolicy | None = None,
        version: int = 0,
        guard: Guard = unguarded,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.guard = guard  # one replica at a time loads a server (sglang_control.load_each)
        self.http = http or http_client(3600)
        self.retry = retry or RetryPolicy(max_attempts=3, base_delay_s=1.0)
        self.semaphore = asyncio.Semaphore(concurrency)
        self.version = version
        self._calls = 0

    async def _one(
        self, url: str, ids: Sequence[int], positions: np.ndarray
    ) -> tuple[np.ndarray, str | None]:
        """The log-probs, and the weight version the server says scored them."""
        if len(positions) == 0:
            return np.zeros(0, dtype=np.float32), None
        start = int(positions.min()) - 1
        payload = {
            "input_ids": list(ids),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        async with self.semaphore:
            response = await send_with_retries(
                f"sglang {url}", lambda: self.http.post(f"{url}/generate", json=payload), self.retry
            )
        if response.status_code >= 400:
            raise UpstreamError(f"sglang {url}", f"HTTP {response.status_code}", status=response.status_code)
        meta = response.json()["meta_info"]
        entries = meta["input_token_logprobs"]
        if len(entries) != len(ids) - start:
            raise UpstreamError(
                f"sglang {url}", f"{len(entries)} input log-probs for {len(ids) - start} tokens"
            )
        values = np.array([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float64)
        tag = meta.get("weight_version")
        version = None if tag is None else str(tag)
        return values[np.asarray(positions) - start].astype(np.float32), version

    async def _pair(
        self, url: str, requests: list[tuple[Sequence[int], np.ndarray]]
    ) -> tuple[list[np.ndarray], str | None]:
        """The pair's log-probs, and the one weight version its answers named (None: none named)."""
        for _ in range(self.PAIR_ATTEMPTS):
            answers = await gather_or_cancel(*(self._one(url, ids, pos) for ids, pos in requests))
            versions = {v for _, v in answers if v is not None}
            if len(versions) <= 1:
                return [values for values, _ in answers], next(iter(versions), None)
            log.warning(
                "sglang %s: one trajectory's passes scored by weights %s; scoring them again",
                url,
                sorted(versions),
            )
        raise UpstreamError(
            f"sglang {url}", f"the weights changed between a trajectory's passes {self.PAIR_ATTEMPTS} times"
        )

    async def __call__(
        self, requests: Sequence[tuple[Sequence[int], np.ndarray]], pairs: Sequence[int] | None = None
    ) -> LogProbs:
        """The version is the oldest any server named: servers load one after another, so a call's
        pairs may meet two versions. Where no answer names one, the version held when the call began."""
        held = self.version
        pairs = range(len(requests)) if pairs is None else pairs
        if len(pairs) != len(requests):
            raise ValueError(f"{len(pairs)} pair numbers for {len(requests)} requests")
        members: dict[int, list[int]] = {}
        for k, pair in enumerate(pairs):
            members.setdefault(pair, []).append(k)
        turn, self._calls = self._calls, self._calls + 1
        urls = [self.urls[(turn + n) % len(self.urls)] for n in range(len(members))]
        # a pair that fails ends the others: they held scoring slots and the servers, detached
        answers = await gather_or_cancel(
            *(
                self._pair(url, [requests[k] for k in ks])
                for url, ks in zip(urls, members.values(), strict=True)
            )
        )
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(requests)
        for ks, (values, _) in zip(members.values(), answers, strict=True):
            for k, v in zip(ks, values, strict=True):
                out[k] = v
        named = [v for _, tag in answers if (v := tag_version(tag)) is not None]
        return LogProbs(out, min(named, default=held))

    async def update_weights(self, path: str, version: int, timeline: str = "") -> None:
        await self.recheck(path, version, timeline)
        self.version = version

    async def recheck(self, path: str, version: int, timeline: str = "") -> None:
        """Load the checkpoint on each server that does not serve it yet (also :meth:`SglangEngine.recheck`'s
        case: one restarted since serves the model it started with)."""
        await load_each(self, path, version, self._reload, timeline=timeline)

    async def follow_broadcast(self, version: int, path: str, disk_version: int, timeline: str = "") -> None:
        """As :meth:`SglangEngine.follow_broadcast`: servers that missed ``version`` load the disk copy."""
        oldest = await follow_broadcast(self, version, (path, disk_version), self._reload, timeline=timeline)
        if oldest is not None:
            self.version = oldest

    async def _reload(self, url: str, path: str, version: int, timeline: str) -> None:
        try:
            if await load_weights_from_disk(self.http, url, path, version, self.retry, timeline=timeline):
                await settle_flush(self.http, url, path, version, self.retry, timeline=timeline)
        except WeightsRefused as exc:
            raise UpstreamError(f"sglang {url}", str(exc)) from None
