"""Stream lag exporter: how much work waits at each stage of the pipeline.

What an operator looks at first. For every stream of ``proto.streams.ALL_STREAMS``:

    pbsd_stream_length{stream}                  entries on the stream (XLEN)
    pbsd_stream_pending{stream,group}           delivered to a consumer, not yet acknowledged
    pbsd_stream_lag{stream,group}               not yet delivered to the group (XINFO GROUPS "lag")
    pbsd_stream_consumers{stream,group}         consumers registered in the group
    pbsd_stream_oldest_pending_seconds{stream,group}  age of the oldest unacknowledged entry

A growing ``lag`` on ``prompts`` means rollout is the bottleneck, on ``trajectories``
the scorer, on ``scored`` the trainer. ``pending`` that stays up while consumers are
gone is work waiting for XAUTOCLAIM. Redis reports ``lag`` as nil when it cannot
compute it (entries deleted inside the group's unread range); the gauge is then NaN.

The trainer runs one :class:`StreamLagMonitor` (it is the single replica, so each
series is exported once); it polls, because a Prometheus collector must not block on
an async client inside the scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import redis.asyncio as aioredis
from prometheus_client import Gauge
from redis.exceptions import RedisError, ResponseError

from proto.streams import ALL_STREAMS, StreamDef
from services.bus.connection import as_text, entry_order, missing
from services.tasks import within

__all__ = ["StreamLagMonitor"]

log = logging.getLogger(__name__)

LENGTH = Gauge("pbsd_stream_length", "Entries on the stream (XLEN)", ["stream"])
PENDING = Gauge(
    "pbsd_stream_pending", "Entries delivered to a consumer and not yet acknowledged", ["stream", "group"]
)
LAG = Gauge("pbsd_stream_lag", "Entries not yet delivered to the consumer group", ["stream", "group"])
CONSUMERS = Gauge("pbsd_stream_consumers", "Consumers registered in the group", ["stream", "group"])
# what an autoscaler of the group's workers scales on: the lag alone drops to 0 as soon as workers
# take the entries, and a scale-down then kills the workers in the middle of them
OUTSTANDING = Gauge(
    "pbsd_stream_outstanding",
    "Entries the group has not finished: not yet delivered (lag) plus delivered and unacknowledged (pending)",
    ["stream", "group"],
)
OLDEST_PENDING = Gauge(
    "pbsd_stream_oldest_pending_seconds",
    "Age of the oldest unacknowledged entry (0 when none)",
    ["stream", "group"],
)


class StreamLagMonitor:
    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        *,
        streams: tuple[StreamDef, ...] = ALL_STREAMS,
        interval_s: float = 5.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.streams = streams
        self.interval_s = interval_s
        self._groups: set[tuple[str, str]] = set()  # the (stream, group) series exported

    async def sample(self) -> None:
        """Read every stream's length and every group's pending count, lag and consumers once."""
        now_ms = time.time() * 1000
        seen: set[tuple[str, str]] = set()
        for stream in self.streams:
            key = stream.key(self.prefix)
            LENGTH.labels(stream.name).set(await self.redis.xlen(key))
            try:
                groups = await self.redis.xinfo_groups(key)
            except ResponseError as exc:
                if not missing(exc):  # the stream does not exist yet, or the key holds something else
                    log.warning("cannot read the groups of %s: %s", key, exc)
                continue
            for info in groups:
                group = as_text(info["name"])
                seen.add((stream.name, group))
                pending = int(info["pending"])
                lag = info.get("lag")
                PENDING.labels(stream.name, group).set(pending)
                lag = math.nan if lag is None else int(lag)  # NaN: Redis cannot count it
                LAG.labels(stream.name, group).set(lag)
                OUTSTANDING.labels(stream.name, group).set(lag + pending)
                CONSUMERS.labels(stream.name, group).set(int(info["consumers"]))
                age = 0.0
                if pending:
                    summary = await self.redis.xpending(key, group)
                    oldest_ms = entry_order(as_text(summary["min"]))[0]
                    age = max(0.0, (now_ms - oldest_ms) / 1000)
                OLDEST_PENDING.labels(stream.name, group).set(age)
        # a group destroyed (each run's trainer groups, once the run ends) leaves no series behind:
        # its last pending count and age would be exported for good, and alerts would fire on them
        for gone in self._groups - seen:
            for gauge in (PENDING, LAG, OUTSTANDING, CONSUMERS, OLDEST_PENDING):
                with contextlib.suppress(KeyError):
                    gauge.remove(*gone)
        self._groups = seen

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every ``interval_s`` until ``stop`` is set; Redis outages are logged, not fatal."""
        while not stop.is_set():
            try:
                await self.sample()
            except (RedisError, OSError) as exc:
                log.warning("stream lag sample failed: %s", exc)
            await within(self.interval_s, stop.wait())
