"""What a consumer of a group works with: its options, a delivery's facts, the messages it holds,
and how its loop rides out a Redis outage (the consumer-group machinery is ``services.bus.groups``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from redis.exceptions import ResponseError

from proto.base import Message
from proto.streams import StreamDef
from services.bus import metrics
from services.bus.connection import REDIS_DOWN, refusing
from services.tasks import within

if TYPE_CHECKING:
    from services.bus.client import Bus

log = logging.getLogger(__name__)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MISSED_BEATS",
    "ConsumerOptions",
    "Delivery",
    "Handler",
    "Held",
    "MessageTooLarge",
]

M = TypeVar("M", bound=Message)

# Heartbeats a consumer may miss in a row before what it holds counts as abandoned: enough that a
# loaded event loop or a short network blip never hands live work to another consumer, few
# enough that a dead consumer's work moves on within a minute at the default heartbeat.
MISSED_BEATS = 10

# Redis refuses a bulk string longer than its proto-max-bulk-len (512 MB unless raised) with a
# protocol error and closes the connection, usually mid-write: redis-py then sees a broken pipe,
# which looks like an outage, and resends the whole payload for as long as it waits outages out.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024


class HandlerCancelled(RuntimeError):
    """A handler that ended cancelled while its consumer ran on and still held the entry: it awaited
    something another task cancelled (a pool's job withdrawn as it shut down, a future dropped).
    A failure of that delivery, retried as any other, not the end of the consumer: a bare
    CancelledError would have passed for the consumer's own stop and ended its loop."""


class MessageTooLarge(ValueError):
    """A message whose encoding is past the bus's limit: refused before anything is sent. Sending it
    again would be refused again, so a consumer whose handler raises it dead-letters what it was
    handling at once instead of retrying it (``reason="too_large"``)."""

    def __init__(self, stream: str, size: int, limit: int) -> None:
        super().__init__(
            f"a {stream} message of {size / 2**20:,.1f} MiB is past the bus's limit of "
            f"{limit / 2**20:,.1f} MiB (PBSD_BUS_MAX_MESSAGE_BYTES, at most Redis's proto-max-bulk-len); "
            "shorter trajectories (rollout.max_context), a smaller rollout.group_size or no routes "
            "(rollout.return_routed_experts) make it smaller"
        )
        self.size, self.limit = size, limit


@dataclass(frozen=True)
class ConsumerOptions:
    block_ms: int = 1000  # XREADGROUP block; also how often ``stop`` is checked
    count: int = 1  # entries fetched a read; handled one after another
    heartbeat_ms: int = 5_000  # how often a live consumer renews the idle time of what it holds
    max_deliveries: int = 5  # beyond this the entry is dead-lettered
    done_ttl_s: int = 7 * 24 * 3600  # how long processed message ids are remembered
    trim_interval_s: float = 1.0  # at most one acknowledged-history trim per interval
    forget_idle_s: float = 3600.0  # a consumer holding nothing that has not read for this long is deleted

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
class Cursor:
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
    def ids(self) -> list[str]:
        return list(self._ids)

    @property
    def messages(self) -> list[M]:
        return [m for _, m in self.items]

    def stop_heartbeat(self) -> None:
        self._beat.cancel()


class Outage:
    """Riding out a Redis outage in a consumer's loop instead of dying of it: wait with backoff
    (0.5 s doubling to 10 s) and try again; an entry being handled when it struck stays pending
    and comes back (at-least-once). So is a Redis that refuses writes for now (out of memory, a
    read-only replica after a failover, a failed snapshot: ``connection.refusing``). A Redis
    restarted without persistence has lost the consumer group (NOGROUP): it is created again. Any
    other error is raised."""

    def __init__(self, bus: Bus, stream: StreamDef, group: str) -> None:
        self.bus, self.stream, self.group = bus, stream, group
        self.delay = 0.5

    def over(self) -> None:
        self.delay = 0.5

    async def wait(self, exc: Exception, stop: asyncio.Event | None) -> None:
        if refusing(exc):
            log.warning(
                "Redis refuses %s's commands for now (%s: %s); trying again in %.1f s",
                self.stream.name,
                type(exc).__name__,
                exc,
                self.delay,
            )
        elif isinstance(exc, ResponseError):
            if "NOGROUP" not in str(exc):
                raise exc
            log.warning(
                "the group %s of %s is gone (Redis restarted empty?): creating it again",
                self.group,
                self.stream.name,
            )
            with contextlib.suppress(*REDIS_DOWN):
                if await self.bus.ensure_group(self.stream, self.group):
                    return  # made again: read at once
            # refused (a Redis full or read-only for now) or out of reach: waited out as an outage,
            # where returning at once had the loop read, meet NOGROUP and ask again, without a pause
        else:
            log.warning(
                "Redis is unreachable for %s (%s); trying again in %.1f s", self.stream.name, exc, self.delay
            )
        metrics.OUTAGES.labels(self.stream.name).inc()
        await within(self.delay, (stop or asyncio.Event()).wait())
        self.delay = min(self.delay * 2, 10.0)
