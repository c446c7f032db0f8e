"""Shared fixtures: real Redis, a real MongoDB (a ``mongod`` replica set started here, or
``PIKKU_TEST_MONGO_URL``'s server) for every MongoDB test of the suite, and a real Redis
Cluster. tests/README.md says which MongoDB each tier uses and where a stand-in remains. A
missing service fails the test; it never skips."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pymongo.errors
import pytest
import redis

from pikku_celery.engine.heartbeat import Heartbeat
from tests.support import mongomock_compat, summary
from tests.support.mongod import (
    TEST_COMMANDS,
    ExternalMongo,
    MongodReplicaSet,
    describe,
    mongo_target,
)
from tests.support.redis_cluster import RedisClusterServer

mongomock_compat.install()  # $unionWith, which the store's reads use (MongoDB 4.4+)

REDIS_URL = os.environ.get("PIKKU_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--dev-chaos", action="store_true",
        help="run only the tests marked dev_chaos (./dev chaos); without it they are "
             "deselected")


def pytest_configure(config: pytest.Config) -> None:
    # An exception in a test's thread fails the test: a warning is too easy to miss, and a
    # race that counts winners can pass with some of its contenders crashed.
    config.addinivalue_line("filterwarnings",
                            "error::pytest.PytestUnhandledThreadExceptionWarning")
    # pytest-xdist registers it too; named here so -p no:xdist still passes --strict-markers.
    config.addinivalue_line("markers", "xdist_group(name): run with the group's other tests "
                            "in one pytest-xdist process")


# Test modules sharing a session fixture too costly to start twice: under pytest-xdist
# they run in the same process (one three-node replica set, not one per process).
_XDIST_GROUPS = {
    "tests/integration/test_failover.py": "mongod_replset3",
    "tests/integration/test_causal_reads.py": "mongod_replset3",
}


_LONGEST_FIRST = frozenset({"tests/integration/test_partitions.py"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``dev_chaos`` run under ``./dev chaos`` (``--dev-chaos``) and only there:
    deselected otherwise, never skipped. Under pytest-xdist (``--dist loadgroup``, as
    ``./dev test`` runs it) every module is one group, run whole by one process, so a
    module-scoped fixture (a cluster of workers, a replica set) starts once."""
    chaos = config.getoption("--dev-chaos")
    kept, dropped = [], []
    for item in items:
        (kept if (item.get_closest_marker("dev_chaos") is not None) == chaos
         else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(_XDIST_GROUPS.get(module, module)))
    # The longest module (its own namespaces, replica set and workers, one fault after the
    # other) first: handed out last, in collection order, it ran alone at the end.
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in _LONGEST_FIRST)


_MONGO_TESTED: list[str] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands its summary lines to the controller, which prints them.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["pikku_mongo_tested"] = list(_MONGO_TESTED)
        workeroutput["pikku_summary"] = list(summary.LINES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    output = getattr(node, "workeroutput", {})
    _MONGO_TESTED.extend(output.get("pikku_mongo_tested", []))
    summary.LINES.extend(output.get("pikku_summary", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in summary.LINES:  # a test's measurements (tests/support/summary.py)
        terminalreporter.write_line(line)
    # Printed even with -q: a green run must say which MongoDB it proved the store on.
    if _MONGO_TESTED:
        tested = list(dict.fromkeys(_MONGO_TESTED))  # each xdist process starts its own
        terminalreporter.write_line("pikku: real MongoDB tested: " + "; ".join(tested))
    else:
        terminalreporter.write_line("pikku: no test of this run used a real MongoDB")


_OWN_MONGO: list[MongodReplicaSet] = []  # the session's mongod, once a test started it
_SYSTEM_DATABASES = {"admin", "config", "local"}
_POOL_PREFIX = "pikku_pool_"
_POOL: dict[str, list[str]] = {}  # server URL -> emptied databases ready for the next test


@pytest.fixture(scope="session")
def mongo_server() -> Iterator[MongodReplicaSet | ExternalMongo]:
    """The real MongoDB of this test session: a single-node ``mongod`` replica set started
    once (torn down by PID at the end), or the server ``PIKKU_TEST_MONGO_URL`` names."""
    with mongo_target() as target:
        _MONGO_TESTED.append(describe(target))
        if isinstance(target, MongodReplicaSet):
            _OWN_MONGO.append(target)
        yield target
        _OWN_MONGO.clear()
        pooled = _POOL.pop(target.url, [])
        if pooled and isinstance(target, ExternalMongo):  # ours stops with its data
            with pymongo.MongoClient(target.url, serverSelectionTimeoutMS=5000) as client:
                for name in pooled:
                    client.drop_database(name)


@pytest.fixture(scope="module", autouse=True)
def _no_database_outlives_its_module() -> Iterator[None]:
    """Every test drops the databases it made; this catches what one left behind (a test
    failing half-way, a worker's result backend) so the session's ``mongod`` does not grow
    a collection per test. Only on the server this process started: an external server
    (``PIKKU_TEST_MONGO_URL``) may hold other users' databases, and a module-scoped fixture's
    databases live until the module ends, so the sweep runs then, not after each test."""
    yield
    for server in _OWN_MONGO:
        with pymongo.MongoClient(server.url, serverSelectionTimeoutMS=5000) as client:
            for name in set(client.list_database_names()) - _SYSTEM_DATABASES:
                if not name.startswith(_POOL_PREFIX):
                    client.drop_database(name)


@contextlib.contextmanager
def pooled_database(server: Any) -> Iterator[pymongo.database.Database]:
    """An empty database of its own on ``server`` for one test, for a store that creates
    its indexes (``MongoWorkflowStore(db)``): afterwards its collections are emptied, not
    dropped, and the next test gets it with its collections and indexes already made. A
    fresh database costs the store's index builds, ~0.1-0.3 s a test on this machine; an
    emptied one ~15 ms. Not for a test of index creation or of a missing collection."""
    free = _POOL.setdefault(server.url, [])
    name = free.pop() if free else f"{_POOL_PREFIX}{uuid.uuid4().hex[:12]}"
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        server.url, serverSelectionTimeoutMS=5000)
    db = client[name]
    try:
        yield db
    finally:
        try:
            for collection in db.list_collection_names():
                db[collection].delete_many({})
        except pymongo.errors.PyMongoError:
            with contextlib.suppress(pymongo.errors.PyMongoError):
                client.drop_database(name)
        else:
            free.append(name)
        client.close()


@pytest.fixture(scope="session")
def mongod_replset3() -> Iterator[MongodReplicaSet]:
    """A real three-node replica set (election timeout 2 s) for the failover tests; each
    test that kills or pauses a node must leave all three up again, and one that sets a
    failpoint (test commands are on) must lift it."""
    replset = MongodReplicaSet(3, options=TEST_COMMANDS).start()
    _MONGO_TESTED.append(describe(replset))
    yield replset
    replset.stop()


@pytest.fixture(autouse=True)
def _no_heartbeat_outlives_its_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every ``Heartbeat`` made during a test lets go of its steps when the test ends.

    A heartbeat thread runs for the life of the process; left holding a test's steps it
    would go on renewing them into the next tests, against dropped databases, and re-take
    Redis leases under a key prefix the test already cleaned (``Heartbeat`` has no stop:
    its thread stays, idle, holding nothing)."""
    made: list[Heartbeat] = []
    init = Heartbeat.__init__

    def tracked(self: Heartbeat, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Heartbeat, "__init__", tracked)
    yield
    for heartbeat in made:
        for held in heartbeat.held():
            heartbeat.remove(held)


@pytest.fixture(autouse=True)
def _celery_join_flag_restored() -> Iterator[None]:
    """A worker built in this process (started or not) marks the process as a worker, and
    every later ``AsyncResult.get()`` here raises "Never call result.get() within a task":
    one test's worker must not change what the next test's client may do."""
    from celery import _state

    before = _state.task_join_will_block()
    yield
    _state._set_task_join_will_block(before)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServer]:
    """A real three-node Redis Cluster on loopback ports, for this session only."""
    server = RedisClusterServer().start()
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


def mongo_database(kind: str, server: Any = None) -> tuple[pymongo.database.Database, object]:
    """A fresh database of the given kind (``mongomock``, or ``mongod`` on the server given:
    the session's ``mongo_server``) and a handle to drop it with."""
    name = f"pikku_test_{uuid.uuid4().hex[:12]}"
    if kind == "mongomock":
        import mongomock

        client = mongomock.MongoClient()
        return client[name], client
    assert server is not None, f"a {kind} database needs its server fixture"
    client = pymongo.MongoClient(server.url, serverSelectionTimeoutMS=5000)
    return client[name], client
