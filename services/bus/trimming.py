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
from services.bus.claims import drop_claims
from services.bus.connection import as_text, missing
from services.bus.delivery import ConsumerOptions

__all__ = ["FORGET_INTERVAL_S", "Trimming"]

log = logging.getLogger(__name__)

FORGET_INTERVAL_S = 60.0  # how often a consumer looks for gone consumers of its group


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(entry_id: str) -> str:
    ms, seq = _id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


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

    async def trim_acked(self, stream: StreamDef, *, approximate: bool = False) -> int:
        """Delete entries every consumer group has delivered and acknowledged, and the values their
        claims name (:mod:`services.bus.claims`); returns how many entries."""
        key = self.key(stream)
        try:
            groups = await self.redis.xinfo_groups(key)
        except ResponseError as exc:
            if missing(exc):  # no such stream yet
                return 0
            raise
        if not groups:
            return 0
        floor: str | None = None
        for info in groups:
            name = as_text(info["name"])
            summary = await self.redis.xpending(key, name)
            candidate = (
                as_text(summary["min"])
                if summary["pending"]
                else _next_id(as_text(info["last-delivered-id"]))
            )
            if floor is None or _id_tuple(candidate) < _id_tuple(floor):
                floor = candidate
        if floor is None or floor == "0-1":
            return 0
        trimmed = int(await self.redis.xtrim(key, minid=floor, approximate=approximate))
        await drop_claims(self.redis, key, _id_tuple(floor))
        return trimmed
