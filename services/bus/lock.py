"""A lock that every replica sharing the bus's Redis sees: one holder at a time across processes.

It is redis-py's ``Lock`` (``SET key token NX PX``, released by a script that deletes the key only
while it still holds the holder's token), with two choices of ours:

- it expires ``ttl_s`` after it is taken, so a replica that dies while holding it stops the others
  for at most that long; a holder that outlives it is told so in the log, not by an exception that
  would hide the outcome of the work it guarded;
- its token lives on the object, not in thread-local storage: many coroutines share one thread.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import LockError

log = logging.getLogger(__name__)

__all__ = ["Exclusive"]


class Exclusive:
    """``async with Exclusive(redis, key, ttl_s=...)``: wait for the lock, hold it, release it."""

    def __init__(self, client: aioredis.Redis, key: str, *, ttl_s: float, poll_s: float = 0.25) -> None:
        self.key, self.ttl_s = key, ttl_s
        self._lock = client.lock(key, timeout=ttl_s, sleep=poll_s, thread_local=False)
        self._since = 0.0

    async def __aenter__(self) -> Exclusive:
        waited = time.monotonic()
        await self._lock.acquire()
        self._since = time.monotonic()
        if self._since - waited > 1.0:
            log.info("waited %.1f s for %s", self._since - waited, self.key)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._lock.release()
        except LockError:  # it expired (and another holder may have it now): the work is done anyway
            log.warning(
                "%s was held for %.0f s, past its %.0f s expiry",
                self.key,
                time.monotonic() - self._since,
                self.ttl_s,
            )
