"""Large payloads by reference: a work stream's entry past ``CLAIM_BYTES`` carries the name of a
string value that holds its payload (a claim check), not the payload itself.

An XREADGROUP reply is parsed whole on the consumer's event loop: hiredis gathers a 200 MB entry
(a group with a MoE policy's routes) into one buffer in one call, and the loop, with the
consumer's heartbeats and health probes, waited 156-287 ms for it on a 2-core VM. A value is
read a few MiB at a time (:mod:`services.bus.slices`) and decoded from its slices a piece at a
time, and the slices are freed a few at a time (:mod:`services.bus.freeing`): the read of a
claimed entry stalled the loop for 5-21 ms (5-6 in three of six runs), where the entry's reply
held it for 496-860 ms on the same box, and took about half as long (benchmarks/README.md,
"claims").

The life of a claim:

- the publisher SETs the payload under a name of its own (the stream's key, ``claim`` and a
  random token: a message published twice gets two claims, each trimmed with its own entry),
  with an expiry, so a publisher that dies before the XADD leaves nothing for good;
- one script checks that the value is still there, makes it persistent, adds the entry (fields
  ``type``, ``mid``, ``claim``, and ``task``: whose task it is, for a dead letter should the
  value be lost) and records the claim in the stream's index, a sorted set of
  "<entry id> <claim>" scored by the entry id's milliseconds;
- the script that trims the stream below what every group has acknowledged unlinks the claims of
  the entries it removes (``DROP_CLAIMS``, in :mod:`services.bus.trimming`'s script);
  ``publish_ahead``, which adds queued entries again under new ids, records their claims under
  the new ids.

A client that sends the script again after a reply it lost adds a second entry naming the same
claim, as it would add a second entry of a message XADDed again. The consumers take the second for
the duplicate it is, by its message id, whether its claim is still there or already gone with the
first.

Only work streams (those read by a consumer group) claim: a broadcast stream is trimmed by
MAXLEN as it grows, which knows nothing of claims, and carries small messages. The scripts unlink
claims they do not declare as keys, which one Redis allows and Redis Cluster would not (the
deployments run one Redis).
"""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from proto.messages import TaskRef
from services.bus.connection import Parts, as_text
from services.bus.slices import READ_SLICE_BYTES, read_value

__all__ = [
    "CLAIM_BYTES",
    "DROP_CLAIMS",
    "INDEX_CLAIMS",
    "WRITE_TTL_S",
    "add_claimed",
    "claimed_task",
    "index_key",
    "payload_of",
]

# past one read slice, an entry's payload would be one reply larger than the slices a value is read in
CLAIM_BYTES = READ_SLICE_BYTES
WRITE_TTL_S = 3600.0  # how long a claim written but never added outlives its publisher


def index_key(stream_key: str) -> str:
    """The sorted set of a stream's claims, scored by their entries' milliseconds."""
    return f"{stream_key}:claims"


# Lua: a claim in the stream's index (KEYS[2]) is "<entry id> <claim>", scored by the id's
# millisecond. The scripts that add or move a claimed entry record it through these; DROP_CLAIMS
# reads the same form.
INDEX_CLAIMS = """
local function record(id, claim)
    redis.call('ZADD', KEYS[2], tonumber(string.match(id, '^%d+')), id .. ' ' .. claim)
end
local function unrecord(id, claim)
    redis.call('ZREM', KEYS[2], id .. ' ' .. claim)
end
"""

_ADD = (
    INDEX_CLAIMS
    + """
if redis.call('EXISTS', KEYS[3]) == 0 then
    return redis.error_reply('NOCLAIM ' .. KEYS[3] .. ' expired before its entry was added')
end
redis.call('PERSIST', KEYS[3])
local id = redis.call('XADD', KEYS[1], '*', 'type', ARGV[1], 'mid', ARGV[2], 'claim', KEYS[3], 'task', ARGV[3])
record(id, KEYS[3])
return id
"""
)


async def add_claimed(
    redis: aioredis.Redis, stream_key: str, kind: str, mid: str, payload: Parts, task: TaskRef | None
) -> str:
    """XADD an entry whose payload is held under a claim; returns the entry id. ``task``: the task
    the message carries or answers, kept on the entry as JSON, so that a dead letter of an entry
    whose claim is gone still names it (the trainer replaces the prompt by it)."""
    claim = f"{stream_key}:claim:{secrets.token_hex(12)}"
    await redis.set(claim, payload, px=round(WRITE_TTL_S * 1000))
    named = task.model_dump_json() if task is not None else ""
    entry_id = await redis.eval(_ADD, 3, stream_key, index_key(stream_key), claim, kind, mid, named)
    return as_text(entry_id)


# Lua, run by the trim (services.bus.trimming) once it has trimmed KEYS[1] below the entry id
# (floor_ms, floor_seq); KEYS[2] is the index (INDEX_CLAIMS): below the floor's millisecond every
# claim goes, and in it those of ids below the floor, compared whole (its members sort as text
# there, "5-10" before "5-9").
DROP_CLAIMS = """
    local function drop(member, claim)
        redis.call('UNLINK', claim)  -- a 200 MB value is freed in Redis's background thread
        redis.call('ZREM', KEYS[2], member)
    end
    -- a member the bus did not write (no "<id> <claim>") is left alone: failing here would fail
    -- every trim after this one, its claims piling up
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%.0f', floor_ms))) do
        local claim = string.match(member, '^%d+-%d+ (.+)$')
        if claim then drop(member, claim) end
    end
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], floor_ms, floor_ms)) do
        local seq, claim = string.match(member, '^%d+-(%d+) (.+)$')
        if claim and tonumber(seq) < floor_seq then drop(member, claim) end
    end
"""


async def payload_of(redis: aioredis.Redis, fields: dict) -> bytes | list[bytes] | None:
    """An entry's payload: its ``data`` field, or its claim's value as slices. None when the claim
    is gone (the entry was trimmed after another consumer acknowledged it, or Redis lost the value)."""
    claim = fields.get(b"claim")
    if claim is None:
        return fields.get(b"data", b"")
    return await read_value(redis, as_text(claim), large=True)  # past CLAIM_BYTES, a slice


def claimed_task(fields: dict) -> TaskRef | None:
    """The task a claimed entry names (None: none, not a claimed entry, or not a task: a letter
    without one beats a consumer that dies of it on every delivery)."""
    named = fields.get(b"task")
    try:
        return TaskRef.model_validate_json(named) if named else None
    except ValueError:
        return None
