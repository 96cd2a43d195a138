"""The bus's consumer groups: at-least-once delivery over XREADGROUP (the package docstring says
what is guaranteed). :class:`ConsumerGroups` is the half of :class:`services.bus.Bus` that reads
for a group: one message at a time (``consume``) or a batch held until committed (``collect``),
with heartbeats, the takeover of a dead consumer's entries and dead letters; the trimming of
what every group has acknowledged is :mod:`services.bus.trimming`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from proto.base import Message, decode, encode
from proto.messages import DeadLetter
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics
from services.bus.connection import REDIS_DOWN, as_text, missing, refusing
from services.bus.delivery import ConsumerOptions, Cursor, Delivery, Handler, Held, MessageTooLarge, Outage
from services.bus.trimming import Trimming
from services.tasks import cancel_and_wait

log = logging.getLogger(__name__)

__all__ = ["ConsumerGroups"]

M = TypeVar("M", bound=Message)

_MAX_CAUSE = 4000
DEFAULT_OPTIONS = ConsumerOptions()


def _ids(entries: list[tuple]) -> str:
    """The entry ids of a batch, for a log line (the first few, and how many more)."""
    shown = ", ".join(e[0] for e in entries[:5])
    return shown + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


class ConsumerGroups(Trimming):
    """Reading streams for consumer groups. Mixed into :class:`services.bus.Bus`, whose ``redis``,
    ``prefix`` and ``maxlen`` it uses."""

    redis: aioredis.Redis
    prefix: str
    maxlen: int

    # -- consumer groups -------------------------------------------------------------
    async def ensure_group(self, stream: StreamDef, group: str | None = None, *, start: str = "0") -> None:
        """Create the consumer group (and the stream) unless it exists; safe to call concurrently.
        ``start``: the entry after which a new group reads, the stream's beginning unless told
        (``"$"``: only what comes from now on)."""
        group = group or stream.group
        if group is None:
            raise ValueError(f"stream {stream.name!r} has no consumer group")
        try:
            await self.redis.xgroup_create(self.key(stream), group, id=start, mkstream=True)
        except ResponseError as exc:
            if refusing(exc):  # full, or read-only for now: reading finds out (NOGROUP, or it refuses too)
                log.warning("Redis refuses to make the group %s of %s for now: %s", group, stream.name, exc)
            elif "BUSYGROUP" not in str(exc):
                raise

    async def consume(
        self,
        stream: StreamDef[M],
        consumer: str,
        handler: Handler,
        *,
        group: str | None = None,
        options: ConsumerOptions = DEFAULT_OPTIONS,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Process entries of ``stream`` for ``group`` one at a time until ``stop`` is set."""
        group = group or stream.group
        await self.ensure_group(stream, group)
        metrics.consumer_series(stream.name, group)
        cursor = Cursor()
        outage = Outage(self, stream, group)
        while stop is None or not stop.is_set():
            try:
                batch = await self._fetch(stream, group, consumer, options, cursor, options.count)
                for entry_id, fields, reclaimed in batch:
                    if stop is not None and stop.is_set():  # a read that ended after the stop:
                        break  # left pending, for release() to hand back
                    admitted = await self._admit(stream, group, entry_id, fields, reclaimed, options)
                    if admitted is not None:
                        await self._handle(stream, group, consumer, entry_id, admitted, handler, options)
                if batch:
                    await self._maybe_trim(stream, group, options)
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
        options: ConsumerOptions = DEFAULT_OPTIONS,
        stop: asyncio.Event | None = None,
    ) -> Held[M]:
        """Gather ``want`` messages that ``accept`` keeps, holding them pending (with a heartbeat) until
        :meth:`commit`: a consumer that dies before committing leaves them to be reclaimed. Messages
        ``accept`` rejects are acknowledged at once. Returns early, with fewer, when ``stop`` is set."""
        group = group or stream.group
        await self.ensure_group(stream, group)
        metrics.consumer_series(stream.name, group)
        held = Held(self, stream, group, consumer, options)
        cursor = Cursor()
        outage = Outage(self, stream, group)
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
            await self._maybe_trim(held.stream, held.group, held.options)
        held.items = []

    # -- the steps every consumer shares ------------------------------------------------
    async def _fetch(
        self,
        stream: StreamDef,
        group: str,
        consumer: str,
        options: ConsumerOptions,
        cursor: Cursor,
        count: int,
    ) -> list[tuple[str, dict, bool]]:
        """Entries a dead consumer left behind (now and then), else new ones (blocking read)."""
        key = self.key(stream)
        if cursor.own is not None:
            reply = await self.redis.xreadgroup(group, consumer, {key: cursor.own}, count=count)
            entries = [(as_text(i), f) for _k, batch in reply or [] for i, f in batch]
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
        return [(as_text(i), f, False) for _k, entries in reply or [] for i, f in entries]

    async def _autoclaim(
        self, stream: StreamDef, group: str, consumer: str, options: ConsumerOptions, cursor: str, count: int
    ) -> tuple[str, list[tuple[str, dict]]]:
        reply = await self.redis.xautoclaim(
            self.key(stream), group, consumer, options.claim_idle_ms, start_id=cursor, count=count
        )
        next_cursor, entries = as_text(reply[0]), reply[1]
        # Entries trimmed away while pending (a backlog past MAXLEN) are gone: Redis 7 lists their
        # ids third and drops them from the pending list. Never silent: each is a dead letter.
        for entry_id in reply[2] if len(reply) > 2 else []:
            await self._dead_letter(
                stream,
                group,
                as_text(entry_id),
                b"",
                "trimmed from the stream (MAXLEN) before it was processed; the payload is lost",
                0,
                "trimmed",
            )
        return next_cursor, [(as_text(i), f) for i, f in entries if f]

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
            cause = f"gave up after {deliveries - 1} deliveries; last error: {as_text(last_error) if last_error else 'consumer died'}"
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
        except MessageTooLarge as exc:  # what it made cannot be sent, this time or the next
            await self._dead_letter(
                stream, group, entry_id, encode(message), str(exc), deliveries, "too_large"
            )
            return
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

    # Reset the idle time of the entries this consumer still owns, and of no other: an XCLAIM with
    # min-idle 0 claims whatever it is given, so a consumer whose loop stalled past the takeover
    # would take its entries back from the one that took them over, and both would work them.
    _RENEW = """
    local owned = {}
    for i = 3, #ARGV do
        local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
        if #p > 0 then owned[#owned + 1] = ARGV[i] end
    end
    if #owned > 0 then
        local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
        for _, id in ipairs(owned) do args[#args + 1] = id end
        args[#args + 1] = 'JUSTID'  -- the delivery counter stays where it is
        redis.call(unpack(args))
    end
    return owned
    """

    async def renew(self, key: str, group: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of those of ``entry_ids`` that ``consumer`` still owns; returns them."""
        owned = await self.redis.eval(self._RENEW, 1, key, group, consumer, *entry_ids)
        return [as_text(i) for i in owned]

    # Hand back what a leaving consumer still owns: each entry's idle time is set past any
    # consumer's takeover threshold (heartbeats are at most 60 s apart, and an entry is taken over
    # after ten missed ones), so a live consumer's next XAUTOCLAIM, within its heartbeat, takes it
    # instead of waiting out the threshold. XPENDING names only the leaving consumer's entries, so
    # one another consumer took over meanwhile stays where it is. The delivery count is set one
    # below what it is, since the takeover counts one: a worker that was stopped did not fail on
    # the entry, and a long group handed on through a rolling update would otherwise reach
    # max_deliveries and be dead-lettered. An entry whose message is gone from the stream is left
    # for the takeover, which dead-letters it (XCLAIM would drop it without a word). One XCLAIM
    # an entry: a consumer holds a few.
    _RELEASE = """
    local released = {}
    for c = 4, #ARGV do
        local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[2]), ARGV[c])
        for _, p in ipairs(pending) do
            if #redis.call('XRANGE', KEYS[1], p[1], p[1]) > 0 then
                redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[c], 0, p[1],
                           'IDLE', ARGV[3], 'RETRYCOUNT', math.max(p[4] - 1, 0), 'JUSTID')
                released[#released + 1] = p[1]
            end
        end
    end
    return released
    """
    RELEASED_IDLE_MS = 24 * 3600 * 1000

    async def release(
        self, stream: StreamDef, consumers: list[str], *, group: str | None = None, limit: int = 1_000
    ) -> list[str]:
        """Hand the entries ``consumers`` still hold pending to the group's other consumers at
        once (a worker leaving, whose work in flight would otherwise wait out the takeover); call
        it once the consumers' handlers have stopped, or their heartbeats claim the entries back.
        One command for all of them: a Redis that is gone costs one command's patience. Returns
        the ids handed back."""
        group = group or stream.group
        if not consumers:
            return []
        try:
            ids = await self.redis.eval(
                self._RELEASE, 1, self.key(stream), group, limit, self.RELEASED_IDLE_MS, *consumers
            )
        except ResponseError as exc:
            if missing(exc):  # no group (its run ended) or no stream: nothing to hand back
                return []
            raise
        released = [as_text(i) for i in ids]
        if released:
            log.info(
                "%s handed back %d %s entries as they left: %s",
                ", ".join(consumers[:4]) + (", ..." if len(consumers) > 4 else ""),
                len(released),
                stream.name,
                released[:10],
            )
        return released

    async def _heartbeat(
        self, key: str, group: str, consumer: str, entry_ids: list[str], options: ConsumerOptions
    ) -> None:
        """Reset the entries' idle time while they are being worked on, so no one reclaims them."""
        interval = max(options.heartbeat_ms / 1000, 0.05)
        while True:
            await asyncio.sleep(interval)
            if not entry_ids:
                continue
            held = list(entry_ids)  # the list changes as entries are added and acknowledged
            try:
                owned = await self.renew(key, group, consumer, held)
            except Exception as exc:  # a missed beat only risks a duplicate, which idempotency absorbs
                if missing(exc):  # the group is gone (its run ended, or Redis lost it): nothing to keep
                    return
                log.warning("heartbeat for %s failed", key, exc_info=True)
                continue
            if lost := set(held) - set(owned):
                log.warning("%s: %d entries were taken over by another consumer while held", key, len(lost))

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
