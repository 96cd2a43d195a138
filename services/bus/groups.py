"""The bus's consumer groups: at-least-once delivery over XREADGROUP (the package docstring says
what is guaranteed). :class:`ConsumerGroups` is the half of :class:`services.bus.Bus` that reads
for a group: one message at a time (``consume``) or a batch held until committed (``collect``),
with the takeover of a dead consumer's entries and dead letters. The heartbeat and the hand-back
of what a consumer holds are :mod:`services.bus.leases`; the trimming of what every group has
acknowledged is :mod:`services.bus.trimming`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from proto.base import Message, encode
from proto.streams import StreamDef
from services.bus import metrics
from services.bus.claims import payload_of
from services.bus.connection import REDIS_DOWN, as_text, refusing
from services.bus.dead_lettering import MAX_CAUSE, DeadLettering
from services.bus.decoding import decoded
from services.bus.delivery import (
    ConsumerOptions,
    Cursor,
    Delivery,
    Handler,
    Held,
    MessageTooLarge,
    Outage,
)
from services.bus.leases import Leases
from services.bus.trimming import Trimming

log = logging.getLogger(__name__)

__all__ = ["ConsumerGroups"]

M = TypeVar("M", bound=Message)

DEFAULT_OPTIONS = ConsumerOptions()


def _ids(entries: list[tuple]) -> str:
    """The entry ids of a batch, for a log line (the first few, and how many more)."""
    shown = ", ".join(e[0] for e in entries[:5])
    return shown + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")


class ConsumerGroups(DeadLettering, Leases, Trimming):
    """Reading streams for consumer groups. Mixed into :class:`services.bus.Bus`, whose ``redis``,
    ``prefix`` and ``maxlen`` it uses."""

    redis: aioredis.Redis
    prefix: str
    maxlen: int

    # -- consumer groups -------------------------------------------------------------
    async def ensure_group(self, stream: StreamDef, group: str | None = None, *, start: str = "0") -> bool:
        """Create the consumer group (and the stream) unless it exists; safe to call concurrently.
        ``start``: the entry after which a new group reads, the stream's beginning unless told
        (``"$"``: only what comes from now on). False when Redis refuses the write for now."""
        group = group or stream.group
        if group is None:
            raise ValueError(f"stream {stream.name!r} has no consumer group")
        try:
            await self.redis.xgroup_create(self.key(stream), group, id=start, mkstream=True)
        except ResponseError as exc:
            if refusing(exc):  # full, or read-only for now: reading finds out (NOGROUP, or it refuses too)
                log.warning("Redis refuses to make the group %s of %s for now: %s", group, stream.name, exc)
                return False
            if "BUSYGROUP" not in str(exc):
                raise
        return True

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
                    admitted = await self._admit(
                        stream, group, consumer, entry_id, fields, reclaimed, options
                    )
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
                        stream, group, consumer, options, cursor, want - len(held.items), holding=held.ids
                    )
                    outage.over()
                except (*REDIS_DOWN, ResponseError) as exc:
                    await outage.wait(exc, stop)
                    continue
                for entry_id, fields, reclaimed in fetched:
                    admitted = await self._admit(
                        stream, group, consumer, entry_id, fields, reclaimed, options
                    )
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
        *,
        holding: list[str] | None = None,
    ) -> list[tuple[str, dict, bool]]:
        """Entries a dead consumer left behind (now and then), else new ones (blocking read).
        ``holding``: the entries this consumer holds, renewed as the scan for abandoned ones runs."""
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
                stream, group, consumer, options, cursor.position, count, holding=holding
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
        self,
        stream: StreamDef,
        group: str,
        consumer: str,
        options: ConsumerOptions,
        cursor: str,
        count: int,
        *,
        holding: list[str] | None = None,
    ) -> tuple[str, list[tuple[str, dict]]]:
        # XAUTOCLAIM claims from every consumer, this one too, and counts a delivery for each entry:
        # what a collector holds, idle past the threshold after an outage stopped its heartbeat, was
        # claimed by its own scan until enough counts had it dead-lettered after a restart. Renewed in
        # the same transaction, it is not idle when the scan runs.
        async with self.redis.pipeline(transaction=True) as pipe:
            if holding:
                pipe.eval(self._RENEW, 1, self.key(stream), group, consumer, *holding)
            pipe.xautoclaim(
                self.key(stream), group, consumer, options.claim_idle_ms, start_id=cursor, count=count
            )
            reply = (await pipe.execute())[-1]
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

    def _done_key(self, stream: StreamDef, group: str, message_id: str) -> str:
        return f"{self.prefix}:done:{stream.name}:{group}:{message_id}"

    async def _admit(
        self,
        stream: StreamDef[M],
        group: str,
        consumer: str,
        entry_id: str,
        fields: dict,
        reclaimed: bool,
        options: ConsumerOptions,
    ) -> tuple[M, int] | None:
        """The decoded message and its delivery count, or None when the entry was dealt with here:
        dead-lettered (undecodable, delivered too often, or its claimed payload lost), acknowledged
        as already processed, or passed over as another consumer's."""
        key = self.key(stream)
        deliveries = await self._deliveries(key, group, entry_id) if reclaimed else 1
        # by the entry's message id, before its payload is read (a claim's value can be 200 MB)
        if await self._processed(stream, group, fields):
            await self._ack_duplicate(stream, group, entry_id)
            return None
        payload = await payload_of(self.redis, fields)
        if payload is None:
            await self._claim_gone(stream, group, consumer, entry_id, fields, deliveries)
            return None
        if deliveries > options.max_deliveries:
            last_error = await self.redis.hget(self._errors_key(stream, group), entry_id)
            cause = f"gave up after {deliveries - 1} deliveries; last error: {as_text(last_error) if last_error else 'consumer died'}"
            await self._dead_letter(stream, group, entry_id, payload, cause, deliveries, "max_deliveries")
            return None
        try:
            message = await decoded(stream.model, payload)
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
        return message, deliveries

    async def _processed(self, stream: StreamDef, group: str, fields: dict) -> bool:
        """Whether the group has processed the message an entry's ``mid`` names."""
        mid = fields.get(b"mid")
        return mid is not None and bool(await self.redis.exists(self._done_key(stream, group, as_text(mid))))

    async def _ack_duplicate(self, stream: StreamDef, group: str, entry_id: str) -> None:
        """Acknowledge an entry whose message the group has processed already."""
        metrics.DUPLICATES.labels(stream.name, group).inc()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.key(stream), group, entry_id)
            pipe.hdel(self._errors_key(stream, group), entry_id)  # a failure it had is moot now
            await pipe.execute()

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
        started = time.perf_counter()
        try:
            if not await self._work_held(
                stream, group, consumer, entry_id, handler(message, delivery), options
            ):
                metrics.TAKEN_OVER.labels(stream.name, group).inc()
                log.warning(
                    "%s stopped handling %s entry %s: it is no longer this consumer's (another took it "
                    "over, or Redis lost it)",
                    consumer,
                    stream.name,
                    entry_id,
                )
                return
        except MessageTooLarge as exc:  # what it made cannot be sent, this time or the next
            await self._dead_letter(
                stream, group, entry_id, encode(message), str(exc), deliveries, "too_large"
            )
            return
        except Exception as exc:  # the handler's failure is data: record it and let the entry be retried
            metrics.HANDLER_ERRORS.labels(stream.name, group).inc()
            log.exception("handler failed on %s entry %s (delivery %d)", stream.name, entry_id, deliveries)
            await self.redis.hset(
                self._errors_key(stream, group), entry_id, f"{type(exc).__name__}: {exc}"[:MAX_CAUSE]
            )
            return
        finally:
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
