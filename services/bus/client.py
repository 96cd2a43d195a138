"""The bus: typed publish/consume over Redis Streams (see the package docstring). Publishing and
reading are here; reading for a consumer group is :class:`services.bus.groups.ConsumerGroups`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis

from proto.base import Message, encode_parts
from proto.messages import DeadLetter
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics
from services.bus.claims import CLAIM_BYTES, INDEX_CLAIMS, add_claimed, index_key, payload_of
from services.bus.connection import REDIS_DOWN, Parts, as_text, made_by_redis_client, redis_client
from services.bus.dead_lettering import kept_entries
from services.bus.decoding import decoded
from services.bus.delivery import MAX_MESSAGE_BYTES, HandlerCancelled, MessageTooLarge
from services.bus.freeing import let_go
from services.bus.groups import ConsumerGroups
from services.bus.lock import Exclusive
from services.bus.slices import read_value

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


def _parts(message: Message, name: str, limit: int) -> Parts:
    """``encode_parts(message)``; :class:`MessageTooLarge` past ``limit`` bytes (``name``: where
    it was going)."""
    payload = Parts(encode_parts(message))
    if payload.size > limit:
        raise MessageTooLarge(name, payload.size, limit)
    return payload


def _check_type(stream: StreamDef, message: Message) -> None:
    if not isinstance(message, stream.model):
        raise TypeError(
            f"stream {stream.name!r} carries {stream.model.__name__}, got {type(message).__name__}"
        )


class Bus(ConsumerGroups):
    """One Redis connection pool, shared by every stream a service touches."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "pbsd",
        maxlen: int = 100_000,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        claim_bytes: int | None = CLAIM_BYTES,
    ) -> None:
        """``client``: one :func:`redis_client` made. ``claim_bytes``: past it, a work stream's
        entry holds its payload by reference (:mod:`services.bus.claims`); None: never."""
        if not made_by_redis_client(client):
            raise ValueError("the bus needs a client made by services.bus.redis_client")
        self.redis = client
        self.prefix = prefix
        self.maxlen = maxlen
        self.max_message_bytes = max_message_bytes
        self.claim_bytes = claim_bytes
        self._last_trim: dict[str, float] = {}
        self._last_forget: dict[tuple[str, str], float] = {}

    @classmethod
    def from_url(cls, url: str, *, patience_s: float = 0.0, **kwargs: Any) -> Bus:
        """``patience_s``: how long each command waits out a Redis outage (:func:`redis_client`)."""
        return cls(redis_client(url, patience_s=patience_s), **kwargs)

    async def close(self) -> None:
        await self.redis.aclose()

    def exclusive(self, name: str, *, ttl_s: float = 60.0) -> Exclusive:
        """A lock named ``name`` shared by every process on this bus (:class:`Exclusive`): renewed
        while held, so ``ttl_s`` is how long a holder that died keeps the others waiting."""
        return Exclusive(self.redis, f"{self.prefix}:lock:{name}", ttl_s=ttl_s)

    # -- publishing -----------------------------------------------------------------
    async def publish(self, stream: StreamDef[M], message: M) -> str:
        """XADD the message; returns the entry id. A broadcast stream (weights, run ends, dead
        letters) is trimmed to about ``maxlen`` entries as it grows (the dead letters to fewer:
        :func:`kept_entries`). A work stream is not: MAXLEN removes entries whether or not a
        consumer group has read them, so a backlog past it would lose work without a trace; its
        consumers trim what every group has acknowledged (:meth:`trim_acked`), and a Redis that runs
        out of memory refuses the XADD, loudly. A work stream's message past ``claim_bytes`` is
        stored beside the stream and its entry names it (:mod:`services.bus.claims`), written from
        its parts, which are let go of a few MiB at a time (:mod:`services.bus.freeing`)."""
        _check_type(stream, message)
        # in a thread: a group with routes is hundreds of MiB, whose encoding held the event loop
        # (and every trajectory it drives) for a third of a second
        payload, claimed = await asyncio.to_thread(self._encode, stream, message)
        kind, key = stream.model.__name__, self.key(stream)
        try:
            if claimed:
                entry_id = await add_claimed(
                    self.redis, key, kind, message.message_id, payload, message.task_ref()
                )
                metrics.CLAIMED.labels(stream.name).inc()
            else:
                entry_id = await self.redis.xadd(
                    key,
                    {b"type": kind, b"mid": message.message_id, b"data": payload.parts[0]},
                    maxlen=kept_entries(stream, self.maxlen),
                    approximate=True,
                )
            metrics.PUBLISHED.labels(stream.name).inc()
            metrics.PUBLISHED_BYTES.labels(stream.name).inc(payload.size)
        finally:  # a write that failed or was cancelled lets go of them as slowly
            await let_go(payload.parts)
        return as_text(entry_id)

    def _encode(self, stream: StreamDef, message: Message) -> tuple[Parts, bool]:
        """The message's wire form and whether it goes by claim: as its parts if it does (written
        from them), else whole, one part (an entry's field)."""
        payload = self._parts_for(stream, message)
        if stream.group is not None and self.claim_bytes is not None and payload.size > self.claim_bytes:
            return payload, True
        return Parts([b"".join(payload.parts)]), False

    def _parts_for(self, stream: StreamDef, message: Message) -> Parts:
        try:
            return _parts(message, stream.name, self.max_message_bytes)
        except MessageTooLarge:
            metrics.TOO_LARGE.labels(stream.name).inc()
            raise

    # Entries the group has not been delivered yet are after its last-delivered-id: they are taken
    # off, the new messages added, and they are added back behind them, unchanged and in their order.
    # One script, so no consumer reads the stream halfway through.
    _AHEAD = (
        INDEX_CLAIMS
        + """
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
    -- a claim is recorded under its entry's new id: trimming goes by the ids (services.bus.claims)
    for _, entry in ipairs(queued) do
        local id = redis.call('XADD', KEYS[1], '*', unpack(entry[2]))
        for i = 1, #entry[2], 2 do
            if entry[2][i] == 'claim' then
                unrecord(entry[1], entry[2][i + 1])
                record(id, entry[2][i + 1])
            end
        end
    end
    -- Redis counts a group's lag as entries added minus entries read; the moved entries, deleted and
    -- added again, would count twice for good (pbsd_stream_outstanding, which the rollout autoscaler
    -- follows). The group has read every entry but the ones queued now. Redis 7's ENTRIESREAD: an
    -- older Redis reports no lag at all, so its refusal is passed over.
    local stream = redis.call('XINFO', 'STREAM', KEYS[1])
    for i = 1, #stream, 2 do
        if stream[i] == 'entries-added' then
            local unread = (#ARGV - 2) / 2 + #queued
            pcall(redis.call, 'XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', stream[i + 1] - unread)
        end
    end
    return #queued
    """
    )

    async def publish_ahead(self, stream: StreamDef[M], messages: list[M]) -> int:
        """Publish ``messages`` ahead of every entry the stream's group has not been delivered yet: the
        group reads them next. The entries queued behind them keep their payloads and their order but
        get new entry ids. Returns how many entries were queued behind them. The messages go whole,
        never claimed (prompts handed back: small)."""
        if not messages:
            return 0
        for message in messages:
            _check_type(stream, message)
        await self.ensure_group(stream)
        payloads = [b"".join(self._parts_for(stream, m).parts) for m in messages]
        args = [x for m, p in zip(messages, payloads, strict=True) for x in (m.message_id, p)]
        key = self.key(stream)
        moved = await self.redis.eval(
            self._AHEAD, 2, key, index_key(key), stream.group, stream.model.__name__, *args
        )
        metrics.PUBLISHED.labels(stream.name).inc(len(messages))
        metrics.PUBLISHED_BYTES.labels(stream.name).inc(sum(len(p) for p in payloads))
        return int(moved)

    # -- broadcast streams (weights) ------------------------------------------------
    async def latest(self, stream: StreamDef[M], *, scan: int = 64) -> tuple[str, M] | None:
        """The newest decodable entry among the last ``scan``, or None. An undecodable one on top is
        passed over: workers read this as they start, and one bad entry must not stop every start."""
        found = await self.newest(stream, scan)
        return found[-1] if found else None

    async def head(self, stream: StreamDef) -> str:
        """The id of a stream's newest entry, decodable or not ("0-0" when it is empty): where a
        reader that wants only what comes next starts following."""
        newest = await self.redis.xrevrange(self.key(stream), count=1)
        return as_text(newest[0][0]) if newest else "0-0"

    async def newest(self, stream: StreamDef[M], count: int) -> list[tuple[str, M]]:
        """The newest ``count`` entries of a stream, oldest first (undecodable ones logged and left out)."""
        out = []
        for entry_id, fields in reversed(await self.redis.xrevrange(self.key(stream), count=count)):
            try:
                out.append((as_text(entry_id), await self._message(stream, fields)))
            except (ValueError, KeyError) as exc:
                log.error("skipping undecodable %s entry %s: %s", stream.name, as_text(entry_id), exc)
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
        last = await self.head(stream) if after == "$" else after  # resolved now, so entries
        # published while we process are not skipped
        while stop is None or not stop.is_set():
            reply = await self.redis.xread({self.key(stream): last}, count=16, block=block_ms)
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last = as_text(entry_id)
                    try:
                        message = await self._message(stream, fields)
                    except (ValueError, KeyError) as exc:
                        log.error("skipping undecodable %s entry %s: %s", stream.name, last, exc)
                        continue
                    yield last, message

    async def follow_for_good(
        self,
        stream: StreamDef[M],
        after: str,
        see: Callable[[str, M], Awaitable[None]],
        stop: asyncio.Event,
        *,
        reader: str,
        block_ms: int = 1000,
        attempts: int = 3,
    ) -> None:
        """``see(entry_id, message)`` for every entry after ``after``, until ``stop``. A lost
        connection is followed again a second later from the last entry seen through: a follower
        that died would leave its reader behind for good (a worker at its old weights, a run that
        never replaces its dead-lettered prompts). An entry whose ``see`` fails is tried again, and
        after ``attempts`` failures logged and passed over: it must not hold back every entry after it."""
        failures = 0
        while not stop.is_set():
            try:
                async for entry_id, message in self.follow(stream, after=after, block_ms=block_ms, stop=stop):
                    try:
                        await _seen(see, stream, entry_id, message)
                    except Exception:
                        failures += 1
                        if failures < attempts:
                            raise
                        log.exception(
                            "%s: %s entry %s failed %d times; passed over",
                            reader,
                            stream.name,
                            entry_id,
                            failures,
                        )
                    failures, after = 0, entry_id
                return
            except REDIS_DOWN as exc:
                log.warning("%s lost the %s stream (%s); following again in 1 s", reader, stream.name, exc)
            except Exception:
                log.exception(
                    "%s: an %s entry after %s failed; trying it again in 1 s", reader, stream.name, after
                )
            await asyncio.sleep(1.0)

    # -- kept messages: one value under a name, for a while ----------------------------
    async def keep(self, name: str, message: Message, *, ttl_s: float) -> None:
        """Store ``message`` under ``name`` for ``ttl_s`` seconds, in place of what was there; held
        to the bus's message limit, as a publish is (:class:`MessageTooLarge`). Encoded in a
        thread: a value can be hundreds of MiB, which would hold the event loop for seconds; written
        from its parts and let go of a few MiB at a time (:mod:`services.bus.freeing`)."""
        payload = await asyncio.to_thread(_parts, message, name, self.max_message_bytes)
        try:
            await self.redis.set(f"{self.prefix}:{name}", payload, px=max(1, round(ttl_s * 1000)))
        finally:
            await let_go(payload.parts)

    async def kept(self, name: str, model: type[M]) -> M | None:
        """What :meth:`keep` stored under ``name``, left there: a reader cut off as the reply came
        back, or one that dies before it has kept its own, loses nothing for the next one. None
        when nothing is there (never kept, forgotten, or expired) or what is there does not decode
        as ``model`` (logged). Read a few MiB at a time, as one value (:mod:`services.bus.slices`)."""
        payload = await read_value(self.redis, f"{self.prefix}:{name}")
        if payload is None:
            return None
        try:
            return await decoded(model, payload)
        except ValueError as exc:
            log.error("ignoring %s: it does not decode as %s (%s)", name, model.__name__, exc)
            return None

    async def prolong(self, name: str, *, ttl_s: float) -> None:
        """Keep what :meth:`keep` stored under ``name`` for ``ttl_s`` seconds from now (nothing
        there: nothing to do)."""
        await self.redis.pexpire(f"{self.prefix}:{name}", max(1, round(ttl_s * 1000)))

    async def forget(self, name: str) -> None:
        """Remove what :meth:`keep` stored under ``name`` (nothing there: nothing to do). Never
        raises: what is kept expires, so a removal Redis refuses is logged and left to that."""
        try:
            await self.redis.delete(f"{self.prefix}:{name}")
        except Exception as exc:
            log.warning("could not remove %s (it expires): %r", name, exc)

    async def read_all(self, stream: StreamDef[M], *, count: int = 1000) -> list[tuple[str, M]]:
        """The first ``count`` entries still on a stream (for inspection and tests)."""
        entries = await self.redis.xrange(self.key(stream), count=count)
        return [(as_text(i), await self._message(stream, f)) for i, f in entries]

    async def _message(self, stream: StreamDef[M], fields: dict) -> M:
        """An entry's message, its claim read where it has one; raises ValueError as decoding does,
        and where the claim is gone."""
        payload = await payload_of(self.redis, fields)
        if payload is None:
            raise ValueError("the value its entry claims is gone")
        return await decoded(stream.model, payload)

    async def stream_length(self, stream: StreamDef) -> int:
        return int(await self.redis.xlen(self.key(stream)))

    async def dead_letters(self, count: int = 1000) -> list[DeadLetter]:
        return [m for _i, m in await self.read_all(DEAD_LETTERS, count=count)]


async def _seen(
    see: Callable[[str, M], Awaitable[None]], stream: StreamDef, entry_id: str, message: M
) -> None:
    """``see(entry_id, message)``; a CancelledError from inside it while this follower is not being
    stopped (it awaited a job another task withdrew) is that entry's failure, tried again as any:
    passed on bare, it ended the follower for good, and its reader with it."""
    try:
        await see(entry_id, message)
    except asyncio.CancelledError as exc:
        if asyncio.current_task().cancelling():  # this follower is being stopped
            raise
        raise HandlerCancelled(f"seeing {stream.name} entry {entry_id} was cancelled") from exc
