"""The MongoDB store's write and read concerns (issue 12): majority by default, settable
through ``MongoWorkflowStore.from_url``, the URL, client options and the ``pikku_*`` Celery
settings, and what reaches the server: every collection the store writes carries them, and
the commands sent (seen by a pymongo command listener on the session's real MongoDB, a
single-node replica set) name them, and the server accepts them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from celery import Celery
from pymongo import monitoring
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from pikku_celery import MongoWorkflowStore, PikkuCelery
from pikku_celery.model import keys
from pikku_celery.store._concerns import DEFAULT_WTIMEOUT_MS
from pikku_celery.store.base import NewRun
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget

NOWHERE = "mongodb://127.0.0.1:1/pikku_concerns"  # never connected: connect=False


Pair = tuple[tuple[tuple[str, Any], ...], str | None]


def pair(write: WriteConcern, read: ReadConcern) -> set[Pair]:
    """A (write, read) concern pair in a comparable, hashable form."""
    return {(tuple(sorted(write.document.items())), read.level)}


def concerns(store: MongoWorkflowStore) -> set[Pair]:
    """The distinct (write, read) concerns of the database and every collection the store
    uses: one pair when they all agree."""
    collections = [store.db, *(store.db[name] for name in (
        keys.RUNS, keys.STEPS, keys.HISTORY, keys.VERSIONS)), *(getattr(store, attribute)
        for attribute in ("_runs", "_steps", "_history", "_versions"))]
    found: set[Pair] = set()
    for collection in collections:
        found |= pair(collection.write_concern, collection.read_concern)
    return found


MAJORITY = WriteConcern(w="majority", wtimeout=DEFAULT_WTIMEOUT_MS)


def test_majority_writes_and_reads_by_default() -> None:
    """With a ``wtimeout`` (10 s): a set that cannot reach its majority must not hold a
    write (a worker's settle, its heartbeat) forever."""
    assert DEFAULT_WTIMEOUT_MS == 10_000
    store = MongoWorkflowStore.from_url(NOWHERE)
    assert concerns(store) == pair(MAJORITY, ReadConcern("majority"))
    assert store.db.client.options.retry_writes  # pymongo's default, kept


@pytest.mark.parametrize(("given", "expected"), [
    ("majority", MAJORITY),
    (2, WriteConcern(w=2, wtimeout=DEFAULT_WTIMEOUT_MS)),
    ("3", WriteConcern(w=3, wtimeout=DEFAULT_WTIMEOUT_MS)),  # environment-fed: strings
    ({"w": "majority", "wtimeout": 5000, "j": True},
     WriteConcern(w="majority", wtimeout=5000, j=True)),
    ({"w": "majority", "wtimeout": 0}, WriteConcern(w="majority", wtimeout=0)),  # forever
    ({"w": "2"}, WriteConcern(w=2, wtimeout=DEFAULT_WTIMEOUT_MS)),
    ({"j": True}, WriteConcern(w="majority", wtimeout=DEFAULT_WTIMEOUT_MS, j=True)),
    (WriteConcern(w=1, j=True), WriteConcern(w=1, j=True)),  # w=1 waits for no copy
])
def test_a_given_write_concern_is_on_every_collection(given: Any,
                                                      expected: WriteConcern) -> None:
    store = MongoWorkflowStore.from_url(NOWHERE, write_concern=given, read_concern="local")
    assert concerns(store) == pair(expected, ReadConcern("local"))


@pytest.mark.parametrize("level", ["local", "majority", "linearizable"])
def test_a_given_read_concern_is_on_every_collection(level: str) -> None:
    for given in (level, ReadConcern(level)):
        store = MongoWorkflowStore.from_url(NOWHERE, read_concern=given)
        assert concerns(store) == pair(MAJORITY, ReadConcern(level))


@pytest.mark.parametrize(("url_w", "setting"), [("?w=1", None), ("", 1), ("", {"w": 2})])
def test_writes_not_majority_read_local_unless_told(url_w: str, setting: Any) -> None:
    """Majority reads go with majority writes only: with ``w=1`` a worker's majority read
    could miss a run another process had just started (found by the benchmarks: the
    first pass dropped its message as for an unknown run). A read concern given or in the
    URL still wins."""
    store = MongoWorkflowStore.from_url(NOWHERE + url_w, write_concern=setting)
    assert {read for _, read in concerns(store)} == {"local"}
    told = MongoWorkflowStore.from_url(NOWHERE + url_w, write_concern=setting,
                                       read_concern="majority")
    assert {read for _, read in concerns(told)} == {"majority"}
    query = (url_w + "&" if url_w else "?") + "readConcernLevel=majority"
    in_url = MongoWorkflowStore.from_url(NOWHERE + query, write_concern=setting)
    assert {read for _, read in concerns(in_url)} == {"majority"}


def test_concerns_in_the_url_or_client_options_are_kept() -> None:
    """A URL (or client options) that sets them is the user's choice: no default overrides
    it, and an explicit argument still wins over both."""
    url = NOWHERE + "?w=1&readConcernLevel=local"
    assert concerns(MongoWorkflowStore.from_url(url)) == pair(WriteConcern(w=1),
                                                              ReadConcern("local"))
    options = MongoWorkflowStore.from_url(NOWHERE, w=2, readConcernLevel="local")
    assert concerns(options) == pair(WriteConcern(w=2, wtimeout=DEFAULT_WTIMEOUT_MS),
                                     ReadConcern("local"))
    explicit = MongoWorkflowStore.from_url(url, write_concern="majority",
                                           read_concern="majority")
    assert concerns(explicit) == pair(MAJORITY, ReadConcern("majority"))


def test_each_write_concern_option_comes_from_the_setting_else_the_url_else_the_default(
        ) -> None:
    """The URL's ``wtimeoutMS`` (or ``journal``) is kept under a ``w`` given as a setting;
    a ``wtimeout`` given as a setting wins over the URL's."""
    url = NOWHERE + "?w=2&wtimeoutMS=2500&journal=true"
    assert concerns(MongoWorkflowStore.from_url(url)) == pair(  # not majority: local reads
        WriteConcern(w=2, wtimeout=2500, j=True), ReadConcern("local"))
    assert concerns(MongoWorkflowStore.from_url(url, write_concern="majority")) == pair(
        WriteConcern(w="majority", wtimeout=2500, j=True), ReadConcern("majority"))
    assert concerns(MongoWorkflowStore.from_url(
        url, write_concern={"w": "majority", "wtimeout": 700})) == pair(
        WriteConcern(w="majority", wtimeout=700, j=True), ReadConcern("majority"))
    assert concerns(MongoWorkflowStore.from_url(NOWHERE + "?wtimeoutMS=300")) == pair(
        WriteConcern(w="majority", wtimeout=300), ReadConcern("majority"))


@pytest.mark.parametrize(("option", "value", "match"), [
    ("write_concern", 0, "unacknowledged"),
    ("write_concern", "0", "unacknowledged"),
    ("write_concern", {"w": 0}, "unacknowledged"),
    ("write_concern", WriteConcern(w=0), "unacknowledged"),
    ("write_concern", {"w": "majority", "wtimeoutMS": 5}, "unknown option"),
    ("write_concern", {"w": -1}, "write_concern"),
    ("write_concern", {"w": 0, "j": True}, "write_concern"),
    ("write_concern", 1.5, "write_concern"),
    ("write_concern", True, "write_concern"),
    ("read_concern", "available", "read_concern"),
    ("read_concern", "strong", "read_concern"),
    ("read_concern", 1, "read_concern"),
])
def test_a_concern_the_store_cannot_use_is_a_value_error(option: str, value: Any,
                                                         match: str) -> None:
    """An unacknowledged write returns no result: the store could not tell a claim it won
    from one it lost, so it is refused before any client is made."""
    with pytest.raises(ValueError, match=match):
        MongoWorkflowStore.from_url(NOWHERE, **{option: value})


# --- what reaches the server -------------------------------------------------------------


class Commands(monitoring.CommandListener):
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sent.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture
def database(mongo_server: MongoTarget) -> Iterator[tuple[str, str]]:
    name = f"pikku_concerns_{uuid.uuid4().hex[:10]}"
    yield mongo_server.url_for(name), name
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(mongo_server.url)
    client.drop_database(name)
    client.close()


def _commands(url: str, **options: Any) -> tuple[Commands, MongoWorkflowStore]:
    listener = Commands()
    store = MongoWorkflowStore.from_url(url, event_listeners=[listener], **options)
    run = NewRun(run_id=f"r-{uuid.uuid4().hex[:8]}", workflow="wf", input={}, version=None)
    store.create_run(run, 1_000)
    store.get_run(run.run_id)
    return listener, store


def _sent(listener: Commands, name: str) -> list[dict[str, Any]]:
    return [command for command in listener.sent if name in command]


def test_writes_and_reads_carry_the_concerns_to_the_server(
        database: tuple[str, str]) -> None:
    url, _ = database
    listener, store = _commands(url)
    try:
        inserts = _sent(listener, "insert")
        finds = _sent(listener, "find")
        assert inserts and finds
        assert all(c.get("writeConcern") == {"w": "majority", "wtimeout": 10_000}
                   for c in inserts), inserts
        assert all(c["readConcern"]["level"] == "majority" for c in finds), finds
        # The read after the thread's write waits for it (``MongoWorkflowStore._causally``).
        assert all("afterClusterTime" in c["readConcern"] for c in finds), finds
    finally:
        store.db.client.close()


def test_chosen_concerns_reach_the_server(database: tuple[str, str]) -> None:
    url, _ = database
    listener, store = _commands(url, write_concern={"w": 1, "j": True}, read_concern="local")
    try:
        inserts, finds = _sent(listener, "insert"), _sent(listener, "find")
        assert inserts and finds
        assert all(c.get("writeConcern") == {"w": 1, "j": True} for c in inserts), inserts
        assert all(c["readConcern"]["level"] == "local" for c in finds), finds
    finally:
        store.db.client.close()


# --- the pikku_* Celery settings ---------------------------------------------------------


def _app(**conf: Any) -> Celery:
    app = Celery(f"concerns-{uuid.uuid4().hex[:8]}", broker="memory://")
    app.conf.update(pikku_mongo_url=NOWHERE, pikku_redis_url=REDIS_URL, **conf)
    return app


def test_the_celery_settings_set_the_concerns() -> None:
    pikku = PikkuCelery(_app(pikku_write_concern={"w": "majority", "wtimeout": 10_000},
                             pikku_read_concern="local"))
    store = pikku.engine.store
    assert isinstance(store, MongoWorkflowStore)
    assert concerns(store) == pair(WriteConcern(w="majority", wtimeout=10_000),
                                   ReadConcern("local"))


def test_unset_or_empty_settings_keep_the_defaults() -> None:
    for conf in ({}, {"pikku_write_concern": "", "pikku_read_concern": ""}):
        store = PikkuCelery(_app(**conf)).engine.store
        assert isinstance(store, MongoWorkflowStore)
        assert concerns(store) == pair(MAJORITY, ReadConcern("majority"))


@pytest.mark.parametrize(("setting", "value"), [
    ("pikku_write_concern", "0"), ("pikku_read_concern", "available"),
])
def test_a_bad_concern_setting_is_a_value_error_naming_it(setting: str, value: str) -> None:
    pikku = PikkuCelery(_app(**{setting: value}))
    with pytest.raises(ValueError, match=setting):
        pikku.engine  # noqa: B018


def test_an_unacknowledged_url_is_refused_too() -> None:
    with pytest.raises(ValueError, match="unacknowledged"):
        MongoWorkflowStore.from_url(NOWHERE + "?w=0")


@pytest.mark.parametrize("seconds", [float("nan"), float("inf")])
def test_a_deadline_that_is_no_number_of_seconds_is_refused(seconds: float) -> None:
    from pikku_celery.store._concerns import deadline

    with pytest.raises(ValueError, match="deadline"), deadline(seconds):
        pass  # pragma: no cover
