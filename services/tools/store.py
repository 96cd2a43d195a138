"""Key-value storage with expiry for the gateway's cache and call budgets.

Redis in production (shared by every gateway replica); an in-process store when no
Redis is configured (one process only, for tools and scripts that run alone). While Redis
is unreachable the Redis store falls back to an in-process one, so the gateway keeps
answering (cache misses, budgets counted per replica) instead of failing every call.

The Redis store keeps a near copy of the cache entries it reads and writes in the process
(at most ``near_items`` and ``near_bytes``, each for at most ``near_ttl_s``): a repeated call is
answered without a round trip to Redis, and a replica follows the shared cache (an entry an
operator deleted, say) within ``near_ttl_s``. A call with a budget costs one round trip:
the count and the cache lookup travel together.

The cache shares its Redis with the bus, which runs without eviction: entries that filled it
would leave the bus refusing writes, and a refused write was a 500 for every call. So the store
writes cache entries only while Redis is below ``redis_share`` of its ``maxmemory`` (looked at
every ``ROOM_CHECK_S``), and a write Redis refuses anyway (out of memory, a read-only replica) is
served in the process, as during an outage.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import redis.asyncio as aioredis

from services.bus import REDIS_DOWN
from services.bus.connection import refusing
from services.tools import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["MemoryStore", "RedisStore", "Store"]


class Store(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl_s: int) -> None: ...

    async def incr(self, key: str, ttl_s: int) -> int: ...

    async def incr_and_get(self, counter: str, ttl_s: int, key: str) -> tuple[int, str | None]:
        """``incr(counter, ttl_s)`` and ``get(key)`` at once."""
        ...


ROOM_CHECK_S = 10.0  # how often the store looks at Redis's memory


class RedisStore:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "pbsd",
        *,
        near_items: int = 10_000,
        near_bytes: int = 256 << 20,
        near_ttl_s: float = 600.0,
        redis_share: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.prefix = f"{prefix}:tools:"
        # copies of cache entries Redis holds
        self.near = MemoryStore(max_items=near_items, max_bytes=near_bytes)
        self.near_ttl_s = near_ttl_s
        self.local = MemoryStore(max_items=10_000, max_bytes=near_bytes)  # while Redis is out of reach
        self.redis_share = redis_share
        self.clock = clock
        # why operations are served in the process: "unreachable" ends with any answer from Redis,
        # "refusing" (out of memory, read-only) only with a write it takes
        self._trouble: str | None = None
        self._room_checked, self._room, self._blind = -ROOM_CHECK_S, True, False

    async def _redis_or_local(
        self,
        op: str,
        remote: Callable[[], Awaitable[T]],
        local: Callable[[], Awaitable[T]],
        *,
        wrote: Callable[[T], bool] = lambda _result: False,
    ) -> T:
        try:
            result = await remote()
        except Exception as exc:
            trouble = "unreachable" if isinstance(exc, REDIS_DOWN) else "refusing" if refusing(exc) else None
            if trouble is None:
                raise
            metrics.STORE_FALLBACKS.labels(op).inc()
            if self._trouble != trouble:
                log.warning("Redis is %s (%s): cache and budgets in this process meanwhile", trouble, exc)
                self._trouble = trouble
            return await local()
        if self._trouble == "unreachable" or (self._trouble == "refusing" and wrote(result)):
            log.info("Redis takes the cache and budgets again")
            self._trouble = None
        return result

    async def get(self, key: str) -> str | None:
        near = self.near.peek(key)
        if near is not None:
            return near

        async def remote():
            value = await self.redis.get(self.prefix + key)
            return self._keep(key, value)

        return await self._redis_or_local("get", remote, lambda: self.local.get(key))

    async def set(self, key: str, value: str, ttl_s: int) -> None:
        # near first: an entry Redis has no room for, or refuses, still answers this replica
        self.near.put(key, value, min(ttl_s, self.near_ttl_s))

        async def remote() -> bool:
            if not await self._has_room():
                metrics.CACHE_WRITES_SKIPPED.inc()
                return False
            await self.redis.set(self.prefix + key, value, ex=ttl_s)
            return True

        local = lambda: self.local.set(key, value, ttl_s)  # noqa: E731
        await self._redis_or_local("set", remote, local, wrote=bool)

    async def _has_room(self) -> bool:
        """Whether Redis is below ``redis_share`` of its maxmemory (none set: always), as last seen."""
        now = self.clock()
        if now - self._room_checked >= ROOM_CHECK_S:
            self._room_checked = now
            try:
                memory = await self.redis.info("memory")
            except Exception as exc:
                if isinstance(exc, REDIS_DOWN) or refusing(exc):
                    raise
                # INFO refused (an ACL without @dangerous, a proxy, a renamed command): no share to
                # keep, as where no maxmemory is set
                if not self._blind:
                    log.warning("Redis does not say how full it is (%s): cache entries written", exc)
                    self._blind = True
                memory = {}
            most = int(memory.get("maxmemory", 0))
            room = most <= 0 or int(memory.get("used_memory", 0)) < self.redis_share * most
            if room != self._room:
                log.warning(
                    "Redis holds %d of its %d bytes: cache entries %s",
                    int(memory.get("used_memory", 0)),
                    most,
                    "written again" if room else f"no longer written past {self.redis_share:.0%}",
                )
            self._room = room
        return self._room

    async def incr(self, key: str, ttl_s: int) -> int:
        count, _ = await self._count(key, ttl_s, None)
        return count

    async def incr_and_get(self, counter: str, ttl_s: int, key: str) -> tuple[int, str | None]:
        near = self.near.peek(key)
        count, value = await self._count(counter, ttl_s, None if near is not None else key)
        return count, near if near is not None else value

    async def _count(self, counter: str, ttl_s: int, key: str | None) -> tuple[int, str | None]:
        async def remote():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.incr(self.prefix + counter)
                pipe.expire(self.prefix + counter, ttl_s, nx=True)  # the window starts at the first call
                if key is not None:
                    pipe.get(self.prefix + key)
                replies = await pipe.execute()
            return int(replies[0]), self._keep(key, replies[2]) if key is not None else None

        async def local():
            return await self.local.incr(counter, ttl_s), await self.local.get(key) if key else None

        return await self._redis_or_local("incr", remote, local, wrote=lambda _count: True)

    def _keep(self, key: str | None, value: bytes | str | None) -> str | None:
        """A value read from Redis, kept near for the next call."""
        if value is None or key is None:
            return None
        text = value.decode() if isinstance(value, bytes) else value
        self.near.put(key, text, self.near_ttl_s)
        return text


class _Expiring:
    """Keys with an expiry, least recently used first; at most ``max_items``, and ``max_bytes`` of
    keys and values where given."""

    def __init__(self, max_items: int, max_bytes: int | None, clock: Callable[[], float]) -> None:
        self.items: OrderedDict[str, tuple[float, str | int]] = OrderedDict()
        self.max_items, self.max_bytes, self.clock = max_items, max_bytes, clock
        self.bytes = 0

    def get(self, key: str) -> str | int | None:
        item = self.items.get(key)
        if item is None:
            return None
        if item[0] <= self.clock():
            self.drop(key)
            return None
        self.items.move_to_end(key)
        return item[1]

    def put(self, key: str, value: str | int, ttl_s: float, *, keep_expiry: bool = False) -> None:
        """``keep_expiry``: a key held already keeps its expiry (a count's window)."""
        expiry = self.clock() + ttl_s
        if key in self.items:
            if keep_expiry:
                expiry = self.items[key][0]
            self.drop(key)
        self.items[key] = (expiry, value)
        self.bytes += _size(key, value)
        while self.items and (
            len(self.items) > self.max_items or (self.max_bytes is not None and self.bytes > self.max_bytes)
        ):
            self.drop(next(iter(self.items)))

    def drop(self, key: str) -> None:
        _expiry, value = self.items.pop(key)
        self.bytes -= _size(key, value)


class MemoryStore:
    """Cache entries and call budgets in the process, each with an expiry. Entries are bounded in
    bytes too (``max_bytes``): a read's result is up to 400 KB (100,000 characters outside the
    BMP), so ten thousand of them were 4 GB. Budgets are kept apart, so that no number of large
    entries pushes a trajectory's count out and starts it again."""

    def __init__(self, max_items: int = 100_000, clock=time.monotonic, *, max_bytes: int = 256 << 20) -> None:
        self.cache = _Expiring(max_items, max_bytes, clock)
        self.counts = _Expiring(max_items, None, clock)

    def put(self, key: str, value: str, ttl_s: float) -> None:
        self.cache.put(key, value, ttl_s)

    def peek(self, key: str) -> str | None:
        """``get`` without a coroutine: the Redis store's near copies are read on every call."""
        value = self.cache.get(key)
        return value if isinstance(value, str) else None

    async def get(self, key: str) -> str | None:
        return self.peek(key)

    async def set(self, key: str, value: str, ttl_s: int) -> None:
        self.put(key, value, ttl_s)

    async def incr(self, key: str, ttl_s: int) -> int:
        count = int(self.counts.get(key) or 0) + 1  # an expired count is gone: a new window
        self.counts.put(key, count, ttl_s, keep_expiry=True)  # the window starts at the first call
        return count

    async def incr_and_get(self, counter: str, ttl_s: int, key: str) -> tuple[int, str | None]:
        return await self.incr(counter, ttl_s), self.peek(key)


def _size(key: str, value: str | int) -> int:
    return sys.getsizeof(key) + sys.getsizeof(value)
