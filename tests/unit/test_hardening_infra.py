"""Hardening of issue 8, infrastructure side: state that survives a fork (10), counters and
names bounded before they reach Redis (14), nesting depth refused before it recurses (16),
an unreachable store named clearly (20), what the distribution ships (21), and indexes that
serve every store query (22)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from packaging.requirements import Requirement
from pymongo.errors import ServerSelectionTimeoutError

import tests.unit.test_contrib as contrib_tests
from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    MongoWorkflowStore,
    PikkuCelery,
    PikkuError,
    RedisLeaseService,
    WorkflowStore,
)
from pikku_celery.engine.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import Lease
from pikku_celery.model.clock import ServerClock
from pikku_celery.model.validate import MAX_DOCUMENT_DEPTH, check_value
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.store.mongo import MongoUnreachableError
from pikku_celery.worker.tasks import OutageLog
from tests.conftest import mongo_database, pooled_database
from tests.support.mongod import free_port
from tests.support.query_recorder import record_store

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000
FN = "hardening.fn"

# --- 10: locks created before a fork ------------------------------------------------------

CHILD_HANG_LIMIT_S = 30.0  # a guard against a hung child, never a timing assertion


class _FixedSource:
    def now_ms(self) -> int:
        return 1_700_000_000_000


@contextmanager
def _held_by_another_thread(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` in a second thread for the duration of the block, as the worker's
    reaper or heartbeat thread holds it at the moment the prefork pool forks."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join()


def _in_forked_child(body: Callable[[], None]) -> None:
    """Run ``body`` in a forked child; fail if it raises or does not finish."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_HANG_LIMIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung: it inherited a lock held by a parent thread")
        time.sleep(0.01)


def test_a_child_forked_while_a_thread_holds_the_clock_lock_can_read_the_clock() -> None:
    clock = ServerClock(_FixedSource())
    assert clock.now_ms() >= 1_700_000_000_000

    def child() -> None:
        assert clock.now_ms() >= 1_700_000_000_000
        clock.observe(1_700_000_001_000, time.monotonic())
        assert clock.now_ms() >= 1_700_000_001_000

    with _held_by_another_thread(clock._lock):
        _in_forked_child(child)


def test_a_forked_child_gets_a_usable_heartbeat_without_the_parents_steps() -> None:
    leases = InMemoryLeaseService()
    heartbeat = Heartbeat(InMemoryWorkflowStore(), leases, ServerClock(leases))
    lease = Lease("workflow-step:r:s", "parent", 1, 0, 0)
    parents = HeldStep("r", "s", 1, 600_000, lease, held_until=time.monotonic() + 600)
    heartbeat.add(parents)

    def child() -> None:
        # The parent's step is renewed by the parent; a child renewing it too would keep
        # a dead parent's lease alive.
        assert heartbeat.held() == []
        mine = HeldStep("r", "t", 1, 600_000, lease, held_until=time.monotonic() + 600)
        heartbeat.add(mine)
        assert heartbeat.held() == [mine]
        heartbeat.remove(mine)

    try:
        with _held_by_another_thread(heartbeat._lock):
            _in_forked_child(child)
    finally:
        heartbeat.remove(parents)
    assert heartbeat.held() == []



def test_a_child_forked_while_a_thread_builds_the_cluster_client_can_build_its_own() -> None:
    """The lazy Redis Cluster client is built under a lock, by whichever thread first
    calls Redis (the parent's reaper thread): a child forked meanwhile must not inherit
    it held, nor the parent's client."""
    from pikku_celery.leases.redis import _LazyCluster

    lazy = _LazyCluster.from_url("redis+cluster://127.0.0.1:1,127.0.0.1:2")
    lazy._built = object()  # type: ignore[assignment]  # the parent's client

    def child() -> None:
        assert lazy._built is None  # a child builds its own
        assert lazy._lock.acquire(timeout=5), "the child inherited the parent's held lock"
        lazy._lock.release()

    with _held_by_another_thread(lazy._lock):
        _in_forked_child(child)
    assert lazy._built is not None  # the parent keeps its client

# --- 16: nesting depth --------------------------------------------------------------------


def nested(levels: int, leaf: Any = 1) -> Any:
    """A value of ``levels`` nested containers (objects and arrays alternating)."""
    value = leaf
    for level in range(levels):
        value = {"k": value} if level % 2 else [value]
    return value


@pytest.fixture(params=["memory", "mongod"])
def any_store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    if request.param == "memory":
        yield InMemoryWorkflowStore()
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield MongoWorkflowStore(db)


def test_the_deepest_value_a_document_can_hold_is_stored_one_more_level_is_refused(
        any_store: WorkflowStore) -> None:
    # The run document is level 1: its input may nest 99 levels, so the document has 100.
    deepest = nested(MAX_DOCUMENT_DEPTH - 1)
    run, _ = any_store.create_run(NewRun("deep-ok", "order", deepest), T0)
    assert run.input == deepest
    with pytest.raises(InvalidInputError, match=r"nested too deeply.*level 101"):
        any_store.create_run(NewRun("deep-no", "order", nested(MAX_DOCUMENT_DEPTH)), T0)
    assert any_store.get_run("deep-no") is None


@pytest.mark.parametrize("levels", [150, 5_000, 200_000])
def test_deep_values_are_refused_without_recursion_on_every_write(
        any_store: WorkflowStore, levels: int) -> None:
    deep = nested(levels)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.create_run(NewRun("deep", "order", deep), T0)
    any_store.create_run(NewRun("r", "order", None), T0)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.insert_step(NewStep("r", "s", FN, deep, max_attempts=2), T0)
    any_store.insert_step(NewStep("r", "s", FN, None, max_attempts=2), T0)
    claimed = any_store.claim_step("r", "s", FN, T0, 60_000).state
    assert claimed is not None
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.set_result("r", "s", claimed.attempt, deep, T0 + 1)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.transition_run("r", ["running"], "completed", T0 + 1, output=deep)
    step = any_store.get_step("r", "s")
    assert step is not None and step.status == "running" and step.result is None
    run = any_store.get_run("r")
    assert run is not None and run.status == "running"


def test_a_list_that_contains_itself_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        check_value("workflow input", loop)


@pytest.mark.parametrize("framework", ["flask", "django"])
@pytest.mark.parametrize("levels", [150, 100_000])
def test_the_web_api_answers_a_deep_body_with_400(framework: str, levels: int) -> None:
    pikku, post = _raw_poster(framework)
    body = '{"input": ' + "[" * levels + "]" * levels + "}"
    status, payload = post("/workflows/sum/runs", body)
    assert (status, payload["error"]) == (400, "InvalidInputError")
    assert "nested too deeply" in payload["message"]
    assert pikku.list_runs() == []


def _raw_poster(framework: str) -> tuple[PikkuCelery, Callable[[str, str], tuple[int, Any]]]:
    """POST a raw body as an authorized caller (the test clients' own JSON encoders would
    recurse on it)."""
    return contrib_tests.raw_poster(framework)


# --- 22: every store query is served by an index ------------------------------------------
#
# Without ``explain`` (no real MongoDB here): an index serves a query when, after a prefix
# of fields the query pins by equality (``$in`` counts: MongoDB merges one sorted scan per
# value), come the query's sort fields (those not pinned to one value), in order, all in
# the index's direction or all reversed; with no sort, the next index field is one the
# query bounds by a range (or the query has no range). Every equality field of the query
# must be in that prefix, except when the prefix starts by pinning ``_id``, a run id or a
# step id: then what is scanned is one document, one run's steps or one step's history.
# A ``$or`` (or ``$and`` of ``$or``) is checked clause by clause, as the planner plans it.

BOUNDED_BY = {"_id", "run_id", "step_id"}
RANGE_OPS = {"$lt", "$lte", "$gt", "$gte"}
# Queries allowed to sort in memory after an index bounded them by a range, and why: the
# reaper's sweeps. Each range is the sweep's backlog (steps whose lease lapsed, pending
# steps nobody picked up, due sleeps and retries: what no worker has handled yet), and the
# order is only for paging through it. An index in updated_ms order for the due steps
# would instead walk every failed step ever, on every sweep.
SORTED_IN_MEMORY: dict[tuple[str, str], str] = {
    ("workflow_steps", "lease_expires_ms"): "lapsed steps",
    ("workflow_steps", "updated_ms"): "pending steps nobody picked up",
    ("workflow_steps", "due_ms"): "due scheduled and failed steps",
}


def _clauses(query: dict[str, Any]) -> list[dict[str, Any]]:
    """The query as OR-ed flat clauses (field -> condition)."""
    base: dict[str, Any] = {}
    alternatives: list[list[dict[str, Any]]] = []
    for field, condition in query.items():
        if field == "$or":
            alternatives.append([c for sub in condition for c in _clauses(sub)])
        elif field == "$and":
            alternatives.extend(_clauses(sub) for sub in condition)
        else:
            base[field] = condition
    result = [base]
    for options in alternatives:
        result = [_merged(r, o) for r in result for o in options]
    return result


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for field, condition in b.items():
        mine = out.get(field)
        if isinstance(mine, dict) and isinstance(condition, dict):
            out[field] = {**mine, **condition}
        elif field not in out or isinstance(mine, dict):
            out[field] = condition  # an equality wins over a range on the same field
    return out


def _points(condition: Any) -> int | None:
    """How many values an equality pins (``None``: not an equality)."""
    if not isinstance(condition, dict):
        return 1
    if "$eq" in condition:
        return 1
    if "$in" in condition:
        return len(condition["$in"])
    return None


def _is_range(condition: Any) -> bool:
    return isinstance(condition, dict) and bool(RANGE_OPS & set(condition))


def serves(index: list[tuple[str, int]], clause: dict[str, Any],
           sort: list[tuple[str, int]]) -> str | None:
    """``"sorted"``, ``"bounded"`` (no sort needed), ``"range"`` (bounded by a range, then
    sorted in memory), or ``None`` when the index does not serve the clause."""
    equal = {f for f, c in clause.items() if _points(c) is not None}
    single = {f for f, c in clause.items() if _points(c) == 1}
    ranged = {f for f, c in clause.items() if _is_range(c)}
    j = 0
    while j < len(index) and index[j][0] in equal:
        j += 1
    prefix = {f for f, _ in index[:j]}
    pinned = j > 0 and index[0][0] in BOUNDED_BY
    if not pinned and not equal <= prefix:
        return None
    if pinned:
        return "bounded"
    rest = index[j:]
    wanted = [(f, d) for f, d in sort if f not in single]
    if wanted:
        head = rest[:len(wanted)]
        if [f for f, _ in head] == [f for f, _ in wanted]:
            same = [d == w for (_, d), (_, w) in zip(head, wanted, strict=True)]
            if all(same) or not any(same):
                return "sorted"
        return "range" if rest and rest[0][0] in ranged else None
    if j == 0 and not (rest and rest[0][0] in ranged):
        return None  # a collection scan
    if ranged and not (rest and rest[0][0] in ranged):
        return None
    return "bounded"


def unserved(record: dict[str, Any], indexes: dict[str, list[list[tuple[str, int]]]]
             ) -> list[str]:
    """Why ``record`` is not served by ``indexes`` (empty when it is)."""
    collection = record["collection"]
    if record["op"] not in ("find", "find_one", "find_one_and_update", "update_one",
                            "update_many", "replace_one", "delete_one", "delete_many",
                            "count_documents"):
        return [f"{record['op']} cannot be checked"]
    candidates = [[("_id", 1)], *indexes.get(collection, [])]
    sort = [(f, d) for f, d in record["sort"] or []]
    problems = []
    for clause in _clauses(record["filter"]):
        verdicts = [serves(index, clause, sort) for index in candidates]
        if "sorted" in verdicts or "bounded" in verdicts:
            continue
        ranged = {f for f, c in clause.items() if _is_range(c)}
        allowed = any((collection, f) in SORTED_IN_MEMORY for f in ranged)
        if "range" in verdicts and allowed:
            continue
        problems.append(f"{record['method']}: {collection}.{record['op']} {clause} "
                        f"sort {sort} ({'sorted in memory' if 'range' in verdicts else 'scan'})")
    return problems


def declared_indexes(server: Any) -> dict[str, list[list[tuple[str, int]]]]:
    db, client = mongo_database("mongod", server)
    store = MongoWorkflowStore(db)
    store.create_indexes()
    found: dict[str, list[list[tuple[str, int]]]] = {}
    for name in db.list_collection_names():
        for info in db[name].index_information().values():
            found.setdefault(name, []).append([(f, int(d)) for f, d in info["key"]])
    client.drop_database(db.name)  # type: ignore[attr-defined]
    return found


def _record_contract_suite(tmp_path: Path) -> list[dict[str, Any]]:
    """Run the store contract suites on the real MongoDB with every query recorded (the
    subprocess starts its own ``mongod``, or uses PIKKU_TEST_MONGO_URL's server)."""
    log = tmp_path / "queries.jsonl"
    suites = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "contract").glob(
        "test_store*.py"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *suites, "-q", "-k", "mongod and not memory", "-p",
         "tests.support.query_recorder", "-p", "no:cacheprovider", "-x"],
        cwd=ROOT, env={**os.environ, "PIKKU_QUERY_LOG": str(log)}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _record_listings(server: Any) -> list[dict[str, Any]]:
    """Every shape of ``list_runs``: each filter, with and without a page cursor."""
    records: list[dict[str, Any]] = []
    db, client = mongo_database("mongod", server)
    store = MongoWorkflowStore(db)
    record_store(store, records.append)
    for i in range(3):
        store.create_run(NewRun(f"l-{i}", "order", None), T0 + i)
    last = store.list_runs(limit=2)[-1]
    for workflow in (None, "order"):
        for status in (None, "running"):
            store.list_runs(workflow=workflow, status=status)
            store.list_runs(workflow=workflow, status=status, created_before_ms=T0 + 1)
            store.list_runs(workflow=workflow, status=status, before_run_id=last.run_id,
                            created_before_ms=round(last.created_at.timestamp() * 1000))
    client.drop_database(db.name)  # type: ignore[attr-defined]
    return records


def test_every_store_query_is_served_by_a_declared_index(tmp_path: Path,
                                                        mongo_server: Any) -> None:
    records = _record_contract_suite(tmp_path) + _record_listings(mongo_server)
    indexes = declared_indexes(mongo_server)
    issued_by = {r["method"] for r in records}
    public = {name for name in vars(MongoWorkflowStore)
              if not name.startswith("_") and name not in ("from_url", "create_indexes")}
    assert "?" not in issued_by
    # Every public method that queries was exercised (insert-only ones issue no filter:
    # record_version, insert_replayed_steps).
    assert public - issued_by <= {"record_version", "describe", "ping", "check_indexes",
                                  "insert_replayed_steps"}, (
        public - issued_by)
    problems = sorted({p for record in records for p in unserved(record, indexes)})
    assert problems == [], "\n".join(problems)


def test_the_index_check_is_not_vacuous(mongo_server: Any) -> None:
    listing = {"collection": "workflow_runs", "op": "find", "method": "list_runs",
               "filter": {"workflow": "order", "status": {"$in": ["running", "failed"]}},
               "sort": [["created_ms", -1], ["run_id", -1]]}
    before = {"workflow_runs": [[("status", 1), ("updated_ms", 1)],  # the indexes of issue 8
                                [("workflow", 1), ("created_ms", -1)], [("created_ms", -1)]]}
    assert unserved(listing, before)
    assert not unserved(listing, declared_indexes(mongo_server))
    scan = {"collection": "workflow_steps", "op": "find", "method": "x",
            "filter": {"worker": "w"}, "sort": None}
    assert unserved(scan, declared_indexes(mongo_server))


# --- 21: what the distribution ships --------------------------------------------------------


def test_the_distribution_requires_celery_with_its_redis_extra_and_ships_py_typed() -> None:
    # kombu's Redis transport imports what only celery[redis] installs: a plain celery
    # dependency leaves a Redis-broker worker dying with ModuleNotFoundError at start-up.
    requirements = [Requirement(r) for r in metadata.requires("pikku-celery") or []]
    celery = [r for r in requirements if r.name == "celery" and r.marker is None]
    assert len(celery) == 1 and "redis" in celery[0].extras, celery
    assert resources.files("pikku_celery").joinpath("py.typed").is_file()
    project = (ROOT / "pyproject.toml").read_text()
    section = project.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert 'pikku_celery = ["py.typed"]' in section  # shipped in sdists and wheels


# --- 20: an unreachable service, named once ---------------------------------------------------


def _closed_port() -> int:
    port = free_port()  # bound then released: nothing listens there
    return port


def test_the_store_waits_five_seconds_for_a_server_by_default_and_the_setting_wins() -> None:
    def timeout_s(store: MongoWorkflowStore) -> float:
        return float(store.db.client.options.server_selection_timeout)

    url = "mongodb://127.0.0.1:27017/app"
    assert timeout_s(MongoWorkflowStore.from_url(url)) == 5.0  # pymongo's own is 30 s
    assert timeout_s(MongoWorkflowStore.from_url(url, server_selection_timeout="2s")) == 2.0
    assert timeout_s(MongoWorkflowStore.from_url(url + "?serverSelectionTimeoutMS=700")) == 0.7
    assert timeout_s(MongoWorkflowStore.from_url(url, serverSelectionTimeoutMS=900)) == 0.9
    with pytest.raises(ValueError, match="server_selection_timeout"):
        MongoWorkflowStore.from_url(url, server_selection_timeout="soon")


def test_start_with_mongodb_unreachable_names_the_server_without_its_password() -> None:
    port = _closed_port()
    store = MongoWorkflowStore.from_url(f"mongodb://app:s3cret@127.0.0.1:{port}/shop",
                                        server_selection_timeout="200ms")
    assert store.describe() == f"MongoDB at mongodb://127.0.0.1:{port}/shop"
    pikku = PikkuCelery(Celery("unreachable", broker="memory://"), store=store,
                        leases=InMemoryLeaseService(), worker_reaper=False)
    pikku.workflow("noop")(lambda wf, data: data)
    with pytest.raises(MongoUnreachableError) as unreachable:
        pikku.start("noop", {})
    message = str(unreachable.value)
    assert message.startswith(f"MongoDB at mongodb://127.0.0.1:{port}/shop is unreachable: "
                              "no server answered within 0.2 s (server_selection_timeout)")
    assert "s3cret" not in message and "Topology Description" not in message
    # Still pymongo's error, not a PikkuError: a pass that meets an outage is retried, the
    # workflow is not failed for it.
    assert isinstance(unreachable.value, ServerSelectionTimeoutError)
    assert not isinstance(unreachable.value, PikkuError)
    with pytest.raises(MongoUnreachableError, match="is unreachable"):
        store.ping()
    with pytest.raises(MongoUnreachableError, match="is unreachable"):
        pikku.list_runs()


def test_redis_is_named_without_its_password() -> None:
    port = _closed_port()
    leases = RedisLeaseService.from_url(f"redis://:s3cret@127.0.0.1:{port}/3")
    assert leases.describe() == f"Redis at redis://127.0.0.1:{port}/3"
    with pytest.raises(ConnectionError) as unreachable:
        leases.ping()
    assert str(unreachable.value).startswith(
        f"Redis at redis://127.0.0.1:{port}/3 is unreachable: ")
    assert "s3cret" not in str(unreachable.value)


def test_an_outage_is_one_line_when_it_starts_and_one_when_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: dict[str, str | None] = {"MongoDB at mongodb://db:27017/app": None}
    outages = OutageLog(lambda: dict(answers), interval_s=0.5)
    caplog.set_level(logging.DEBUG, logger="pikku_celery")
    outages.at_start()
    answers["MongoDB at mongodb://db:27017/app"] = "MongoDB at mongodb://db:27017/app is " \
        "unreachable: refused."
    for _ in range(5):
        outages.failed(RuntimeError("sweep met the outage"))
    outages.succeeded()  # a sweep that stood aside: the probe says still down
    answers["MongoDB at mongodb://db:27017/app"] = None
    outages.succeeded()
    for _ in range(3):
        outages.failed(KeyError("a bug in the sweep"))
    outages.succeeded()
    outages.failed(KeyError("a bug in the sweep"))
    loud = [(r.levelname, r.getMessage().split(";")[0], r.exc_info is not None)
            for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == [
        ("INFO", "pikku: MongoDB at mongodb://db:27017/app answers", False),
        ("ERROR", "pikku: MongoDB at mongodb://db:27017/app is unreachable: refused. Runs "
                  "cannot start or advance until it answers", False),
        ("WARNING", "pikku: MongoDB at mongodb://db:27017/app answers again", False),
        ("ERROR", "pikku reaper sweep failed (logged again only if the error changes)", True),
        ("ERROR", "pikku reaper sweep failed (logged again only if the error changes)", True),
    ]
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(quiet) == 5 + 2  # every failed sweep still leaves a DEBUG line


def test_an_outage_line_names_the_setting_that_points_there() -> None:
    """Issue 36: the line says what to check: the setting, as the user spells it (Django's
    namespace too), or the argument given to ``PikkuCelery``."""
    from pikku_celery.worker.tasks import WorkerReaper

    port = free_port()

    class Settings:
        CELERY_PIKKU_MONGO_URL = f"mongodb://127.0.0.1:{port}/shop"
        CELERY_PIKKU_SERVER_SELECTION_TIMEOUT = "200ms"

    app = Celery("named-setting", broker="memory://", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    pikku = PikkuCelery(app, leases=InMemoryLeaseService(), worker_reaper=False)
    found = WorkerReaper(lambda: pikku.engine, 30.0)._probe(1.0)
    why = found[f"MongoDB at mongodb://127.0.0.1:{port}/shop"]
    assert why is not None and why.endswith("(check the CELERY_PIKKU_MONGO_URL setting)"), why

    plain = Celery("named-setting-plain", broker="memory://", set_as_current=False)
    plain.conf.pikku_mongo_url = f"mongodb://127.0.0.1:{port}/shop"
    plain.conf.pikku_server_selection_timeout = "200ms"
    pikku = PikkuCelery(plain, leases=InMemoryLeaseService(), worker_reaper=False)
    found = WorkerReaper(lambda: pikku.engine, 30.0)._probe(1.0)
    assert str(found[f"MongoDB at mongodb://127.0.0.1:{port}/shop"]).endswith(
        "(check the pikku_mongo_url setting)"), found

    given = PikkuCelery(Celery("named-argument", broker="memory://", set_as_current=False),
                        store=MongoWorkflowStore.from_url(f"mongodb://127.0.0.1:{port}/shop",
                                                          server_selection_timeout="200ms"),
                        leases=InMemoryLeaseService(), worker_reaper=False)
    found = WorkerReaper(lambda: given.engine, 30.0)._probe(1.0)
    assert str(found[f"MongoDB at mongodb://127.0.0.1:{port}/shop"]).endswith(
        "(check the store given to PikkuCelery(store=...))"), found
