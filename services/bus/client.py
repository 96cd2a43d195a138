"""The bus: typed publish/consume over Redis Streams (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proto.base import Message, decode, encode
from proto.messages import DeadLetter
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics
from services.tasks import cancel_and_wait, within

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# what Redis being out of reach raises (a refused or broken connection, a timeout)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)

_MAX_CAUSE = 4000

# Heartbeats a consumer may miss in a row before what it holds counts as abandoned: enough that a
# loaded event loop or a short network blip never hands live work to another consumer, few
# enough that a dead consumer's work moves on within a minute at the default heartbeat.
MISSED_BEATS = 10


@dataclass(frozen=True)
class ConsumerOptions:
    block_ms: int = 1000  # XREADGROUP block; also how often ``stop`` is checked
    count: int = 1  # entries fetched a read; handled one after another
    heartbeat_ms: int = 5_000  # how often a live consumer renews the idle time of what it holds
    max_deliveries: int = 5  # beyond this the entry is dead-lettered
    done_ttl_s: int = 7 * 24 * 3600  # how long processed message ids are remembered
    trim_interval_s: float = 1.0  # at most one acknowledged-history trim per interval

    @property
    def claim_idle_ms(self) -> int:
        """Pending this long without a heartbeat, an entry's consumer is taken for dead and another
        consumer (any name) takes the entry over: ``MISSED_BEATS`` heartbeats. Consumers look for
        such entries once a heartbeat, so a dead consumer's work moves on within
        ``(MISSED_BEATS + 1) * heartbeat_ms`` (55 s at the default heartbeat)."""
        return self.heartbeat_ms * MISSED_BEATS


@dataclass(frozen=True)
class Delivery:
    stream: str
    group: str
    consumer: str
    entry_id: str
    deliveries: int  # 1 on first delivery


Handler = Callable[[M, Delivery], Awaitable[None]]


@dataclass
class _Cursor:
    position: str = "0-0"  # XAUTOCLAIM scan position over the pending entries
    next_claim: float = 0.0  # when to scan for abandoned entries again
    # position in this consumer's own pending entries, read first (None once read): what a previous
    # process of the same name held when it stopped comes back at once, not after claim_idle_ms
    own: str | None = "0-0"


class Held(Generic[M]):
    """Messages collected and kept pending (heartbeat running) until the bus commits them."""

    def __init__(
        self, bus: Bus, stream: StreamDef[M], group: str, consumer: str, options: ConsumerOptions
    ) -> None:
        self.stream, self.group, self.options = stream, group, options
        self.items: list[tuple[str, M]] = []
        self._ids: list[str] = []
        self._beat = asyncio.create_task(bus._heartbeat(bus.key(stream), group, consumer, self._ids, options))

    def add(self, entry_id: str, message: M) -> None:
        self.items.append((entry_id, message))
        self._ids.append(entry_id)

    @property
    def messages(self) -> list[M]:
        return [m for _, m in self.items]

    def stop_heartbeat(self) -> None:
        self._beat.cancel()


class _Outage:
    """Riding out a Redis outage in a consumer's loop instead of dying of it: wait with backoff
    (0.5 s doubling to 10 s) and try again; an entry being handled when it struck stays pending
    and comes back (at-least-once). A Redis restarted without persistence has lost the consumer
    group (NOGROUP): it is created again. Any other error is raised."""

    def __init__(self, bus: Bus, stream: StreamDef, group: str) -> None:
        self.bus, self.stream, self.group = bus, stream, group
        self.delay = 0.5

    def over(self) -> None:
        self.delay = 0.5

    async def wait(self, exc: Exception, stop: asyncio.Event | None) -> None:
        if isinstance(exc, ResponseError):
            if "NOGROUP" not in str(exc):
                raise exc
            log.warning(
                "the group %s of %s is gone (Redis restarted empty?): creating it again",
                self.group,
                self.stream.name,
            )
            with contextlib.suppress(*REDIS_DOWN):
                await self.bus.ensure_group(self.stream, self.group)
                return
        else:
            log.warning(
                "Redis is unreachable for %s (%s); trying again in %.1f s", self.stream.name, exc, self.delay
            )
        metrics.OUTAGES.labels(self.stream.name).inc()
        await within(self.delay, (stop or asyncio.Event()).wait())
        self.delay = min(self.delay * 2, 10.0)


def redis_client(url: str, *, patience_s: float = 0.0) -> aioredis.Redis:
    """A client whose every command rides out a Redis outage of up to about ``patience_s``
    seconds (a restart, a failover, a blip of the network): it reconnects and sends the command
    again after 0.25 s, doubling to 5 s between tries. A command whose connection broke after
    Redis ran it may run twice; the bus's consumers deduplicate by message id and the run
    store's writes are idempotent or append one record. 0: no retries."""
    backoff = ExponentialBackoff(cap=5.0, base=0.25)
    retries, waited = 0, 0.0
    while waited < patience_s:
        waited += backoff.compute(retries)
        retries += 1
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(backoff, retries),
        retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=5.0,  # a host that is gone (not refusing) must not hang a try
    )


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _check_type(stream: StreamDef, message: Message) -> None:
    if not isinstance(message, stream.model):
        raise TypeError(
            f"stream {stream.name!r} carries {stream.model.__name__}, got {type(message).__name__}"
        )


def _ids(entries: list[tuple]) -> str:
    """The entry ids of a batch, for a log line (the first few, and how many more)."""
    shown = ", ".join(e[0] for e in entries[:5])
    return shown + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


class Bus:
    """One Redis connection pool, shared by every stream a service touches."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "pbsd", maxlen: int = 100_000) -> None:
        self.redis = client
        self.prefix = prefix
        self.maxlen = maxlen
        self._last_trim: dict[str, float] = {}

    @classmethod
    def from_url(cls, url: str, *, patience_s: float = 0.0, **kwargs: Any) -> Bus:
        """``patience_s``: how long each command waits out a Redis outage (:func:`redis_client`)."""
        return cls(redis_client(url, patience_s=patience_s), **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, stream: StreamDef) -> str:
        return stream.key(self.prefix)

    # -- publishing -----------------------------------------------------------------
    async def publish(self, stream: StreamDef[M], message: M) -> str:
        """XADD the message (approximate MAXLEN trim); returns the entry id."""
        _check_type(stream, message)
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

    # Entries the group has not been delivered yet are after its last-delivered-id: they are taken
    # off, the new messages added, and they are added back behind them, unchanged and in their order.
    # One script, so no consumer reads the stream halfway through.
    _AHEAD = """
    local last = '0-0'
    for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
        local fields = {}
        for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
        if fields['name'] == ARGV[1] then last = fields['last-delivered-id'] end
    end
    local queued = redis.call('XRANGE', KEYS[1], '(' .. last, '+')
    for _, entry in ipairs(queued) do redis.call('XDEL', KEYS[1], entry[1]) end
    for i = 3, #ARGV, 2 do
        redis.call('XADD', KEYS[1], '*', 'type', ARGV[2], 'mid', ARGV[i], 'data', ARGV[i + 1])
    end
    for _, entry in ipairs(queued) do redis.call('XADD', KEYS[1], '*', unpack(entry[2])) end
    return #queued
    """

    async def publish_ahead(self, stream: StreamDef[M], messages: list[M]) -> int:
        """Publish ``messages`` ahead of every entry the stream's group has not been delivered yet: the
        group reads them next. The entries queued behind them keep their payloads and their order but
        get new entry ids. Returns how many entries were queued behind them."""
        if not messages:
            return 0
        for message in messages:
            _check_type(stream, message)
        await self.ensure_group(stream)
        payloads = [encode(m) for m in messages]
        args = [x for m, p in zip(messages, payloads, strict=True) for x in (m.message_id, p)]
        moved = await self.redis.eval(
            self._AHEAD, 1, self.key(stream), stream.group, stream.model.__name__, *args
        )
        metrics.PUBLISHED.labels(stream.name).inc(len(messages))
        metrics.PUBLISHED_BYTES.labels(stream.name).inc(sum(len(p) for p in payloads))
        return int(moved)

    # -- broadcast streams (weights) ------------------------------------------------
    async def latest(self, stream: StreamDef[M]) -> tuple[str, M] | None:
        """The newest entry of a stream, or None when it is empty."""
        entries = await self.redis.xrevrange(self.key(stream), count=1)
        if not entries:
            return None
        entry_id, fields = entries[0]
        return _s(entry_id), decode(stream.model, fields[b"data"])

    async def newest(self, stream: StreamDef[M], count: int) -> list[tuple[str, M]]:
        """The newest ``count`` entries of a stream, oldest first (undecodable ones logged and left out)."""
        out = []
        for entry_id, fields in reversed(await self.redis.xrevrange(self.key(stream), count=count)):
            try:
                out.append((_s(entry_id), decode(stream.model, fields[b"data"])))
            except (ValueError, KeyError) as exc:
                log.error("skipping undecodable %s entry %s: %s", stream.name, _s(entry_id), exc)
        return out

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
        """Process entries of ``stream`` for ``group`` one at a time until ``stop`` is set."""
        group = group or stream.group
        await self.ensure_group(stream, group)
        metrics.consumer_series(stream.name, group)
        cursor = _Cursor()
        outage = _Outage(self, stream, group)
        while stop is None or not stop.is_set():
            try:
                batch = await self._fetch(stream, group, consumer, options, cursor, options.count)
                for entry_id, fields, reclaimed in batch:
                    admitted = await self._admit(stream, group, entry_id, fields, reclaimed, options)
                    if admitted is not None:
                        await self._handle(stream, group, consumer, entry_id, admitted, handler, options)
                if batch:
                    await self._maybe_trim(stream, options)
                outage.over()
            except (*REDIS_DOWN, ResponseError) as exc:
                await outage.wait(exc, stop)

    async def collect(
        self,
        stream: StreamDef[M],
        consumer: str,
        want: int,
        accept: Callable[[M], Awaitable[bool]],
        *,
        group: str | None = None,
        options: ConsumerOptions = ConsumerOptions(),
        stop: asyncio.Event | None = None,
    ) -> Held[M]:
        """Gather ``want`` messages that ``accept`` keeps, holding them pending (with a heartbeat) until
        :meth:`commit`: a consumer that dies before committing leaves them to be reclaimed. Messages
        ``accept`` rejects are acknowledged at once. Returns early, with fewer, when ``stop`` is set."""
        group = group or stream.group
        await self.ensure_group(stream, group)
        metrics.consumer_series(stream.name, group)
        held = Held(self, stream, group, consumer, options)
        cursor = _Cursor()
        outage = _Outage(self, stream, group)
        try:
            while len(held.items) < want and (stop is None or not stop.is_set()):
                try:
                    fetched = await self._fetch(
                        stream, group, consumer, options, cursor, want - len(held.items)
                    )
                    outage.over()
                except (*REDIS_DOWN, ResponseError) as exc:
                    await outage.wait(exc, stop)
                    continue
                for entry_id, fields, reclaimed in fetched:
                    admitted = await self._admit(stream, group, entry_id, fields, reclaimed, options)
                    if admitted is None:
                        continue
                    message = admitted[0]
                    if await accept(message):
                        held.add(entry_id, message)
                    else:
                        await self._commit(stream, group, [(entry_id, message)], options)
        except BaseException:
            held.stop_heartbeat()
            raise
        return held

    async def commit(self, held: Held) -> None:
        """Mark the held messages processed and acknowledge them, atomically."""
        held.stop_heartbeat()
        if held.items:
            await self._commit(held.stream, held.group, held.items, held.options)
            metrics.CONSUMED.labels(held.stream.name, held.group).inc(len(held.items))
            await self._maybe_trim(held.stream, held.options)
        held.items = []

    # -- the steps every consumer shares ------------------------------------------------
    async def _fetch(
        self,
        stream: StreamDef,
        group: str,
        consumer: str,
        options: ConsumerOptions,
        cursor: _Cursor,
        count: int,
    ) -> list[tuple[str, dict, bool]]:
        """Entries a dead consumer left behind (now and then), else new ones (blocking read)."""
        key = self.key(stream)
        if cursor.own is not None:
            reply = await self.redis.xreadgroup(group, consumer, {key: cursor.own}, count=count)
            entries = [(_s(i), f) for _k, batch in reply or [] for i, f in batch]
            cursor.own = entries[-1][0] if entries else None
            mine = [(i, f, True) for i, f in entries if f]  # trimmed entries come back without fields
            if mine:
                metrics.RECLAIMED.labels(stream.name, group).inc(len(mine))
                log.info(
                    "%s took back %d %s entries it held before it stopped: %s",
                    consumer,
                    len(mine),
                    stream.name,
                    _ids(mine),
                )
                return mine
            if entries:
                return []
        now = time.monotonic()
        if now >= cursor.next_claim:
            cursor.position, claimed = await self._autoclaim(
                stream, group, consumer, options, cursor.position, count
            )
            if cursor.position == "0-0":
                cursor.next_claim = now + options.heartbeat_ms / 1000
            if claimed:
                metrics.RECLAIMED.labels(stream.name, group).inc(len(claimed))
                log.warning(
                    "%s took over %d %s entries a dead consumer left (no heartbeat for %.0f s): %s",
                    consumer,
                    len(claimed),
                    stream.name,
                    options.claim_idle_ms / 1000,
                    _ids(claimed),
                )
                return [(i, f, True) for i, f in claimed]
        reply = await self.redis.xreadgroup(group, consumer, {key: ">"}, count=count, block=options.block_ms)
        return [(_s(i), f, False) for _k, entries in reply or [] for i, f in entries]

    async def _autoclaim(
        self, stream: StreamDef, group: str, consumer: str, options: ConsumerOptions, cursor: str, count: int
    ) -> tuple[str, list[tuple[str, dict]]]:
        reply = await self.redis.xautoclaim(
            self.key(stream), group, consumer, options.claim_idle_ms, start_id=cursor, count=count
        )
        next_cursor, entries = _s(reply[0]), reply[1]
        # Entries trimmed away while pending (a backlog past MAXLEN) are gone: Redis 7 lists their
        # ids third and drops them from the pending list. Never silent: each is a dead letter.
        for entry_id in reply[2] if len(reply) > 2 else []:
            await self._dead_letter(
                stream,
                group,
                _s(entry_id),
                b"",
                "trimmed from the stream (MAXLEN) before it was processed; the payload is lost",
                0,
                "trimmed",
            )
        return next_cursor, [(_s(i), f) for i, f in entries if f]

    async def _deliveries(self, key: str, group: str, entry_id: str) -> int:
        rows = await self.redis.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 1

    def _errors_key(self, stream: StreamDef, group: str) -> str:
        return f"{self.prefix}:errors:{stream.name}:{group}"

    def _done_key(self, stream: StreamDef, group: str, message_id: str) -> str:
        return f"{self.prefix}:done:{stream.name}:{group}:{message_id}"

    async def _admit(
        self,
        stream: StreamDef[M],
        group: str,
        entry_id: str,
        fields: dict,
        reclaimed: bool,
        options: ConsumerOptions,
    ) -> tuple[M, int] | None:
        """The decoded message and its delivery count, or None when the entry was dealt with here:
        dead-lettered (undecodable, or delivered too often) or acknowledged as already processed."""
        key = self.key(stream)
        payload = fields.get(b"data", b"")
        deliveries = await self._deliveries(key, group, entry_id) if reclaimed else 1
        if deliveries > options.max_deliveries:
            last_error = await self.redis.hget(self._errors_key(stream, group), entry_id)
            cause = f"gave up after {deliveries - 1} deliveries; last error: {_s(last_error) if last_error else 'consumer died'}"
            await self._dead_letter(stream, group, entry_id, payload, cause, deliveries, "max_deliveries")
            return None
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
            return None
        if await self.redis.exists(self._done_key(stream, group, message.message_id)):
            metrics.DUPLICATES.labels(stream.name, group).inc()
            await self.redis.xack(key, group, entry_id)
            return None
        return message, deliveries

    async def _handle(
        self,
        stream: StreamDef[M],
        group: str,
        consumer: str,
        entry_id: str,
        admitted: tuple[M, int],
        handler: Handler,
        options: ConsumerOptions,
    ) -> None:
        message, deliveries = admitted
        delivery = Delivery(stream.name, group, consumer, entry_id, deliveries)
        heartbeat = asyncio.create_task(
            self._heartbeat(self.key(stream), group, consumer, [entry_id], options)
        )
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
            await cancel_and_wait(heartbeat)
            metrics.HANDLER_SECONDS.labels(stream.name, group).observe(time.perf_counter() - started)
        await self._commit(stream, group, [(entry_id, message)], options)
        metrics.CONSUMED.labels(stream.name, group).inc()

    async def _commit(
        self, stream: StreamDef, group: str, items: list[tuple[str, Message]], options: ConsumerOptions
    ) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, message in items:
                pipe.set(self._done_key(stream, group, message.message_id), b"1", ex=options.done_ttl_s)
                pipe.xack(self.key(stream), group, entry_id)
                pipe.hdel(self._errors_key(stream, group), entry_id)
            await pipe.execute()

    async def _heartbeat(
        self, key: str, group: str, consumer: str, entry_ids: list[str], options: ConsumerOptions
    ) -> None:
        """Reset the entries' idle time while they are being worked on, so no one reclaims them."""
        interval = max(options.heartbeat_ms / 1000, 0.05)
        while True:
            await asyncio.sleep(interval)
            if not entry_ids:
                continue
            try:
                await self.redis.xclaim(key, group, consumer, 0, list(entry_ids), justid=True)
            except Exception:  # a missed beat only risks a duplicate, which idempotency absorbs
                log.warning("heartbeat for %s failed", key, exc_info=True)

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
