"""Connecting to Redis: a client that rides out short outages, and what an outage raises."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["REDIS_DOWN", "as_text", "entry_order", "missing", "redis_client", "refusing"]

# what Redis being out of reach raises (a refused or broken connection, a timeout)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)

# the words of a reachable Redis that refuses writes for now, where redis-py has no class for them:
# a failed snapshot (MISCONF, a full disk), a script running past its limit (BUSY), a replica that
# lost its master or misses its min-replicas (MASTERDOWN, NOREPLICAS)
_REFUSING_WORDS = ("MISCONF", "BUSY", "MASTERDOWN", "NOREPLICAS", "TRYAGAIN", "CLUSTERDOWN")


def refusing(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing for now what it will take later: out of memory (OOM, at
    maxmemory with noeviction), a replica after a failover (READONLY), or the refusals above. A
    consumer waits these out as it waits out an outage, instead of dying of them."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError)):
        return True
    # the error's first word: BUSYGROUP (a group that exists) is not BUSY
    return isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in _REFUSING_WORDS


def missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the stream, or the consumer group, is not there: NOGROUP, or a stream
    that does not exist (XINFO's "no such key", XGROUP's "requires the key to exist")."""
    text = str(exc)
    return isinstance(exc, ResponseError) and any(
        words in text for words in ("NOGROUP", "no such key", "requires the key to exist")
    )


def redis_client(url: str, *, patience_s: float = 0.0) -> aioredis.Redis:
    """A client whose every command rides out a Redis outage of up to about ``patience_s``
    seconds (a restart, a failover, a blip of the network): it reconnects and sends the command
    again after 0.25 s, doubling to 5 s between tries. A command whose connection broke after
    Redis ran it may run twice; the bus's consumers deduplicate by message id and the run
    store's writes are idempotent or append one record. 0: no retries."""
    backoff = ExponentialBackoff(cap=5.0, base=0.25)
    retries, waited = 0, 0.0
    while waited < patience_s:
        waited += backoff.compute(retries)
        retries += 1
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(backoff, retries),
        retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=5.0,  # a host that is gone (not refusing) must not hang a try
    )


def as_text(value: Any) -> str:
    """A reply of a client without ``decode_responses`` (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as (milliseconds of the Redis server's clock, sequence): ids of every
    stream compare by it in the order Redis added them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
