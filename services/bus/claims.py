"""Large payloads by reference: a work stream's entry past ``CLAIM_BYTES`` carries the name of a
string value that holds its payload (a claim check), not the payload itself.

An XREADGROUP reply is parsed whole on the consumer's event loop: hiredis gathers a 200 MB entry
(a group with a MoE policy's routes) into one buffer in one call, and the loop, with the
consumer's heartbeats and health probes, waited 131-136 ms for it on a 2-core VM. A value is
read a few MiB at a time (:mod:`services.bus.slices`) and decoded from its slices a piece at a
time: the read of a claimed entry stalled the loop for 15-29 ms, and took about half as long
(benchmarks/README.md, "claims").

The life of a claim:

- the publisher SETs the payload under a name of its own (the stream's key, ``claim`` and a
  random token: a message published twice gets two claims, each trimmed with its own entry),
  with an expiry, so a publisher that dies before the XADD leaves nothing for good;
- one script checks that the value is still there, makes it persistent, adds the entry (fields
  ``type``, ``mid``, ``claim``) and records the claim in the stream's index, a sorted set of
  "<entry id> <claim>" scored by the entry id's milliseconds;
- trimming the stream below what every group has acknowledged unlinks the claims of the entries
  below the floor (:func:`drop_claims`); ``publish_ahead``, which adds queued entries again under
  new ids, records their claims under the new ids.

A client that sends the script again after a reply it lost adds a second entry naming the same
claim, as it would add a second entry of a message XADDed again. The consumers take the second for
the duplicate it is, by its message id, whether its claim is still there or already gone with the
first.

Only work streams (those read by a consumer group) claim: a broadcast stream is trimmed by
MAXLEN as it grows, which knows nothing of claims, and carries small messages.
"""

from __future__ import annotations

import contextlib
import secrets

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.bus.connection import REDIS_DOWN, as_text
from services.bus.slices import READ_SLICE_BYTES, read_value

__all__ = ["CLAIM_BYTES", "WRITE_TTL_S", "add_claimed", "drop_claims", "index_key", "payload_of"]

# past one read slice, an entry's payload would be one reply larger than the slices a value is read in
CLAIM_BYTES = READ_SLICE_BYTES
WRITE_TTL_S = 3600.0  # how long a claim written but never added outlives its publisher
DROP_BATCH = 256  # claims unlinked a script call: each call holds Redis for at most that many


def index_key(stream_key: str) -> str:
    """The sorted set of a stream's claims, scored by their entries' milliseconds."""
    return f"{stream_key}:claims"


_ADD = """
if redis.call('EXISTS', KEYS[3]) == 0 then
    return redis.error_reply('NOCLAIM ' .. KEYS[3] .. ' expired before its entry was added')
end
redis.call('PERSIST', KEYS[3])
local id = redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'mid', ARGV[2], 'claim', KEYS[3])
redis.call('ZADD', KEYS[2], tonumber(string.match(id, '^%d+')), id .. ' ' .. KEYS[3])
return id
"""


async def add_claimed(redis: aioredis.Redis, stream_key: str, kind: str, mid: str, payload: bytes) -> str:
    """XADD an entry whose payload is held under a claim; returns the entry id."""
    claim = f"{stream_key}:claim:{secrets.token_hex(12)}"
    await redis.set(claim, payload, px=round(WRITE_TTL_S * 1000))
    try:
        entry_id = await redis.eval(_ADD, 3, stream_key, index_key(stream_key), claim, kind, mid)
    except ResponseError:  # refused (a full Redis), so not added: the value would hold its memory
        with contextlib.suppress(*REDIS_DOWN, ResponseError):  # for an hour, the publisher retrying
            await redis.unlink(claim)
        raise
    return as_text(entry_id)


# A member is "<entry id> <claim>", scored by the id's millisecond: the ids are compared whole, so
# the last entry below a floor in its floor's millisecond goes with its claim.
_DROP = """
local floor_ms, floor_seq = tonumber(ARGV[1]), tonumber(ARGV[2])
local dropped = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', floor_ms, 'LIMIT', 0, tonumber(ARGV[3]))) do
    local ms, seq, claim = string.match(member, '^(%d+)-(%d+) (.+)$')
    if tonumber(ms) < floor_ms or tonumber(seq) < floor_seq then
        redis.call('UNLINK', claim)
        redis.call('ZREM', KEYS[1], member)
        dropped = dropped + 1
    end
end
return dropped
"""


async def drop_claims(redis: aioredis.Redis, stream_key: str, floor: tuple[int, int]) -> int:
    """Unlink the claims of a stream's entries below the entry id ``floor`` (ms, seq): their
    entries trimmed, or about to be; returns how many. UNLINK frees a large value in Redis's
    background thread. A batch that drops fewer than it might is the last: what it kept lies in
    the floor's millisecond, at or past the floor."""
    dropped = 0
    while True:
        gone = int(await redis.eval(_DROP, 1, index_key(stream_key), *floor, DROP_BATCH))
        dropped += gone
        if gone < DROP_BATCH:
            return dropped


async def payload_of(redis: aioredis.Redis, fields: dict) -> bytes | list[bytes] | None:
    """An entry's payload: its ``data`` field, or its claim's value as slices. None when the claim
    is gone (the entry was trimmed after another consumer acknowledged it, or Redis lost the value)."""
    claim = fields.get(b"claim")
    if claim is None:
        return fields.get(b"data", b"")
    return await read_value(redis, as_text(claim))
