"""The trainer's side of the distributed weight update: every policy version, by broadcast, to
every receiver (SGLang servers, the scorer, in-process engines: all speak SGLang's protocol,
see :mod:`services.weights.receiver`).

One version::

    check the group: every receiver that answers /model_info, and every member still serving
        the version sent last; otherwise take the group down and form it again with the
        receivers that answer (POST /init_weights_update_group to each while this process
        hosts the rendezvous as rank 0; SGLang server i gets ranks rank_offset.. of its tp_size)
    POST /pause_generation {mode} to the members
    POST /begin_weight_update {} to the members (a session one left open is closed first)
    for each bucket of about bucket_bytes (checkpoint-layout tensors, in order):
        POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
            weight_version (the last bucket only)} to every member, and meanwhile broadcast the
            bucket's tensors from rank 0; each member answers once it has received them
    POST /end_weight_update {} to the members
    POST /continue_generation to the members

SGLang (0.5.23) refuses ``update_weights_from_distributed`` outside a weight-update session
(``begin_weight_update`` ... ``end_weight_update``, whose end finalises quantised weights);
a refused update never joins the broadcast, which would then wait out its timeout. A server
without the session routes (older SGLang) answers them 404, which counts as done.

The HTTP calls and the broadcast run at once because a member answers only after its receive
ends. The tensors are views of the model's own memory (:class:`HubLayout`): nothing is copied
on a GPU; with gloo and a GPU model each tensor is first copied to the host.

:meth:`WeightBroadcaster.publish` returns the receivers left out (they missed this version); a
failure in the middle of a version takes the group down and raises :class:`BroadcastFailed`:
the members' weights are then torn, they stay paused, and the caller writes the version to disk
and calls :meth:`WeightBroadcaster.recover`, which has them load it before they continue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator

import httpx
import torch
from torch import nn

from services.local_redis import free_port
from services.upstream import http_client
from services.weights.group import broadcast, close_group, dtype_name, open_group
from services.weights.layout import HubLayout, Piece
from services.weights.tags import same_weights, weights_tag

log = logging.getLogger(__name__)

__all__ = ["BroadcastFailed", "WeightBroadcaster", "buckets"]


BENCH = 5  # publications a receiver that refused to join the group sits out (as if it were down)
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")


class BroadcastFailed(Exception):
    """A version did not reach every member of the group; the group is down."""


# tensors a bucket names at most: an update request lists each one's name, dtype and shape (about
# 80 bytes), and the workers' receivers take request bodies of 64 KiB. A MoE's 3 MiB expert
# tensors would otherwise pass that from a bucket of about 2.6 GB
MAX_BUCKET_TENSORS = 256


def buckets(pieces: list[Piece], bucket_bytes: int) -> Iterator[list[Piece]]:
    """Consecutive pieces of about ``bucket_bytes`` (a larger piece is a bucket of its own), at most
    ``MAX_BUCKET_TENSORS`` of them."""
    bucket: list[Piece] = []
    size = 0
    for piece in pieces:
        if bucket and (size + piece.nbytes > bucket_bytes or len(bucket) == MAX_BUCKET_TENSORS):
            yield bucket
            bucket, size = [], 0
        bucket.append(piece)
        size += piece.nbytes
    if bucket:
        yield bucket


class WeightBroadcaster:
    def __init__(
        self,
        urls: list[str],
        *,
        master_address: str,
        master_port: int = 0,
        backend: str = "gloo",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 300.0,
        pause_mode: str = "retract",
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.pause_mode = pause_mode
        self._own = http is None
        self.http = http or http_client(timeout_s)
        self.group = None
        self.group_name = ""
        self.members: list[str] = []
        self.sent: int | None = None  # the version the members hold
        self.timeline = ""  # the timeline of the versions sent (services.weights.tags)
        self._layout: tuple[int, HubLayout] | None = None
        self.device: torch.device | None = None  # the model's CUDA device, for NCCL
        self.stranded: list[str] = []  # members a failed version left paused (see recover)
        self._benched: dict[str, int] = {}  # receivers that refused to join: publications to sit out
        self._unjoinable: set[str] = set()  # servers with data-parallel replicas: never in the group
        self._restarted: set[str] = set()  # members found behind: out of the group, whatever they serve

    def layout(self, model: nn.Module) -> HubLayout:
        if self._layout is None or self._layout[0] != id(model):
            self._layout = (id(model), HubLayout(model))
        return self._layout[1]

    async def aclose(self) -> None:
        await self._teardown()
        if self._own:
            await self.http.aclose()

    # -- one version ---------------------------------------------------------------------------
    async def publish(self, model: nn.Module, version: int, timeline: str = "") -> list[str]:
        """Send ``model``'s weights as ``version`` of ``timeline`` to every receiver that can take
        them; the ones left out. Raises :class:`BroadcastFailed` when the version did not reach
        every member."""
        self.device = next(model.parameters()).device if self.backend == "nccl" else None
        await self._ensure_group()
        self.timeline = timeline
        left_out = [u for u in self.urls if u not in self.members]
        if not self.members:
            return left_out
        paused = await self._call_all("/pause_generation", {"mode": self.pause_mode})
        opened: list[str] = []
        try:
            if len(paused) < len(self.members):
                raise BroadcastFailed("a member did not pause")
            opened = await self._open_sessions()
            if len(opened) < len(self.members):
                raise BroadcastFailed("a member did not open a weight-update session")
            layout = self.layout(model)
            pieces = list(buckets(layout.pieces, self.bucket_bytes))
            for i, bucket in enumerate(pieces):
                await self._send(model, layout, bucket, version if i == len(pieces) - 1 else None)
            closing, opened = opened, []
            if len(await self._call_all("/end_weight_update", {}, only=closing)) < len(closing):
                raise BroadcastFailed("a member did not close its weight-update session")
        except Exception as exc:  # the members may hold part of the version: the group goes, they stay paused
            self.stranded = paused
            await self._teardown()
            await self._call_all("/end_weight_update", {}, only=opened)  # recover's disk load needs none
            raise exc if isinstance(exc, BroadcastFailed) else BroadcastFailed(repr(exc)) from exc
        await self._call_all("/continue_generation", {}, only=paused)
        self.sent = version
        return left_out

    async def recover(self, path: str, version: int, timeline: str = "") -> None:
        """After a :class:`BroadcastFailed`: the members it left paused, with part of a version in them,
        load the whole of ``version`` from ``path`` (``/update_weights_from_disk``; SGLang's servers
        would otherwise resume sampling with torn weights), then continue. Our own receivers have no
        such route: they resume torn and serve nothing until their worker loads the copy the disk
        publication names."""
        stranded, self.stranded = self.stranded, []
        body = {"model_path": path, "weight_version": weights_tag(version, timeline), "flush_cache": True}
        for url in stranded:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.http.post(
                    f"{url}/update_weights_from_disk", json=body, timeout=self.timeout_s
                )
                if response.status_code not in (200, 404):
                    log.warning(
                        "%s did not reload %s: HTTP %d %s",
                        url,
                        path,
                        response.status_code,
                        response.text[:200],
                    )
        await self._call_all("/continue_generation", {}, only=stranded)

    async def _send(
        self, model: nn.Module, layout: HubLayout, bucket: list[Piece], version: int | None
    ) -> None:
        body = {
            "names": [p.name for p in bucket],
            "dtypes": [dtype_name(p.dtype) for p in bucket],
            "shapes": [list(p.shape) for p in bucket],
            "group_name": self.group_name,
            "flush_cache": version is not None,  # once, when the whole version is in
        }
        if version is not None:
            body["weight_version"] = weights_tag(version, self.timeline)
        state = model.state_dict()
        to_host = self.backend == "gloo"
        tensors = [layout.view(state, p).detach() for p in bucket]
        tensors = [t.cpu() if to_host else t for t in tensors]
        calls = asyncio.gather(
            *(self._post(u, "/update_weights_from_distributed", body) for u in self.members)
        )
        try:
            with torch.no_grad():
                await asyncio.to_thread(broadcast, self.group, tensors)
        except Exception as exc:
            calls.cancel()
            with contextlib.suppress(BaseException):
                await calls
            raise BroadcastFailed(f"broadcast of {bucket[0].name}..: {exc}") from exc
        failed = [f"{u}: {r}" for u, r in zip(self.members, await calls, strict=True) if r is not True]
        if failed:
            raise BroadcastFailed("; ".join(failed))

    async def _open_sessions(self) -> list[str]:
        """Open a weight-update session on every member; the ones that did. A session still open
        on a member (a publisher died between its begin and end) is closed and opened again."""

        async def begin(url: str) -> bool | str:
            answer = await self._post(url, "/begin_weight_update", {})
            if answer is not True and "already open" in answer:
                log.warning("%s: closing the weight-update session an earlier publication left open", url)
                await self._post(url, "/end_weight_update", {})
                answer = await self._post(url, "/begin_weight_update", {})
            return answer

        return await self._each(self.members, begin)

    async def behind(self) -> list[str]:
        """The receivers that answer but serve another version than the one the group holds: they
        restarted since the last broadcast, and the next one is theirs only if the run makes one."""
        if self.sent is None:
            return []
        served = await self._served_by_url()
        behind = [
            u for u, v in served.items() if v is not None and not same_weights(v, self.sent, self.timeline)
        ]
        # a member that restarted left the group, but once it loads the version from disk it serves
        # the version sent last, as the members do: the group would look intact, and the next
        # broadcast would wait on a peer that is gone
        self._restarted.update(u for u in behind if u in self.members)
        return behind

    # -- the group -----------------------------------------------------------------------------
    async def _ensure_group(self) -> None:
        served = await self._served_by_url()
        out = self._unjoinable | set(self._benched)
        reachable = [u for u in self.urls if served[u] is not None and u not in out]
        self._benched = {u: n - 1 for u, n in self._benched.items() if n > 1}
        intact = (
            self.sent is not None
            and not self._restarted
            and all(same_weights(served[u], self.sent, self.timeline) for u in self.members)
        )
        if self.group is not None and intact and reachable == self.members:
            return
        await self._teardown()
        if reachable:
            await self._form(reachable)

    async def _form(self, urls: list[str]) -> None:
        ranks = await asyncio.gather(*(self._ranks(u) for u in urls))
        if unable := [u for u, r in zip(urls, ranks, strict=True) if r is None]:
            # SGLang's group routes assert dp_size == 1 (a 500): asked to join, such a server would
            # hold every other member in the rendezvous until the timeout. It takes the disk copies
            # for as long as this trainer runs (asked again, it would re-form the group each time).
            log.warning("%s serve data-parallel replicas, which SGLang's weight group does not take", unable)
            self._unjoinable.update(unable)
            urls, ranks = [u for u in urls if u not in unable], [r for r in ranks if r is not None]
            if not urls:
                return
        name = f"pbsd-weights-{uuid.uuid4().hex[:12]}"
        port = self.master_port or free_port(self.master_address)
        offsets = [1 + sum(ranks[:i]) for i in range(len(urls))]
        world = 1 + sum(ranks)
        joins = [
            self._post(
                u,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world,
                    "group_name": name,
                    "backend": self.backend,
                },
            )
            for u, offset in zip(urls, offsets, strict=True)
        ]
        host = asyncio.create_task(
            asyncio.to_thread(
                open_group,
                device=self.device,
                address=self.master_address,
                port=port,
                rank=0,
                world_size=world,
                name=name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        )
        answers = await asyncio.gather(*joins)
        failed = [f"{u}: {a}" for u, a in zip(urls, answers, strict=True) if a is not True]
        if failed:  # the host waits out its timeout in its thread; this version goes without a group
            host.add_done_callback(_close_when_done)
            refused = [
                u for u, a in zip(urls, answers, strict=True) if a is not True and "Timeout" not in str(a)
            ]
            # the others waited for it in the rendezvous until the timeout: it sits the next ones out
            self._benched.update(dict.fromkeys(refused, BENCH))
            log.warning("the weight group did not form: %s", "; ".join(failed))
            return
        try:
            group = await host
        except Exception:
            log.exception("the weight group did not form on the trainer's side")
            await self._call_all("/destroy_weights_update_group", {"group_name": name}, only=urls)
            return
        self.group, self.group_name, self.members, self.sent = group, name, urls, None
        log.info("weight group %s formed: trainer + %s (world %d, %s)", name, urls, world, self.backend)

    async def _teardown(self) -> None:
        if self.group is None:
            return
        group, members, name = self.group, self.members, self.group_name
        self.group, self.members, self.sent = None, [], None
        self._restarted.clear()  # out of the group now: the next one is formed from who answers
        await self._call_all("/destroy_weights_update_group", {"group_name": name}, only=members)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(close_group, group)

    # -- HTTP ----------------------------------------------------------------------------------
    async def _served_by_url(self) -> dict[str, str | None]:
        """The weight version each receiver serves (None: it does not answer)."""
        return dict(zip(self.urls, await asyncio.gather(*map(self._served, self.urls)), strict=True))

    async def _served(self, url: str) -> str | None:
        """The weight version ``url`` serves (``/model_info``, ``/get_model_info`` on older SGLang);
        None when it does not answer."""
        for route in ("/model_info", "/get_model_info"):
            try:
                response = await self.http.get(f"{url}{route}", timeout=10)
            except httpx.HTTPError:
                return None
            if response.status_code == 200:
                return str(response.json().get("weight_version"))
            if response.status_code != 404:
                return None
        return None

    async def _ranks(self, url: str) -> int | None:
        """How many ranks ``url`` joins with: an SGLang server one per tensor-parallel rank
        (``/server_info`` ``tp_size``), our receivers one; None for a server with data-parallel
        replicas (``dp_size`` > 1), which cannot join."""
        for route in ("/server_info", "/get_server_info"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await self.http.get(f"{url}{route}", timeout=30)
                if response.status_code == 200:
                    info = response.json()
                    return None if int(info.get("dp_size") or 1) > 1 else int(info.get("tp_size") or 1)
        return 1

    async def _post(self, url: str, route: str, body: dict) -> bool | str:
        """True when ``url`` did it (or has no session routes to do it with); otherwise what went
        wrong."""
        try:
            response = await self.http.post(f"{url}{route}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return f"{route}: {type(exc).__name__} {exc}"
        if response.status_code == 404 and route in SESSION_ROUTES:  # SGLang before 0.5.23
            return True
        try:
            reply = response.json()
        except ValueError:
            reply = {}
        if response.status_code == 200 and (not isinstance(reply, dict) or reply.get("success", True)):
            return True
        message = reply.get("message") if isinstance(reply, dict) else None
        return f"{route}: HTTP {response.status_code} {message or response.text[:200]}"

    async def _call_all(self, route: str, body: dict, *, only: list[str] | None = None) -> list[str]:
        """POST to every member (or ``only``); the ones that did it (the others are logged)."""
        return await self._each(self.members if only is None else only, lambda u: self._post(u, route, body))

    async def _each(self, urls: list[str], call) -> list[str]:
        """``call(url)`` on every one of ``urls`` at once; the ones it returned True for (the
        others' answers are logged)."""
        answers = await asyncio.gather(*(call(u) for u in urls))
        failed = [f"{u}: {a}" for u, a in zip(urls, answers, strict=True) if a is not True]
        if failed:
            log.warning("weight group: %s", "; ".join(failed))
        return [u for u, a in zip(urls, answers, strict=True) if a is True]


def _close_when_done(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        close_group(task.result())
