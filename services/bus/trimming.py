"""Trimming a work stream below what every consumer group has acknowledged, so Redis memory follows
what is in flight, not what has passed (MAXLEN would remove entries a group has not read yet)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto.streams import StreamDef
from services.bus.connection import as_text
from services.bus.delivery import ConsumerOptions

__all__ = ["Trimming"]


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

    def key(self, stream: StreamDef) -> str:
        return stream.key(self.prefix)

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
        return int(await self.redis.xtrim(key, minid=floor, approximate=approximate))
