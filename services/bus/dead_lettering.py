"""Dead letters: an entry a consumer gives up on (undecodable, delivered too often, or making a
message past the bus's limit) moves to the dead-letter stream with its cause, acknowledged in the
same transaction. The trainer follows the stream for the prompts whose groups will never come
(services.trainer.dead_letters).

A letter's payload past DEAD_LETTER_PAYLOAD_BYTES is kept without its bulk
(``Message.without_bulk``: a group's routed experts). The stream is trimmed by count only, a
scored group with routing replay's routes is hundreds of MB, and a hundred such letters filled
Redis; every run's followers also read every letter as the run opens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from proto.base import decode, encode
from proto.messages import DeadLetter
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics

__all__ = ["DEAD_LETTER_PAYLOAD_BYTES", "MAX_CAUSE", "DeadLettering"]

log = logging.getLogger(__name__)

MAX_CAUSE = 4000  # characters of a cause kept (a handler's error, a validation report)
DEAD_LETTER_PAYLOAD_BYTES = 8 * 1024 * 1024


class DeadLettering:
    """Mixed into the bus's consumer groups, whose ``redis``, ``prefix``, ``maxlen`` and ``key``
    (:class:`services.bus.trimming.Trimming`'s) it uses."""

    redis: aioredis.Redis
    prefix: str
    maxlen: int
    key: Callable[[StreamDef], str]

    def _errors_key(self, stream: StreamDef, group: str) -> str:
        return f"{self.prefix}:errors:{stream.name}:{group}"

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
        whole = bytes(payload)
        kept = await asyncio.to_thread(_slimmed, stream, whole)
        letter = DeadLetter(
            stream=stream.name,
            group=group,
            entry_id=entry_id,
            cause=cause[:MAX_CAUSE],
            deliveries=deliveries,
            payload=kept,
            payload_bytes=len(whole) if kept is not whole else None,
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


def _slimmed(stream: StreamDef, payload: bytes) -> bytes:
    """``payload``, or past DEAD_LETTER_PAYLOAD_BYTES the message without its bulk (an undecodable
    one, or one with no bulk to drop, stays whole)."""
    if len(payload) <= DEAD_LETTER_PAYLOAD_BYTES:
        return payload
    try:
        message = decode(stream.model, payload)
    except ValueError:
        return payload
    slim = message.without_bulk()
    return payload if slim is message else encode(slim)
