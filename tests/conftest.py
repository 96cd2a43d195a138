"""Shared fixtures: one private redis-server for the session, a fresh key prefix per test."""

from __future__ import annotations

import uuid

import pytest
import redis

from services.bus import Bus
from services.local_redis import LocalRedis


@pytest.fixture(scope="session")
def redis_server():
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix(redis_server):
    """A prefix unique to this test; its keys are deleted afterwards."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(redis_server.url)
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
async def bus(redis_url, key_prefix):
    b = Bus.from_url(redis_url, prefix=key_prefix)
    yield b
    await b.close()
