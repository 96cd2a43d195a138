"""Key-value storage with expiry for the gateway's cache and call budgets.

Redis in production (shared by every gateway replica); an in-process store when no
Redis is configured (one process only, for tools and scripts that run alone).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

import redis.asyncio as aioredis

__all__ = ["MemoryStore", "RedisStore", "Store"]


class Store(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl_s: int) -> None: ...

    async def incr(self, key: str, ttl_s: int) -> int: ...


class RedisStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "pbsd") -> None:
        self.redis = client
        self.prefix = f"{prefix}:tools:"

    async def get(self, key: str) -> str | None:
        value = await self.redis.get(self.prefix + key)
        return value.decode() if isinstance(value, bytes) else value

    async def set(self, key: str, value: str, ttl_s: int) -> None:
        await self.redis.set(self.prefix + key, value, ex=ttl_s)

    async def incr(self, key: str, ttl_s: int) -> int:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incr(self.prefix + key)
            pipe.expire(self.prefix + key, ttl_s, nx=True)  # the window starts at the first call
            count, _ = await pipe.execute()
        return int(count)


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
