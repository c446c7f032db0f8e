"""Shared fixtures: real Redis, the nx-27017 wire stand-in, mongomock, and real MongoDB
when ``PIKKU_TEST_MONGO_URL`` is set. A missing service fails the test; it never skips."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pymongo
import pytest
import redis

from tests.support.nx import NxServer

REDIS_URL = os.environ.get("PIKKU_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REAL_MONGO_URL = os.environ.get("PIKKU_TEST_MONGO_URL")


@pytest.fixture(scope="session")
def nx_server() -> Iterator[NxServer]:
    server = NxServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()  # fails the test loudly when Redis is down: never a skip
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A Redis key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"pikku-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


def mongo_database(kind: str, nx: NxServer | None) -> tuple[pymongo.database.Database, object]:
    """A fresh database of the given kind and a handle to drop it with."""
    name = f"pikku_test_{uuid.uuid4().hex[:12]}"
    if kind == "mongomock":
        import mongomock

        client = mongomock.MongoClient()
        return client[name], client
    url = nx.url if kind == "wire" and nx is not None else REAL_MONGO_URL
    assert url, "real MongoDB requested without PIKKU_TEST_MONGO_URL"
    client = pymongo.MongoClient(url, serverSelectionTimeoutMS=5000)
    return client[name], client
