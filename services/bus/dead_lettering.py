"""Dead letters: an entry a consumer gives up on (undecodable, delivered too often, making a
message past the bus's limit, or whose claimed payload is gone) moves to the dead-letter stream
with its cause, acknowledged in the same transaction. The trainer follows the stream for the prompts whose groups will never come
(services.trainer.dead_letters), by the letter's ``task`` (whose run and task it was).

The stream is bounded in memory, not only in count: a scored group with routing replay's routes is
hundreds of MB, a long group's tokens several MB, and a failure that hits every group (a scorer
that cannot take them) makes a letter of each. So a letter keeps its payload whole up to
DEAD_LETTER_PAYLOAD_BYTES; past it, the message without its bulk (``Message.without_bulk``: a
group's routed experts) where that fits, else the payload's head; and the stream keeps about
DEAD_LETTERS_KEPT letters: at most about 10 GiB in all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from proto.base import decode, encode
from proto.messages import DeadLetter, TaskRef
from proto.streams import DEAD_LETTERS, StreamDef
from services.bus import metrics
from services.bus.claims import claimed_task
from services.bus.connection import as_text
from services.bus.decoding import DECODE_INLINE_BYTES

__all__ = [
    "DEAD_LETTERS_KEPT",
    "DEAD_LETTER_PAYLOAD_BYTES",
    "DECODE_INLINE_BYTES",
    "MAX_CAUSE",
    "DeadLettering",
    "kept_entries",
]

log = logging.getLogger(__name__)

MAX_CAUSE = 4000  # characters of a cause kept (a handler's error, a validation report)
DEAD_LETTER_PAYLOAD_BYTES = 1024 * 1024
DEAD_LETTERS_KEPT = 10_000  # letters, each under a MiB and its cause


def kept_entries(stream: StreamDef, maxlen: int) -> int | None:
    """About how many entries XADD keeps on ``stream``: a work stream is trimmed by its consumers
    instead (None), a broadcast one to ``maxlen``, the dead letters to at most DEAD_LETTERS_KEPT."""
    if stream.group is not None:
        return None
    return min(maxlen, DEAD_LETTERS_KEPT) if stream.name == DEAD_LETTERS.name else maxlen


class DeadLettering:
    """Mixed into the bus's consumer groups, whose ``redis``, ``prefix``, ``maxlen`` and ``key``
    (:class:`services.bus.trimming.Trimming`'s) it uses."""

    redis: aioredis.Redis
    prefix: str
    maxlen: int
    key: Callable[[StreamDef], str]
    _processed: Callable[[StreamDef, str, dict], Awaitable[bool]]
    _ack_duplicate: Callable[[StreamDef, str, str], Awaitable[None]]

    def _errors_key(self, stream: StreamDef, group: str) -> str:
        return f"{self.prefix}:errors:{stream.name}:{group}"

    async def _dead_letter(
        self,
        stream: StreamDef,
        group: str,
        entry_id: str,
        payload: bytes | list[bytes],
        cause: str,
        deliveries: int,
        reason: str,
        *,
        task: TaskRef | None = None,
    ) -> None:
        """``payload``: the entry's, whole or as the slices of its claim. ``task``: whose it is,
        where the payload does not say (a claimed entry whose value is gone)."""
        size = sum(map(len, payload)) if isinstance(payload, list) else len(payload)
        if size > DECODE_INLINE_BYTES:
            named, kept, how = await asyncio.to_thread(_kept, stream, payload)
        else:
            named, kept, how = _kept(stream, payload)
        task = named or task
        letter = DeadLetter(
            stream=stream.name,
            group=group,
            entry_id=entry_id,
            cause=cause[:MAX_CAUSE],
            deliveries=deliveries,
            task=task,
            payload=kept,
            payload_kept=how,
            payload_bytes=size if how != "whole" else None,
        )
        log.error("dead-lettering %s entry %s: %s", stream.name, entry_id, cause[:500])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.key(DEAD_LETTERS),
                {b"type": b"DeadLetter", b"mid": letter.message_id, b"data": encode(letter)},
                maxlen=kept_entries(DEAD_LETTERS, self.maxlen),
                approximate=True,
            )
            pipe.xack(self.key(stream), group, entry_id)
            pipe.hdel(self._errors_key(stream, group), entry_id)
            await pipe.execute()
        metrics.DEAD_LETTERED.labels(stream.name, group, reason).inc()

    async def _claim_gone(
        self, stream: StreamDef, group: str, consumer: str, entry_id: str, fields: dict, deliveries: int
    ) -> None:
        """An entry whose claimed value is gone (:mod:`services.bus.claims`). A message the group has
        processed meanwhile (another consumer took the entry over while this one read it, or the
        entry was added twice and its claim trimmed with the first) is acknowledged as the
        duplicate it is. One this consumer no longer holds is passed over. One it holds has lost
        its payload: a dead letter that names its task from the entry, so its prompt is replaced."""
        if await self._processed(stream, group, fields):
            await self._ack_duplicate(stream, group, entry_id)
            return
        rows = await self.redis.xpending_range(self.key(stream), group, min=entry_id, max=entry_id, count=1)
        if rows and as_text(rows[0]["consumer"]) == consumer:
            cause = "the value its entry claims is gone before it was processed; the payload is lost"
            task = claimed_task(fields)
            await self._dead_letter(stream, group, entry_id, b"", cause, deliveries, "lost", task=task)
            return
        log.info("%s passed over %s entry %s: another consumer holds it", consumer, stream.name, entry_id)


def _kept(stream: StreamDef, slices: bytes | list[bytes]) -> tuple[TaskRef | None, bytes, str]:
    """The task the payload's message names (None: it names none, or does not decode), what of the
    payload a letter keeps, and how (``DeadLetter.payload_kept``)."""
    payload = b"".join(slices) if isinstance(slices, list) else bytes(slices)
    try:
        message = decode(stream.model, payload)
    except ValueError:
        message = None
    task = message.task_ref() if message is not None else None
    if len(payload) <= DEAD_LETTER_PAYLOAD_BYTES:
        return task, payload, "whole"
    if message is not None and (slim := message.without_bulk()) is not message:
        slimmed = encode(slim)
        if len(slimmed) <= DEAD_LETTER_PAYLOAD_BYTES:
            return task, slimmed, "without_bulk"
    return task, payload[:DEAD_LETTER_PAYLOAD_BYTES], "head"
