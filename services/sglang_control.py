"""SGLang's control endpoints, shared by the rollout engine and the evidence scorer.

``POST /update_weights_from_disk`` ``{model_path, weight_version, flush_cache}`` answers
``{"success", "message", "num_paused_requests"}``: HTTP 200 when it succeeded and HTTP 400
when it did not (sglang ``srt/entrypoints/http_server.py``). A 400 does not always mean the
old weights are still served: the scheduler loads the weights and records the version first
and flushes the prefix cache after, so a refused flush (requests still running or queued)
reports failure for weights that are already live, with the message "Weights were updated,
but the cache was not flushed ..." (0.5.23, ``managers/scheduler_components/
weight_updater.py``). The version ``GET /model_info`` names then is still the old one: the
tokenizer manager moves its tag on success only. So on that message the weights are taken
as in, the cache is flushed once the running requests are done (``POST /flush_cache?timeout=``,
which waits for the server to go idle) and the version is named (``POST /update_weight_version``
``{new_version, abort_all_requests: false}``): a prefix cache of the old weights' keys and
values would otherwise go on serving new requests. For any other 400 the served version
(``/model_info``, or ``/get_model_info`` on servers older than 0.5.23, where the new route is
missing) tells whether the weights are in: the caller must not keep believing in the old
version while the server samples with the new one.

Every version a server is told it serves is tagged with its timeline (``weight_version``
``<version>@<timeline>``, :mod:`services.weights.tags`), so a server that kept a version a
resume abandoned is not taken for one holding the new timeline's version of the same number.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import httpx

from services.upstream import RetryPolicy, UpstreamError, send_with_retries
from services.weights.tags import read_tag, same_timeline, weights_tag

log = logging.getLogger(__name__)

__all__ = [
    "Guard",
    "Servers",
    "WeightsRefused",
    "follow_broadcast",
    "load_each",
    "load_weights_from_disk",
    "model_info",
    "settle_flush",
    "shared_guard",
    "tag_version",
    "unguarded",
]


FLUSH_WAIT_S = 120.0  # how long a refused flush is given for the running requests to finish
UNFLUSHED = "the cache was not flushed"  # SGLang's words for weights loaded whose flush was refused


class WeightsRefused(Exception):
    """The server did not load the weights (and does not serve them)."""


# ``guard(url)``: held while one server is checked and loaded, so that of the replicas sharing a
# server one loads each version and the rest find it served (a lock on the bus, ``Bus.exclusive``)
Guard = Callable[[str], AbstractAsyncContextManager[object]]
Reload = Callable[[str, str, int, str], Awaitable[None]]  # (url, path, version, timeline)
Served = Callable[[dict], bool]  # of a server's /model_info: whether it already serves what is wanted


class Servers(Protocol):
    """What holds a set of SGLang servers and loads weights into them: the rollout's engine
    (:class:`services.rollout.sglang.SglangEngine`) and the scorer's backend."""

    http: httpx.AsyncClient
    urls: list[str]
    retry: RetryPolicy
    guard: Guard


def unguarded(url: str) -> AbstractAsyncContextManager[object]:
    """The guard of a replica that shares its servers with no one."""
    return contextlib.nullcontext()


def shared_guard(exclusive: Callable[[str], AbstractAsyncContextManager[object]]) -> Guard:
    """The guard of replicas that share servers: ``exclusive(name)`` is a lock they all see
    (``Bus.exclusive``), one per server URL."""
    return lambda url: exclusive(f"sglang-load:{url}")


async def model_info(http: httpx.AsyncClient, url: str, retry: RetryPolicy) -> dict:
    """``/model_info`` (model_path, weight_version, ...), ``/get_model_info`` where it is missing."""
    for route in ("/model_info", "/get_model_info"):
        response = await send_with_retries(f"sglang {url}", lambda r=route: http.get(f"{url}{r}"), retry)
        if response.status_code == 404:
            continue
        if response.status_code >= 400:
            raise UpstreamError(
                f"sglang {url}", f"{route}: HTTP {response.status_code}", status=response.status_code
            )
        return response.json()
    raise UpstreamError(f"sglang {url}", "neither /model_info nor /get_model_info exists", status=404)


async def load_weights_from_disk(
    http: httpx.AsyncClient, url: str, path: str, version: int, retry: RetryPolicy, *, timeline: str = ""
) -> bool:
    """Load ``path`` as ``version`` of ``timeline`` on one server; raise WeightsRefused unless it
    then serves them. True when the weights are in but their cache flush was refused: the caller
    lifts any pause it holds (a paused server's queued requests never finish) and then calls
    :func:`settle_flush`."""
    tag = weights_tag(version, timeline)
    body = {"model_path": path, "weight_version": tag, "flush_cache": True}
    response = await send_with_retries(
        f"sglang {url}", lambda: http.post(f"{url}/update_weights_from_disk", json=body), retry
    )
    try:
        reply = response.json()
    except ValueError:
        reply = {}
    if response.status_code < 400 and reply.get("success", False):
        return False
    message = reply.get("message") or response.text[:200]
    if response.status_code == 400 and UNFLUSHED in message:
        log.warning("sglang %s: the weights at %s are in, their cache flush was refused", url, path)
        return True
    if response.status_code in (200, 400):  # SGLang's own answer: ask what it serves now
        served = str((await model_info(http, url, retry)).get("weight_version"))
        if served == tag:
            log.warning("sglang %s serves the weights at %s although it reported: %s", url, path, message)
            return False
    raise WeightsRefused(f"{url} refused the weights at {path}: HTTP {response.status_code} {message}")


async def settle_flush(
    http: httpx.AsyncClient, url: str, path: str, version: int, retry: RetryPolicy, *, timeline: str = ""
) -> None:
    """Weights in whose cache flush was refused: flush it once the server is idle, then name
    ``version`` as served; :class:`WeightsRefused` when the flush is refused again (the server
    samples with the new weights, its cache still holds the old ones' keys and values)."""
    flushed = await send_with_retries(
        f"sglang {url}",
        lambda: http.post(f"{url}/flush_cache", params={"timeout": FLUSH_WAIT_S}, timeout=FLUSH_WAIT_S + 30),
        retry,
    )
    if flushed.status_code != 200:
        raise WeightsRefused(
            f"{url} loaded the weights at {path} but its cache could not be flushed within {FLUSH_WAIT_S:g} s: "
            f"HTTP {flushed.status_code} {flushed.text[:200]}"
        )
    body = {"new_version": weights_tag(version, timeline), "abort_all_requests": False}
    named = await send_with_retries(
        f"sglang {url}", lambda: http.post(f"{url}/update_weight_version", json=body), retry
    )
    if named.status_code != 200:
        raise WeightsRefused(
            f"{url} did not take version {version}: HTTP {named.status_code} {named.text[:200]}"
        )


def _loaded(path: str, version: int, timeline: str) -> Served:
    """Whether a server's ``/model_info`` says it serves the weights at ``path`` as ``version`` of
    ``timeline``: a successful disk load moves both ``model_path`` and ``weight_version`` (0.5.23,
    ``TokenizerManager._update_model_path_info``). Checkpoint paths name their run and version, so
    a version number alone, which every run counts again from 0, is not taken as proof."""
    tag = weights_tag(version, timeline)
    return lambda info: info.get("model_path") == path and str(info.get("weight_version")) == tag


def tag_version(tag: object) -> int | None:
    """The policy version an answer's ``weight_version`` tag names: its number; 0 for a tag that is
    none (``"default"``: the weights the server started with, before any update, a run's version 0,
    so a server restarted mid-run samples as stale until a publication reloads it); None without a
    tag (a server that names none cannot be checked)."""
    if tag is None:
        return None
    read = read_tag(tag)
    return read[0] if read else 0


async def load_each(
    servers: Servers,
    path: str,
    version: int,
    reload: Reload,
    *,
    timeline: str = "",
    served: Served | None = None,
    urls: list[str] | None = None,
) -> None:
    """``reload(url, path, version, timeline)`` on each server (of ``urls``, by default all of
    them) that does not serve it yet (``served`` of its ``/model_info``; by default, that it loaded
    ``path`` as ``version`` of ``timeline``), checked and loaded under ``servers.guard(url)``. Every
    rollout replica (and every scorer replica) hears of each version, and replicas share their
    servers: without the check N replicas would pause and load each server N times a version, one
    after another. A server that does not answer is loaded: the load reports it."""
    served = served or _loaded(path, version, timeline)
    for url in servers.urls if urls is None else urls:
        async with servers.guard(url):
            try:
                info = await model_info(servers.http, url, servers.retry)
            except UpstreamError:
                info = {}
            if served(info):
                log.debug("sglang %s already serves version %s (%s)", url, info.get("weight_version"), path)
                continue
            await reload(url, path, version, timeline)


async def follow_broadcast(
    servers: Servers, version: int, copy: tuple[str, int], reload: Reload, *, timeline: str = ""
) -> int | None:
    """After the trainer broadcast ``version`` of ``timeline``: ``reload(url, path, disk_version,
    timeline)`` the disk copy (``copy``: path, version) on every server that serves neither that
    version nor anything of the timeline as new as the copy (it restarted, was left out of the
    weight group, or holds a version of a timeline a resume abandoned); the oldest version served
    then (None: no server answers). A server that does not answer is left alone: the trainer brings
    it back into the group once it is up again. The disk copy is loaded as :func:`load_each` loads it."""
    path, disk_version = copy
    copied = _loaded(path, disk_version, timeline)

    def current(info: dict) -> bool:  # checked again under the guard: another replica may have loaded it
        held = read_tag(info.get("weight_version"))
        return copied(info) or (
            held is not None and same_timeline(held, timeline) and held[0] >= min(version, disk_version + 1)
        )

    behind, served = [], []
    for url in servers.urls:
        try:
            info = await model_info(servers.http, url, servers.retry)
        except UpstreamError as exc:
            log.warning("sglang %s does not answer (%s)", url, exc)
            continue
        if current(info):
            served.append(tag_version(info.get("weight_version")) or 0)
        else:
            behind.append(url)
    await load_each(servers, path, disk_version, reload, timeline=timeline, served=current, urls=behind)
    return min([*served, *([disk_version] if behind else [])], default=None)
