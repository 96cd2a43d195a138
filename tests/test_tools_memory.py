"""What hostile pages can make the tool gateway hold, in its process and in the Redis it shares with
the bus (a hostile-input review, 2026-11-30): bounded in bytes, and a full Redis is not a failed call."""

from __future__ import annotations

import encodings

import pytest
from prometheus_client import REGISTRY

from services.search.extractive import IdfTable, _stem_cached, extract, stem
from services.tools.fetch import _charset
from services.tools.store import MemoryStore, RedisStore

PAGE_SIZED = "\U0001f600" * 100_000  # a cut read of astral characters: about 400 KB in memory


def _counter(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


async def test_the_in_process_cache_is_bounded_in_bytes_not_only_in_entries():
    """Bounded only by count (10,000 entries near, 100,000 without Redis), the cache held 4 GB of
    such reads. Budgets are kept apart: large entries must not push a trajectory's count out."""
    store = MemoryStore(max_items=10_000, max_bytes=4 << 20)
    for _ in range(3):
        await store.incr("budget:t", 60)
    await store.set("k0", "small", 60)
    await store.set("k0", PAGE_SIZED, 60)  # replaced: counted once, at its new size
    for i in range(1, 40):
        await store.set(f"k{i}", PAGE_SIZED + str(i), 60)
    assert store.cache.bytes <= 4 << 20 and 5 <= len(store.cache.items) <= 10
    assert await store.get("k39") is not None and await store.get("k0") is None  # the oldest went
    assert await store.incr("budget:t", 60) == 4  # the count went on
    for key in list(store.cache.items):
        store.cache.drop(key)
    assert store.cache.bytes == 0  # the accounting holds through replacements
    unbounded = MemoryStore(max_bytes=0)  # no cache at all, budgets still counted
    await unbounded.set("k", "v", 60)
    assert await unbounded.get("k") is None
    assert [await unbounded.incr("b", 60) for _ in range(3)] == [1, 2, 3]


def test_a_page_of_one_long_sentence_reads_as_a_bounded_passage():
    """A passage is what lies between two full stops, and the best one was returned whole: a page
    with none made every read 100,000 characters, cached for a week."""
    page = "festival " + "word " * 40_000
    found = extract(page, "festival", IdfTable(), max_chars=600)
    missed = extract(page, "museum", IdfTable(), max_chars=600)
    assert found.found and not missed.found
    for ex in (found, missed):
        assert sum(map(len, ex.evidence)) <= 4 * 600 + 2 and len(ex.summary) <= 4 * 600 + 2


def test_long_words_and_charset_names_are_not_kept_for_good():
    """The stemmer's cache kept every word it saw (a page's "word" can be 60,000 letters), and
    Python's codec registry keeps every name it is asked for, found or not."""
    before = _stem_cached.cache_info().currsize
    assert stem("a" * 60_000 + "ing") == "a" * 60_000
    assert _stem_cached.cache_info().currsize == before
    assert stem("founded") == "found" and stem("cities") == "city"
    name = "x" * 5_000
    assert _charset(f"text/html; charset={name}") == "utf-8"
    assert not any(len(k) > 1_000 for k in encodings._cache)
    cached = len(encodings._cache)
    for i in range(1_000):  # names short enough to be charsets, that none is
        assert _charset(f"text/html; charset=x-{i:038d}") == "utf-8"
    assert len(encodings._cache) == cached
    assert _charset("text/html; charset=ISO-8859-1") == "iso8859-1"


@pytest.fixture
def full_redis():
    """A private redis-server without eviction (as the bus runs it), with room for 400 KB more than
    it holds before it is half full."""
    import redis

    from services.local_redis import LocalRedis, free_port

    with LocalRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("maxmemory-policy", "noeviction")
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", 2 * used + 800_000)
        yield server, admin


async def test_a_redis_short_of_memory_takes_no_cache_entries_and_fails_no_call(full_redis):
    """The cache filled the Redis the bus shares; at maxmemory every tool call was then an HTTP 500
    (the refusal escaped the store), which ended its trajectory as an error. The store stops writing
    entries past its share of maxmemory, and what Redis refuses anyway is served in the process."""
    from services.bus import redis_client

    server, admin = full_redis
    client = redis_client(server.url)
    try:
        clock = [0.0]
        sharing = RedisStore(client, "full", redis_share=0.5, clock=lambda: clock[0])
        skipped = _counter("pbsd_tools_cache_writes_skipped_total")
        await sharing.set("cache:a", "x" * 1000, 60)
        assert admin.get("full:tools:cache:a") is not None  # room: written
        admin.set("ballast", "b" * 600_000)  # past half of maxmemory
        await sharing.set("cache:b", "x" * 1000, 60)  # the last look said there was room
        clock[0] += 11
        await sharing.set("cache:c", "x" * 1000, 60)
        assert admin.get("full:tools:cache:c") is None and await sharing.get("cache:c") == "x" * 1000
        assert _counter("pbsd_tools_cache_writes_skipped_total") == skipped + 1

        greedy = RedisStore(client, "full", redis_share=1.0)  # writes until Redis refuses
        fallbacks = _counter("pbsd_tools_store_fallbacks_total", {"op": "set"})
        for i in range(20):
            await greedy.set(f"cache:{i}", PAGE_SIZED, 60)  # OOM from Redis: no exception
        assert _counter("pbsd_tools_store_fallbacks_total", {"op": "set"}) > fallbacks
        assert await greedy.get("cache:19") == PAGE_SIZED  # served in the process
        admin.delete("ballast", *[f"full:tools:cache:{i}" for i in range(20)])
    finally:
        await client.aclose()


async def test_a_full_redis_is_told_once_and_a_redis_that_hides_its_memory_is_written(full_redis, caplog):
    """At maxmemory each call's budget count was refused (a warning) and its cache write skipped,
    which read as Redis being back (another line): two log lines a call. And INFO refused (an ACL
    without @dangerous) escaped the store: a 500 for one call every 10 s."""
    import logging

    from redis.exceptions import NoPermissionError

    from services.bus import redis_client

    server, admin = full_redis
    client = redis_client(server.url)
    try:
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - 1000)  # past it
        store = RedisStore(client, "full", redis_share=0.5)
        with caplog.at_level(logging.INFO, logger="services.tools.store"):
            for i in range(3):
                assert (await store.incr_and_get("budget:t", 60, f"cache:{i}"))[0] == i + 1
                await store.set(f"cache:{i}", "answer", 60)
        lines = [r.getMessage() for r in caplog.records if r.name == "services.tools.store"]
        assert sum("is refusing" in m for m in lines) == 1 and not any("again" in m for m in lines), lines
        admin.config_set("maxmemory", 0)

        async def refused(*args, **kwargs):
            raise NoPermissionError("NOPERM this user has no permissions to run the 'info' command")

        blind = RedisStore(client, "blind")
        client.info = refused
        await blind.set("cache:k", "v", 60)
        assert admin.get("blind:tools:cache:k") == b"v"
    finally:
        await client.aclose()
