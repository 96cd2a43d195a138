"""SGLang's control endpoints, shared by the rollout engine and the evidence scorer.

``POST /update_weights_from_disk`` ``{model_path, weight_version, flush_cache}`` answers
``{"success", "message", "num_paused_requests"}``: HTTP 200 when it succeeded and HTTP 400
when it did not (sglang ``srt/entrypoints/http_server.py``). A 400 does not always mean the
old weights are still served: the update loads the weights and sets ``weight_version``
first and flushes the cache after, so a refused flush (requests still running) reports
failure for weights that are already live. The served version (``GET /model_info``, or
``/get_model_info`` on servers older than 0.5.23, where the new route is missing) tells
which: the caller must not keep believing in the old version while the server samples
with the new one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx

from services.upstream import RetryPolicy, UpstreamError, send_with_retries

log = logging.getLogger(__name__)

__all__ = ["WeightsRefused", "follow_broadcast", "load_weights_from_disk", "model_info"]


class WeightsRefused(Exception):
    """The server did not load the weights (and does not serve them)."""


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
    http: httpx.AsyncClient, url: str, path: str, version: int, retry: RetryPolicy
) -> None:
    """Load ``path`` as ``version`` on one server; raise WeightsRefused unless it then serves them."""
    body = {"model_path": path, "weight_version": str(version), "flush_cache": True}
    response = await send_with_retries(
        f"sglang {url}", lambda: http.post(f"{url}/update_weights_from_disk", json=body), retry
    )
    try:
        reply = response.json()
    except ValueError:
        reply = {}
    if response.status_code < 400 and reply.get("success", False):
        return
    message = reply.get("message") or response.text[:200]
    if response.status_code in (200, 400):  # SGLang's own answer: ask what it serves now
        served = str((await model_info(http, url, retry)).get("weight_version"))
        if served == str(version):
            log.warning("sglang %s serves the weights at %s although it reported: %s", url, path, message)
            return
    raise WeightsRefused(f"{url} refused the weights at {path}: HTTP {response.status_code} {message}")


async def follow_broadcast(
    http: httpx.AsyncClient,
    urls: list[str],
    version: int,
    copy: tuple[str, int],
    retry: RetryPolicy,
    reload: Callable[[str, str, int], Awaitable[None]],
) -> int | None:
    """After the trainer broadcast ``version``: ``reload(url, path, disk_version)`` the disk copy
    (``copy``: path, version) on every server that serves neither that version nor anything as new
    as the copy (it restarted, or was left out of the weight group); the oldest version served then
    (None: no server answers). A server that does not answer is left alone: the trainer brings it
    back into the group once it is up again."""
    path, disk_version = copy
    behind, served = [], []
    for url in urls:
        try:
            tag = str((await model_info(http, url, retry)).get("weight_version"))
        except UpstreamError as exc:
            log.warning("sglang %s does not answer (%s)", url, exc)
            continue
        held = int(tag) if tag.isdigit() else None
        if held is not None and held >= min(version, disk_version + 1):
            served.append(held)
        else:
            behind.append(url)
    for url in behind:
        await reload(url, path, disk_version)
    return min([*served, *([disk_version] if behind else [])], default=None)
