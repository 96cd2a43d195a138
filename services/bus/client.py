"""The bus: typed publish/consume over Redis Streams (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from proto.base import Message, decode, encode
from proto.messages import DeadLetter
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

_MAX_CAUSE = 4000


@dataclass(frozen=True)
class ConsumerOptions:
    block_ms: int = 1000  # XREADGROUP block; also how often ``stop`` is checked
    count: int = 1  # entries fetched a read; handled one after another
    claim_idle_ms: int = 60_000  # pending this long without a heartbeat = the consumer is dead
    max_deliveries: int = 5  # beyond this the entry is dead-lettered
    done_ttl_s: int = 7 * 24 * 3600  # how long processed message ids are remembered
    trim_interval_s: float = 1.0  # at most one acknowledged-history trim per interval


@dataclass(frozen=True)
class Delivery:
    stream: str
    group: str
    consumer: str
    entry_id: str
    deliveries: int  # 1 on first delivery


Handler = Callable[[M, Delivery], Awaitable[None]]


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Bus:
    """One Redis connection pool, shared by every stream a service touches."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "pbsd", maxlen: int = 100_000) -> None:
        self.redis = client
        self.prefix = prefix
        self.maxlen = maxlen
        self._last_trim: dict[str, float] = {}

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Bus:
        return cls(aioredis.Redis.from_url(url, decode_responses=False), **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, stream: StreamDef) -> str:
        return stream.key(self.prefix)

    # -- publishing -----------------------------------------------------------------
    async def publish(self, stream: StreamDef[M], message: M) -> str:
        """XADD the message (approximate MAXLEN trim); returns the entry id."""
        if not isinstance(message, stream.model):
            raise TypeError(
                f"stream {stream.name!r} carries {stream.model.__name__}, got {type(message).__name__}"
            )
        payload = encode(message)
        entry_id = await self.redis.xadd(
            self.key(stream),
            {b"type": stream.model.__name__, b"mid": message.message_id, b"data": payload},
            maxlen=self.maxlen,
            approximate=True,
        )
        metrics.PUBLISHED.labels(stream.name).inc()
        metrics.PUBLISHED_BYTES.labels(stream.name).inc(len(payload))
        return _s(entry_id)

    # -- broadcast streams (weights) ------------------------------------------------
    async def latest(self, stream: StreamDef[M]) -> tuple[str, M] | None:
        """The newest entry of a stream, or None when it is empty."""
        entries = await self.redis.xrevrange(self.key(stream), count=1)
        if not entries:
            return None
        entry_id, fields = entries[0]
        return _s(entry_id), decode(stream.model, fields[b"data"])

    async def follow(
        self,
        stream: StreamDef[M],
        *,
        after: str = "$",
        block_ms: int = 1000,
        stop: asyncio.Event | None = None,
    ) -> AsyncIterator[tuple[str, M]]:
        """Every entry after ``after`` as it arrives (XREAD, no group: each reader sees all)."""
        last = after
        if last == "$":  # resolve now, so entries published while we process are not skipped
            newest = await self.redis.xrevrange(self.key(stream), count=1)
            last = _s(newest[0][0]) if newest else "0-0"
        while stop is None or not stop.is_set():
            reply = await self.redis.xread({self.key(stream): last}, count=16, block=block_ms)
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last = _s(entry_id)
                    try:
                        yield last, decode(stream.model, fields[b"data"])
                    except (ValueError, KeyError) as exc:
                        log.error("skipping undecodable %s entry %s: %s", stream.name, last, exc)

    async def read_all(self, stream: StreamDef[M], *, count: int = 1000) -> list[tuple[str, M]]:
        """The first ``count`` entries still on a stream (for inspection and tests)."""
        entries = await self.redis.xrange(self.key(stream), count=count)
        return [(_s(i), decode(stream.model, f[b"data"])) for i, f in entries]

    # -- consumer groups -------------------------------------------------------------
    async def ensure_group(self, stream: StreamDef, group: str | None = None) -> None:
        """Create the consumer group (and the stream) unless it exists; safe to call concurrently."""
        group = group or stream.group
        if group is None:
            raise ValueError(f"stream {stream.name!r} has no consumer group")
        try:
            await self.redis.xgroup_create(self.key(stream), group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(
        self,
        stream: StreamDef[M],
        consumer: str,
        handler: Handler,
        *,
        group: str | None = None,
        options: ConsumerOptions = ConsumerOptions(),
        stop: asyncio.Event | None = None,
    ) -> None:
        """Process entries of ``stream`` for ``group`` until ``stop`` is set."""
        group = group or stream.group
        await self.ensure_group(stream, group)
        key = self.key(stream)
        claim_cursor = "0-0"
        next_claim = 0.0
        while stop is None or not stop.is_set():
            batch: list[tuple[str, dict, bool]] = []
            now = time.monotonic()
            if now >= next_claim:  # take over what dead consumers left behind
                claim_cursor, claimed = await self._autoclaim(key, group, consumer, options, claim_cursor)
                batch = [(i, f, True) for i, f in claimed]
                if claim_cursor == "0-0":
                    next_claim = now + options.claim_idle_ms / 2000
            if not batch:
                reply = await self.redis.xreadgroup(
                    group, consumer, {key: ">"}, count=options.count, block=options.block_ms
                )
                batch = [(_s(i), f, False) for _k, entries in reply or [] for i, f in entries]
            for entry_id, fields, reclaimed in batch:
                if reclaimed:
                    metrics.RECLAIMED.labels(stream.name, group).inc()
                await self._deliver(stream, group, consumer, entry_id, fields, reclaimed, handler, options)
            if batch:
                await self._maybe_trim(stream, options)

    async def _autoclaim(
        self, key: str, group: str, consumer: str, options: ConsumerOptions, cursor: str
    ) -> tuple[str, list[tuple[str, dict]]]:
        reply = await self.redis.xautoclaim(
            key, group, consumer, options.claim_idle_ms, start_id=cursor, count=options.count
        )
        next_cursor, entries = _s(reply[0]), reply[1]
        # Entries trimmed while pending come back without fields: nothing left to process.
        return next_cursor, [(_s(i), f) for i, f in entries if f]

    async def _deliveries(self, key: str, group: str, entry_id: str) -> int:
        rows = await self.redis.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 1

    def _errors_key(self, stream: StreamDef, group: str) -> str:
        return f"{self.prefix}:errors:{stream.name}:{group}"

    def _done_key(self, stream: StreamDef, group: str, message_id: str) -> str:
        return f"{self.prefix}:done:{stream.name}:{group}:{message_id}"

    async def _deliver(
        self,
        stream: StreamDef[M],
        group: str,
        consumer: str,
        entry_id: str,
        fields: dict,
        reclaimed: bool,
        handler: Handler,
        options: ConsumerOptions,
    ) -> None:
        key = self.key(stream)
        payload = fields.get(b"data", b"")
        deliveries = await self._deliveries(key, group, entry_id) if reclaimed else 1
        if deliveries > options.max_deliveries:
            last_error = await self.redis.hget(self._errors_key(stream, group), entry_id)
            cause = f"gave up after {deliveries - 1} deliveries; last error: {_s(last_error) if last_error else 'consumer died'}"
            await self._dead_letter(stream, group, entry_id, payload, cause, deliveries, "max_deliveries")
            return
        try:
            message = decode(stream.model, payload)
        except (ValidationError, ValueError) as exc:
            await self._dead_letter(
                stream,
                group,
                entry_id,
                payload,
                f"invalid {stream.model.__name__}: {exc}",
                deliveries,
                "invalid",
            )
            return
        done_key = self._done_key(stream, group, message.message_id)
        if await self.redis.exists(done_key):
            metrics.DUPLICATES.labels(stream.name, group).inc()
            await self.redis.xack(key, group, entry_id)
            return

        delivery = Delivery(stream.name, group, consumer, entry_id, deliveries)
        heartbeat = asyncio.create_task(self._heartbeat(key, group, consumer, entry_id, options))
        started = time.perf_counter()
        try:
            await handler(message, delivery)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the handler's failure is data: record it and let the entry be retried
            metrics.HANDLER_ERRORS.labels(stream.name, group).inc()
            log.exception("handler failed on %s entry %s (delivery %d)", stream.name, entry_id, deliveries)
            await self.redis.hset(
                self._errors_key(stream, group), entry_id, f"{type(exc).__name__}: {exc}"[:_MAX_CAUSE]
            )
            return
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            metrics.HANDLER_SECONDS.labels(stream.name, group).observe(time.perf_counter() - started)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(done_key, b"1", ex=options.done_ttl_s)
            pipe.xack(key, group, entry_id)
            pipe.hdel(self._errors_key(stream, group), entry_id)
            await pipe.execute()
        metrics.CONSUMED.labels(stream.name, group).inc()

    async def _heartbeat(
        self, key: str, group: str, consumer: str, entry_id: str, options: ConsumerOptions
    ) -> None:
        """Reset the entry's idle time while the handler runs, so no one reclaims it."""
        interval = max(options.claim_idle_ms / 3000, 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.redis.xclaim(key, group, consumer, 0, [entry_id], justid=True)
            except Exception:  # a missed beat only risks a duplicate, which idempotency absorbs
                log.warning("heartbeat for %s %s failed", key, entry_id, exc_info=True)

    async def _dead_letter(
        self,
        stream: StreamDef,
        group: str,
        entry_id: str,
        payload: bytes,
        cause: str,
        deliveries: int,
        reason: str,
    ) -> None:
        letter = DeadLetter(
            stream=stream.name,
            group=group,
            entry_id=entry_id,
            cause=cause[:_MAX_CAUSE],
            deliveries=deliveries,
            payload=bytes(payload),
        )
        log.error("dead-lettering %s entry %s: %s", stream.name, entry_id, cause[:500])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.key(DEAD_LETTERS),
                {b"type": b"DeadLetter", b"mid": letter.message_id, b"data": encode(letter)},
                maxlen=self.maxlen,
                approximate=True,
            )
            pipe.xack(self.key(stream), group, entry_id)
            pipe.hdel(self._errors_key(stream, group), entry_id)
            await pipe.execute()
        metrics.DEAD_LETTERED.labels(stream.name, group, reason).inc()

    # -- trimming -------------------------------------------------------------------
    async def _maybe_trim(self, stream: StreamDef, options: ConsumerOptions) -> None:
        now = time.monotonic()
        if now - self._last_trim.get(stream.name, 0.0) >= options.trim_interval_s:
            self._last_trim[stream.name] = now
            await self.trim_acked(stream)

    async def trim_acked(self, stream: StreamDef, *, approximate: bool = False) -> int:
        """Delete entries every consumer group has delivered and acknowledged; returns how many."""
        key = self.key(stream)
        try:
            groups = await self.redis.xinfo_groups(key)
        except ResponseError:  # no such stream yet
            return 0
        if not groups:
            return 0
        floor: str | None = None
        for info in groups:
            name = _s(info["name"])
            summary = await self.redis.xpending(key, name)
            candidate = _s(summary["min"]) if summary["pending"] else _next_id(_s(info["last-delivered-id"]))
            if floor is None or _id_tuple(candidate) < _id_tuple(floor):
                floor = candidate
        if floor is None or floor == "0-1":
            return 0
        return int(await self.redis.xtrim(key, minid=floor, approximate=approximate))

    async def stream_length(self, stream: StreamDef) -> int:
        return int(await self.redis.xlen(self.key(stream)))

    async def dead_letters(self, count: int = 1000) -> list[DeadLetter]:
        return [m for _i, m in await self.read_all(DEAD_LETTERS, count=count)]
