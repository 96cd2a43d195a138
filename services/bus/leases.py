"""What a consumer holds, kept and handed on: the heartbeat that renews the entries a consumer
is working on (and only those it still owns), the handler it runs under that heartbeat, and the
hand-back of what a leaving consumer could not finish. Mixed into
:class:`services.bus.groups.ConsumerGroups`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from proto.streams import StreamDef
from services.bus.connection import as_text, missing
from services.bus.delivery import ConsumerOptions, HandlerCancelled
from services.tasks import cancel_and_wait

log = logging.getLogger(__name__)

__all__ = ["Leases"]


class Leases:
    """Mixed into the bus's consumer groups, whose ``redis`` and ``key`` it uses."""

    redis: aioredis.Redis
    key: Callable[[StreamDef], str]

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
        self,
        key: str,
        group: str,
        consumer: str,
        entry_ids: list[str],
        options: ConsumerOptions,
        on_lost: Callable[[], object] | None = None,
    ) -> None:
        """Reset the entries' idle time while they are being worked on, so no one reclaims them.
        ``on_lost``: called, and the heartbeat ends, once one of them is no longer this consumer's
        (another took it over after missed beats, or settled it): work on it can only make a
        duplicate now."""
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
                if on_lost is not None:
                    on_lost()
                    return

    async def _work_held(
        self,
        stream: StreamDef,
        group: str,
        consumer: str,
        entry_id: str,
        work: Awaitable[None],
        options: ConsumerOptions,
    ) -> bool:
        """Run ``work`` (the handler's) while a heartbeat keeps the entry this consumer's; raises what
        it raised. The handler runs as a task of its own, so that a heartbeat that finds the entry
        gone (this consumer missed its beats: a loop blocked, Redis out of its reach) stops it: the
        other consumer works the entry now, and this one's result could only be a duplicate. False
        then, whatever the handler did or raised as it stopped."""
        task = asyncio.ensure_future(work)
        # what it raises is read below, or is moot: this consumer stopped (the entry goes to the
        # next one) or lost the entry; never "Task exception was never retrieved"
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        taken = False

        def lost() -> None:
            nonlocal taken
            taken = True
            task.cancel()

        heartbeat = asyncio.create_task(
            self._heartbeat(self.key(stream), group, consumer, [entry_id], options, on_lost=lost)
        )
        try:
            try:
                await asyncio.wait({task})
            finally:
                if not task.done():  # this consumer was stopped: its handler goes with it
                    task.cancel()
                    await asyncio.wait({task})
        finally:  # a second cancellation above still ends the heartbeat: it would renew the entry
            await cancel_and_wait(heartbeat)
        if taken:
            return False
        if task.cancelled():  # this consumer was not stopped (that raised above): the handler was
            raise HandlerCancelled(f"the handler of {stream.name} entry {entry_id} was cancelled")
        task.result()
        return True
