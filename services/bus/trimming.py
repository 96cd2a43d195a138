"""Trimming what has passed: a work stream's entries below what every consumer group has
acknowledged, so Redis memory follows what is in flight (MAXLEN would remove entries a group has
not read yet), the consumers of a group that are long gone, and whole groups whose reader is done
(:func:`services.trainer.run_groups.forget_run`).

Redis keeps a consumer in its group until it is deleted, and the workers' names are their host
names, which change with every pod Kubernetes starts: without this a group would list every
worker that ever ran.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto.streams import StreamDef
from services.bus import metrics
from services.bus.claims import DROP_CLAIMS, index_key
from services.bus.connection import as_text, missing
from services.bus.delivery import ConsumerOptions

__all__ = ["FORGET_INTERVAL_S", "Trimming"]

log = logging.getLogger(__name__)

FORGET_INTERVAL_S = 60.0  # how often a consumer looks for gone consumers of its group


class Trimming:
    """Mixed into the bus's consumer groups, whose ``redis`` and ``prefix`` it uses."""

    redis: aioredis.Redis
    prefix: str
    _last_trim: dict[str, float]
    _last_forget: dict[tuple[str, str], float]

    def key(self, stream: StreamDef) -> str:
        return stream.key(self.prefix)

    async def destroy_group(self, stream: StreamDef, group: str) -> bool:
        """Remove ``group`` and what it holds pending from ``stream``, with its handler-error counts
        and its series in this process's metrics; False if there was none."""
        metrics.forget_series(stream.name, group)
        self._last_forget.pop((stream.name, group), None)
        await self.redis.delete(self._errors_key(stream, group))
        try:
            return bool(await self.redis.xgroup_destroy(self.key(stream), group))
        except ResponseError as exc:
            if missing(exc):
                return False
            raise

    async def group_names(self, stream: StreamDef) -> list[str]:
        """The names of the stream's consumer groups (none if the stream does not exist)."""
        try:
            return [as_text(g["name"]) for g in await self.redis.xinfo_groups(self.key(stream))]
        except ResponseError as exc:
            if missing(exc):  # no such stream
                return []
            raise

    async def _maybe_trim(self, stream: StreamDef, group: str, options: ConsumerOptions) -> None:
        now = time.monotonic()
        if now - self._last_trim.get(stream.name, 0.0) >= options.trim_interval_s:
            self._last_trim[stream.name] = now
            await self.trim_acked(stream)
        if now - self._last_forget.get((stream.name, group), 0.0) >= FORGET_INTERVAL_S:
            self._last_forget[(stream.name, group)] = now
            if gone := await self.forget_idle_consumers(stream, group, options.forget_idle_s):
                log.info(
                    "forgot %d consumers of %s/%s idle for %.0f s: %s",
                    len(gone),
                    stream.name,
                    group,
                    options.forget_idle_s,
                    ", ".join(gone[:10]),
                )

    # One script, so a consumer cannot take an entry between the check and the deletion: XGROUP
    # DELCONSUMER drops what a consumer holds from the pending list, which would lose it. A live
    # consumer that is deleted (one that read nothing for that long) is made again by its next read.
    _FORGET = """
    local gone = {}
    for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
        local f = {}
        for i = 1, #info, 2 do f[info[i]] = info[i + 1] end
        if f['pending'] == 0 and f['idle'] >= tonumber(ARGV[2]) then
            redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
            gone[#gone + 1] = f['name']
        end
    end
    return gone
    """

    async def forget_idle_consumers(self, stream: StreamDef, group: str, idle_s: float) -> list[str]:
        """Delete the consumers of ``group`` that hold nothing and have not read for ``idle_s``."""
        try:
            gone = await self.redis.eval(self._FORGET, 1, self.key(stream), group, round(idle_s * 1000))
        except ResponseError as exc:
            if missing(exc):
                return []
            raise
        return [as_text(name) for name in gone]

    # One script: the floor (the oldest entry any group still needs: its first pending entry, else
    # the one after its last delivered), the trim below it and the unlinking of the trimmed entries'
    # claims. Read and trimmed apart, a group made at "0" between them (a run starting, a group
    # Redis lost made again) read entries the trim then removed, or whose claims it unlinked while
    # the new group held them. "0-1" as the floor: a group that has read nothing, nothing to trim.
    _TRIM = (
        """
    local floor_ms, floor_seq
    for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
        local f = {}
        for i = 1, #info, 2 do f[info[i]] = info[i + 1] end
        local id, after = f['last-delivered-id'], 1
        if f['pending'] > 0 then id, after = redis.call('XPENDING', KEYS[1], f['name'])[2], 0 end
        local ms, seq = string.match(id, '^(%d+)-(%d+)$')
        ms, seq = tonumber(ms), tonumber(seq) + after  -- doubles: exact for any id XADD * makes
        if floor_ms == nil or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
            floor_ms, floor_seq = ms, seq
        end
    end
    if floor_ms == nil or (floor_ms == 0 and floor_seq <= 1) then return 0 end
    local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', string.format('%.0f-%.0f', floor_ms, floor_seq))
    """
        + DROP_CLAIMS
        + """
    return trimmed
    """
    )

    async def trim_acked(self, stream: StreamDef) -> int:
        """Delete entries every consumer group has delivered and acknowledged, and the values their
        claims name (:mod:`services.bus.claims`); returns how many entries."""
        key = self.key(stream)
        try:
            return int(await self.redis.eval(self._TRIM, 2, key, index_key(key)))
        except ResponseError as exc:
            if missing(exc):  # no such stream yet
                return 0
            raise
