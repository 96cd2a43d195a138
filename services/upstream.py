"""Calling paid or rate-limited HTTP upstreams politely: retries with exponential backoff
and jitter that honour ``Retry-After``, on 429, 5xx, timeouts and connection errors.

Secrets travel in headers and are never part of an exception message or a log line:
errors name the upstream and the status, not the request.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524})

# uvicorn, which SGLang, vLLM and this project's own services run on, closes a connection idle for
# 5 s (timeout_keep_alive; SGLANG_TIMEOUT_KEEP_ALIVE). httpx keeps one as long, so a request sent
# on a connection idle for just under 5 s races the server's close and fails on a dead socket.
# Clients of those servers let theirs go well before the server does.
KEEP_ALIVE_S = 2.0


def http_client(timeout_s: float) -> httpx.AsyncClient:
    """An HTTP client for a uvicorn-served upstream (SGLang, an OpenAI-compatible server, a pbsd
    service): ``timeout_s`` per request, idle connections dropped after :data:`KEEP_ALIVE_S`."""
    return httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEP_ALIVE_S))


class UpstreamError(Exception):
    """An upstream failed for good (after retries, or with a non-retryable answer)."""

    def __init__(self, upstream: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{upstream}: {message}")
        self.upstream = upstream
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    max_retry_after_s: float = 120.0  # a Retry-After longer than this is not waited for

    def backoff(self, attempt: int) -> float:
        """Full-jitter exponential backoff for retry number ``attempt`` (1-based)."""
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))


def retry_after_seconds(response: httpx.Response) -> float | None:
    """Seconds asked for by a ``Retry-After`` header (delta-seconds or HTTP date), if any."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def send_with_retries(
    upstream: str,
    send: Callable[[], Awaitable[httpx.Response]],
    policy: RetryPolicy = RetryPolicy(),
    *,
    on_retry: Callable[[str], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> httpx.Response:
    """Call ``send`` until it returns a non-retryable response; raise UpstreamError when attempts run out.

    A 2xx-4xx answer other than the retryable ones is returned as is: the caller decides
    what a 404 means. ``on_retry`` receives the reason (for metrics).
    """
    last = "no attempt made"
    for attempt in range(1, policy.max_attempts + 1):
        try:
            response = await send()
        except httpx.TimeoutException:
            last, reason, wait = "timed out", "timeout", None
        except httpx.TransportError as exc:
            last, reason, wait = f"connection failed ({type(exc).__name__})", "connect", None
        else:
            if response.status_code not in RETRYABLE_STATUS:
                return response
            wait = retry_after_seconds(response)
            last, reason = f"HTTP {response.status_code}", str(response.status_code)
            await response.aclose()
            if wait is not None and wait > policy.max_retry_after_s:
                raise UpstreamError(
                    upstream,
                    f"{last}, Retry-After {wait:.0f}s is too long to wait",
                    status=response.status_code,
                )
        if attempt == policy.max_attempts:
            break
        if on_retry:
            on_retry(reason)
        delay = wait if wait is not None else policy.backoff(attempt)
        log.info("%s: %s, retry %d/%d in %.2fs", upstream, last, attempt, policy.max_attempts - 1, delay)
        await sleep(delay)
    raise UpstreamError(upstream, f"{last} after {policy.max_attempts} attempts")
