"""Politeness and fail-fast around each upstream (Serper, Jina, the summariser, plain HTTP).

``Upstream.call(send)`` runs ``send`` under, in order:

1. a circuit breaker: after ``failure_threshold`` consecutive failures the upstream is
   *open* and calls fail at once for ``reset_after_s``; then one trial call is let
   through (*half-open*): success closes the breaker, failure opens it again;
2. a concurrency limit (at most ``max_concurrency`` calls in flight);
3. a token-bucket rate limit (``rate_per_s`` sustained, ``burst`` at once);
4. retries with backoff that honour Retry-After (:func:`services.upstream.send_with_retries`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum

import httpx

from services.tools import metrics
from services.upstream import RetryPolicy, UpstreamError, send_with_retries

__all__ = ["BreakerOpen", "BreakerState", "CircuitBreaker", "RateLimiter", "Upstream", "UpstreamLimits"]


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class BreakerOpen(UpstreamError):
    pass


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        *,
        failure_threshold: int = 5,
        reset_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_running = False
        self._publish()

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self.opened_at >= self.reset_after_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def before(self) -> bool:
        """Raise BreakerOpen unless a call may go out now; True if it is the half-open trial."""
        state = self.state
        if state is BreakerState.OPEN or (state is BreakerState.HALF_OPEN and self._trial_running):
            remaining = self.reset_after_s - (self.clock() - (self.opened_at or 0))
            raise BreakerOpen(
                self.name,
                f"circuit open after {self.failures} consecutive failures; "
                f"retrying in {max(remaining, 0):.0f}s",
            )
        if state is BreakerState.HALF_OPEN:
            self._trial_running = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._trial_running = False
        self._publish()

    def no_verdict(self) -> None:
        """A call ended without telling the upstream's health (cancelled, cut off by the gateway's
        deadline, or refused by the client before it went out): a half-open trial's slot is given
        back, so the next call is the trial. Held, the breaker would refuse every call for good."""
        self._trial_running = False

    def failure(self) -> None:
        self.failures += 1
        self._trial_running = False
        if self.opened_at is not None or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()  # a failed trial re-opens for a full period
        self._publish()

    def _publish(self) -> None:
        metrics.BREAKER_STATE.labels(self.name).set(int(self.state))


class RateLimiter:
    """Token bucket: ``rate_per_s`` tokens a second, at most ``burst`` saved up."""

    def __init__(
        self, rate_per_s: float, burst: int = 1, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate = rate_per_s
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.updated = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            while True:
                now = self.clock()
                self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
                self.updated = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.rate)


@dataclass(frozen=True)
class UpstreamLimits:
    max_concurrency: int = 16
    rate_per_s: float | None = None  # None: no rate limit
    burst: int = 10
    failure_threshold: int = 5
    reset_after_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class Upstream:
    def __init__(
        self,
        name: str,
        limits: UpstreamLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self.limits = limits = limits or UpstreamLimits()
        self.sleep = sleep
        self.breaker = CircuitBreaker(
            name, failure_threshold=limits.failure_threshold, reset_after_s=limits.reset_after_s, clock=clock
        )
        self.semaphore = asyncio.Semaphore(limits.max_concurrency)
        self.limiter = RateLimiter(limits.rate_per_s, limits.burst) if limits.rate_per_s else None

    async def call(
        self, send: Callable[[], Awaitable[httpx.Response]], *, ok_statuses: range = range(200, 300)
    ) -> httpx.Response:
        """The upstream's response (any status in ``ok_statuses``); UpstreamError otherwise."""
        trial = self.breaker.before()
        try:
            async with self.semaphore:
                if self.limiter:
                    await self.limiter.acquire()
                response = await send_with_retries(
                    self.name,
                    send,
                    self.limits.retry,
                    on_retry=lambda reason: metrics.UPSTREAM_RETRIES.labels(self.name, reason).inc(),
                    sleep=self.sleep,
                )
            metrics.UPSTREAM_REQUESTS.labels(self.name, str(response.status_code)).inc()
            if response.status_code not in ok_statuses:
                # the upstream's own words ("Unauthorized.", "Insufficient balance") say what is wrong
                said = " ".join(response.text[:200].split())
                raise UpstreamError(
                    self.name,
                    f"HTTP {response.status_code}" + (f": {said}" if said else ""),
                    status=response.status_code,
                )
        except UpstreamError as exc:
            # A 4xx other than throttling is the request's fault, not the upstream's health; except a
            # refused key or an empty balance (401, 402, 403, or a 400 that says so), which fail every
            # request that follows.
            if exc.status is None or exc.status >= 500 or exc.status in (401, 402, 403, 429) or _spent(exc):
                self.breaker.failure()
            else:
                self.breaker.success()
            raise
        except BaseException:
            if trial:  # a call that went out before the breaker opened holds no trial's place
                self.breaker.no_verdict()
            raise
        self.breaker.success()
        return response


# Serper answers an empty balance with HTTP 400 {"message": "Not enough credits", "statusCode": 400}:
# the status is a bad request's, so only its words tell the account is spent
SPENT_WORDS = ("credit", "balance", "quota")


def _spent(exc: UpstreamError) -> bool:
    return exc.status == 400 and any(word in str(exc).lower() for word in SPENT_WORDS)
