"""A lock that every replica sharing the bus's Redis sees: one holder at a time across processes.

It is redis-py's ``Lock`` (``SET key token NX PX``, released by a script that deletes the key only
while it still holds the holder's token), with these choices of ours:

- it lives ``ttl_s`` at a time and its holder renews it every third of that, so work that takes
  longer keeps it, and a replica that dies while holding it stops the others for at most ``ttl_s``;
- a ``SET`` the client sent again after a lost reply finds the key holding its own token: that is
  taken as acquired, not as another's lock to wait out;
- the token lives on the object, not in thread-local storage: many coroutines share one thread;
- where Redis cannot be reached the work goes on unguarded, logged: what the lock saves is
  repeated work, which is no reason to stop the work itself.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from services.bus.connection import REDIS_DOWN
from services.tasks import cancel_and_wait

log = logging.getLogger(__name__)

__all__ = ["Exclusive"]


class _OwnRetryLock(Lock):
    async def do_acquire(self, token: str | bytes) -> bool:
        if await super().do_acquire(token):
            return True
        # the client sends a command again when its reply was lost: the first SET may have won
        held = await self.redis.get(self.name)
        mine = token.encode() if isinstance(token, str) else token
        return held is not None and (held.encode() if isinstance(held, str) else held) == mine


class Exclusive:
    """``async with Exclusive(redis, key, ttl_s=...)``: wait for the lock, hold it, release it."""

    def __init__(self, client: aioredis.Redis, key: str, *, ttl_s: float, poll_s: float = 0.25) -> None:
        self.key, self.ttl_s = key, ttl_s
        self._lock = _OwnRetryLock(client, key, timeout=ttl_s, sleep=poll_s, thread_local=False)
        self._held = False
        self._renewing: asyncio.Task | None = None

    async def __aenter__(self) -> Exclusive:
        waited = time.monotonic()
        try:
            self._held = bool(await self._lock.acquire())
        except REDIS_DOWN as exc:
            log.warning("%s: Redis is out of reach (%s); going on without the lock", self.key, exc)
            return self
        if time.monotonic() - waited > 1.0:
            log.info("waited %.1f s for %s", time.monotonic() - waited, self.key)
        self._renewing = asyncio.create_task(self._renew())
        return self

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._lock.reacquire()  # its time to live set back to ttl_s
            except LockError:
                log.warning("%s expired while held (another holder may have it now)", self.key)
                return
            except REDIS_DOWN as exc:
                log.warning("%s could not be renewed (%s); trying again", self.key, exc)

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._renewing is not None:
                # not suppress(CancelledError): a cancellation of the holder landing here was lost
                await cancel_and_wait(self._renewing)
        finally:  # a holder cancelled just now still lets the others have the lock
            await self._release()

    async def _release(self) -> None:
        if not self._held:
            return
        try:
            await self._lock.release()
        except LockError:  # it expired (and another holder may have it now): the work is done anyway
            log.warning("%s had expired when it was released", self.key)
        except REDIS_DOWN as exc:  # it expires by itself
            log.warning("%s could not be released (%s); it expires in %.0f s", self.key, exc, self.ttl_s)
