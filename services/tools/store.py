"""Key-value storage with expiry for the gateway's cache and call budgets.

Redis in production (shared by every gateway replica); an in-process store when no
Redis is configured (one process only, for tools and scripts that run alone). While Redis
is unreachable the Redis store falls back to an in-process one, so the gateway keeps
answering (cache misses, budgets counted per replica) instead of failing every call.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import redis.asyncio as aioredis

from services.bus import REDIS_DOWN
from services.tools import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["MemoryStore", "RedisStore", "Store"]


class Store(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl_s: int) -> None: ...

    async def incr(self, key: str, ttl_s: int) -> int: ...


class RedisStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "pbsd") -> None:
        self.redis = client
        self.prefix = f"{prefix}:tools:"
        self.local = MemoryStore(max_items=10_000)  # while Redis is out of reach
        self._down = False

    async def _redis_or_local(
        self, op: str, remote: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]]
    ) -> T:
        try:
            result = await remote()
        except REDIS_DOWN as exc:
            metrics.STORE_FALLBACKS.labels(op).inc()
            if not self._down:
                log.warning(
                    "Redis is unreachable (%s): cache and budgets in this process until it is back", exc
                )
                self._down = True
            return await local()
        if self._down:
            log.info("Redis is back: cache and budgets shared again")
            self._down = False
        return result

    async def get(self, key: str) -> str | None:
        async def remote():
            value = await self.redis.get(self.prefix + key)
            return value.decode() if isinstance(value, bytes) else value

        return await self._redis_or_local("get", remote, lambda: self.local.get(key))

    async def set(self, key: str, value: str, ttl_s: int) -> None:
        await self._redis_or_local(
            "set",
            lambda: self.redis.set(self.prefix + key, value, ex=ttl_s),
            lambda: self.local.set(key, value, ttl_s),
        )

    async def incr(self, key: str, ttl_s: int) -> int:
        async def remote():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.incr(self.prefix + key)
                pipe.expire(self.prefix + key, ttl_s, nx=True)  # the window starts at the first call
                count, _ = await pipe.execute()
            return int(count)

        return await self._redis_or_local("incr", remote, lambda: self.local.incr(key, ttl_s))


class MemoryStore:
    """A bounded LRU with per-key expiry."""

    def __init__(self, max_items: int = 100_000, clock=time.monotonic) -> None:
        self.items: OrderedDict[str, tuple[float, str | int]] = OrderedDict()
        self.max_items = max_items
        self.clock = clock

    def _live(self, key: str):
        item = self.items.get(key)
        if item is None:
            return None
        if item[0] <= self.clock():
            del self.items[key]
            return None
        self.items.move_to_end(key)
        return item[1]

    def _put(self, key: str, value, ttl_s: float) -> None:
        self.items[key] = (self.clock() + ttl_s, value)
        self.items.move_to_end(key)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)

    async def get(self, key: str) -> str | None:
        value = self._live(key)
        return value if isinstance(value, str) else None

    async def set(self, key: str, value: str, ttl_s: int) -> None:
        self._put(key, value, ttl_s)

    async def incr(self, key: str, ttl_s: int) -> int:
        value = self._live(key)
        if value is None:
            self._put(key, 1, ttl_s)
            return 1
        expiry = self.items[key][0]
        self.items[key] = (expiry, int(value) + 1)
        return int(value) + 1
