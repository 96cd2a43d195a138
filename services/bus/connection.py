"""Connecting to Redis: a client that rides out short outages, and what an outage raises."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "REDIS_DOWN",
    "Parts",
    "as_text",
    "entry_order",
    "made_by_redis_client",
    "missing",
    "redis_client",
    "refusing",
]

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


class _KeepsCancellation:
    """A connection that never loses its task's cancellation. redis-py bounds each write with
    ``asyncio.wait_for``, which on Python 3.11 (the images' Python) returns the write's result
    when a cancellation comes just as the write completes, and the cancellation is gone
    (CPython gh-86296; 3.12's wait_for keeps it). A task cancelled in a command then ran on: a
    third of the cancellations of a loop of commands were lost, and a heartbeat that lost its
    own went on renewing an entry for good, its consumer waiting for it to end. A cancellation
    that came during the write is raised here once it is done, and the connection is dropped,
    as redis-py drops one cancelled while it reads: the reply would be left unread on it."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        await super().send_packed_command(command, check_health)  # type: ignore[misc]
        if task is not None and task.cancelling() > asked:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise asyncio.CancelledError


SLICE_BYTES = 1 << 20


class Parts:
    """A command's argument sent as its parts, in order, never joined (a payload as
    :func:`proto.base.encode_parts` makes it): a 200 MB value is not copied whole once more, and
    its writer lets go of it a part at a time (:mod:`services.bus.freeing`). Only the clients of
    :func:`redis_client` send it."""

    __slots__ = ("parts", "size")

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))


class _WritesInSlices:
    """A connection that writes a large command (a group's payload: up to 200 MB with routes) a
    slice at a time, letting the event loop run between slices. redis-py hands the whole command
    to ``StreamWriter.writelines``, which on Python 3.11 joins it into one bytes object and buffers
    what the socket does not take at once in a bytearray that each send then shifts: a 200 MB SET
    held the loop for a third of a second in one piece, and took three times as long as slices
    do (benchmarks/keeps.py). A slice is at most ``SLICE_BYTES``, and the next is written once the
    transport has drained the last and the loop has had a turn."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if not any(type(arg) is Parts for arg in args):
            return super().pack_command(*args)  # type: ignore[misc]
        # RESP, as redis-py packs a command: the number of arguments, then each as
        # $<length>\r\n<bytes>\r\n; a Parts argument's bytes are its parts, left as they are
        if isinstance(args[0], str):  # a command of several words ("CONFIG SET") is several arguments
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        command: list[bytes] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is Parts:
                command += [head + b"$%d\r\n" % arg.size, *arg.parts]
                head = b"\r\n"
            else:
                value = self.encoder.encode(arg)  # type: ignore[attr-defined]
                head += b"$%d\r\n%s\r\n" % (len(value), value)
        return [*command, head]

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        if not isinstance(command, (list, tuple)) or sum(len(part) for part in command) <= SLICE_BYTES:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        if not self.is_connected:  # type: ignore[attr-defined]
            # as redis-py connects before a write (the health check comes next, if asked for)
            connect = getattr(self, "connect_check_health", None)
            await (connect(check_health=False) if connect else self.connect())  # type: ignore[attr-defined]
        if check_health:
            await self.check_health()  # type: ignore[attr-defined]
        try:
            async with asyncio.timeout(self.socket_timeout):  # type: ignore[attr-defined]
                slices = [(part, start) for part in command for start in range(0, len(part), SLICE_BYTES)]
                for n, (part, start) in enumerate(slices, 1):
                    self._writer.write(memoryview(part)[start : start + SLICE_BYTES])  # type: ignore[attr-defined]
                    await self._writer.drain()  # type: ignore[attr-defined]
                    if n < len(slices):  # drain returns at once while the socket keeps up
                        await asyncio.sleep(0)
        except TimeoutError:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:  # a cancellation: Redis never runs a command it got a part of
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise


# each scheme's class (TCP for redis://, TLS for rediss://, a socket file for unix://), keeping
# cancellations and writing large commands in slices
_KEEPING: dict[type, type] = {
    base: type(f"Keeping{base.__name__}", (_KeepsCancellation, _WritesInSlices, base), {})
    for base in (aioredis.Connection, aioredis.SSLConnection, aioredis.UnixDomainSocketConnection)
}


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
    client = aioredis.Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(backoff, retries),
        retry_on_error=list(REDIS_DOWN),
        socket_connect_timeout=5.0,  # a host that is gone (not refusing) must not hang a try
    )
    pool = client.connection_pool  # no connection made yet: each is made of this class
    if pool.connection_class not in _KEEPING:
        raise ValueError(f"no connection class that keeps cancellations for {pool.connection_class}")
    pool.connection_class = _KEEPING[pool.connection_class]
    return client


def made_by_redis_client(client: aioredis.Redis) -> bool:
    """Whether ``client``'s connections are :func:`redis_client`'s, which the bus relies on: they
    keep cancellations, and write large values in slices and from their parts."""
    return client.connection_pool.connection_class in _KEEPING.values()


def as_text(value: Any) -> str:
    """A reply of a client without ``decode_responses`` (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as (milliseconds of the Redis server's clock, sequence): ids of every
    stream compare by it in the order Redis added them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
