"""Indexes on a real ``mongod`` (issue 20, item 8): ``pikku check`` passes after the first
start and after ``--create-indexes``, and every query the store makes is served by an index.

The second is proven by the server itself: the store's operations run on a database holding
a few hundred runs and steps in every status, every find, update, delete, count and
aggregate ``$match`` they send is recorded (``tests.support.query_recorder``), and each is
``explain``ed on the real server: the winning plan may not scan the collection
(``COLLSCAN``) nor sort in memory (a ``SORT`` stage; ``SORT_MERGE`` of sorted index scans
is fine). The emulator-era check in ``tests/unit/test_hardening_infra.py`` reasoned about
index shapes instead; this one asks MongoDB's planner.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from celery import Celery
from pymongo.database import Database

from pikku_celery import (
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
    WorkflowEventLimitError,
    WorkflowStepSupersededError,
)
from pikku_celery.operate._checks import run_checks
from pikku_celery.store._claim_hint import hint_of
from pikku_celery.store._docs import new_step_doc
from pikku_celery.store._schedules import NewSchedule
from pikku_celery.store.base import NewRun, NewStep, due_sweep_key
from pikku_celery.store.mongo import INDEXES
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget
from tests.support.query_recorder import record_store

Doc = dict[str, Any]
T0 = 1_800_000_000_000
LEASE = 60_000
RUNS = 120  # enough documents that the planner's choice is the one a deployment gets


@pytest.fixture
def database(mongo_server: MongoTarget) -> Iterator[tuple[str, Database[Doc]]]:
    name = f"pikku_idx_{uuid.uuid4().hex[:10]}"
    client: pymongo.MongoClient[Doc] = pymongo.MongoClient(mongo_server.url,
                                                            serverSelectionTimeoutMS=5000)
    try:
        yield mongo_server.url_for(name), client[name]
    finally:
        client.drop_database(name)
        client.close()


# --- pikku check ---------------------------------------------------------------------------


def _app(url: str) -> PikkuCelery:
    celery = Celery(f"idx-{uuid.uuid4().hex[:8]}", broker="memory://")
    celery.conf.update(pikku_mongo_url=url, pikku_redis_url=REDIS_URL)
    pikku = PikkuCelery(celery)

    @pikku.workflow("wf")
    def wf(ctx: Any, data: Any) -> Any:
        return data

    return pikku


def test_pikku_check_passes_after_the_first_start_and_after_create_indexes(
        database: tuple[str, Database[Doc]]) -> None:
    url, db = database
    pikku = _app(url)
    # A database nothing has touched: check names every missing index, and fails.
    fresh = run_checks(pikku)
    assert len(fresh.problems) == sum(len(i) for i in INDEXES.values()), fresh.problems
    # The first start creates them: check passes.
    pikku.start("wf", {"x": 1}, run_id="first")
    assert run_checks(pikku).problems == []
    # An index dropped by hand is named; --create-indexes restores it, and check passes.
    db["workflow_steps"].drop_index([(f, d) for f, d in INDEXES["workflow_steps"][-1]])
    assert len(run_checks(pikku).problems) == 1
    repaired = run_checks(pikku, create_indexes=True)
    assert repaired.problems == [], repaired.problems
    assert run_checks(pikku).problems == []


def test_create_indexes_alone_makes_pikku_check_pass(
        database: tuple[str, Database[Doc]]) -> None:
    url, _ = database
    report = run_checks(_app(url), create_indexes=True)
    assert report.problems == [], report.problems


# --- every query served by an index --------------------------------------------------------


def _populate(store: MongoWorkflowStore) -> None:
    """Runs of three workflows in every status, with steps pending, scheduled, running
    (live and lapsed), succeeded, failed with a retry due and failed for good, parked on a
    child, and gates with and without wake checks."""
    for i in range(RUNS):
        run_id = f"run-{i:04d}"
        now = T0 + i * 10
        store.create_run(NewRun(run_id, f"wf-{i % 3}", {"i": i}), now)
        store.insert_steps([
            NewStep(run_id=run_id, step_name="a", function="f", max_attempts=3),
            NewStep(run_id=run_id, step_name="b", function="f", max_attempts=1),
            NewStep(run_id=run_id, step_name="nap", function=None, status="scheduled",
                    due_ms=now + (i % 5) * 1000),
            NewStep(run_id=run_id, step_name="gate", function=None, status="scheduled",
                    due_ms=None if i % 2 else now + 50_000),
        ], now, seq=i)
        kind = i % 6
        store.claim_step(run_id, "a", "f", now, LEASE, worker="w")
        if kind == 0:
            store.set_result(run_id, "a", 1, {"ok": i}, now + 1)
            store.transition_run(run_id, ["running"], "completed", now + 2)
        elif kind == 1:
            store.set_error(run_id, "a", 1, {"type": "E", "message": "m"}, now + 1,
                            retry_at_ms=now + 5000)
        elif kind == 2:
            store.claim_step(run_id, "b", "f", now, LEASE, worker="w")
            store.set_error(run_id, "b", 1, {"type": "E", "message": "m"}, now + 1)
            store.transition_run(run_id, ["running"], "failed", now + 2)
        elif kind == 3:
            store.settle_waiting_step(run_id, "gate", now + 3, result={"ok": True},
                                      gate=True, by="me", wake_check_ms=now + 60_000)
        elif kind == 4:
            store.transition_run(run_id, ["running"], "suspended", now + 2)
        # kind 5: "a" keeps running; its lease lapses for the sweeps' "now" below


def _exercise(store: MongoWorkflowStore) -> None:
    """Every public store method, in the shapes the engine, reaper, web API and CLI use."""
    late = T0 + RUNS * 10 + 2 * LEASE
    one, two = "run-0005", "run-0011"
    store.create_run(NewRun(one, "wf-2", {"i": 5}), late)  # taken: the duplicate path
    store.get_run(one)
    store.transition_run(two, ["suspended"], "running", late)
    store.write_run_state(one, "writer", {"k": 1}, 0, late)
    store.touch_run(one, late)
    store.list_forks(one)  # a run's forks (its page and JSON)
    for workflow in (None, "wf-1"):
        for status in (None, "running"):
            page = store.list_runs(workflow=workflow, status=status, limit=5)
            store.list_runs(workflow=workflow, status=status, limit=5,
                            created_before_ms=T0 + 500)
            if page:
                last = page[-1]
                store.list_runs(workflow=workflow, status=status, limit=5,
                                before_run_id=last.run_id,
                                created_before_ms=round(last.created_at.timestamp() * 1000))
    store.insert_step(NewStep(run_id=one, step_name="a", function="f"), late)  # taken
    store.insert_step(NewStep(run_id=one, step_name="extra", function="f"), late)
    store.insert_steps([NewStep(run_id=two, step_name="a", function="f"),
                        NewStep(run_id=two, step_name="more", function="f")], late, seq=999)
    for options in ({}, {"input": False}, {"all_steps": True}, {"step_names": ["a", "b"]},
                    {"recorded_after": 3}, {"step_names": ["a"], "recorded_after": 3},
                    {"run": False, "step_names": ["a"]}, {"run": False, "all_steps": True}):
        store.read_run(one, **options)
    store.get_step(one, "a")
    store.list_steps(one)
    store.claim_step("run-0001", "a", "f", late, LEASE)  # a failed step's retry, due
    # A step a pass runs in place: inserted claimed, then its run read.
    store.claim_new_step(NewStep(run_id="run-0001", step_name="c", function="f"), late,
                         LEASE, seq=99, worker="w")
    # A retry of a failed run (run-0002 failed; see _populate): its failed steps reopened.
    store.retry_run("run-0002", late)
    store.resume_retry("run-0002", late)  # a retry cut short: finished by calling again
    # A retry of a limited run: queued first, then admitted (its steps reopened then).
    store.transition_run("run-0002", ["running"], "failed", late)
    store.retry_run("run-0002", late, queued=True)
    store.admit_run("run-0002", late)
    # Its settle and the next step's claim, one command.
    store.settle_and_claim_new("run-0001", "c", 1, {"ok": 1}, late + 1,
                               NewStep(run_id="run-0001", step_name="d", function="f"), LEASE,
                               seq=99, worker="w")
    # A delivered step's settle with the next steps' insert (one existing: then read), and
    # the next step's claim from its message.
    inserted = store.settle_and_insert_steps(
        "run-0001", "d", 1, {"ok": 2}, late + 2,
        [NewStep(run_id="run-0001", step_name="c", function="f"),
         NewStep(run_id="run-0001", step_name="e", function="f")], seq=100)
    assert [created for _, created in inserted] == [False, True]
    hint = hint_of(new_step_doc(NewStep(run_id="run-0001", step_name="e", function="f"),
                                late + 2, 100))
    assert store.claim_step("run-0001", "e", "f", late + 3, LEASE, expected=hint).state
    store.claim_step(one, "a", "f", late, LEASE)  # a lapsed lease: reclaim
    store.record_progress(one, "a", 2, {"done": 1}, late)  # the reclaimed attempt's note
    with pytest.raises(WorkflowStepSupersededError):  # attempt 1's: refused, then read
        store.record_progress(one, "a", 1, {"done": 1}, late)
    store.claim_step("run-0002", "b", "f", late, LEASE)  # settled for good: nothing
    store.claim_step("run-0017", "a", "f", T0 + 1, LEASE)  # a live lease: nothing
    store.set_result(one, "a", 2, "done", late)
    store.claim_step("run-0023", "a", "f", late, LEASE)
    store.set_error("run-0023", "a", 2, {"type": "E", "message": "m"}, late,
                    retry_at_ms=late + 10)
    store.claim_step("run-0029", "a", "f", late, LEASE)
    store.set_error("run-0029", "a", 2, {"type": "E", "message": "m"}, late, final=True)
    store.renew_leases([("run-0035", "a", 1), ("run-0041", "a", 1), ("run-0047", "a", 2)],
                       late, LEASE)
    store.release_lease("run-0035", "a", 1)
    store.settle_waiting_step("run-0007", "nap", late, result=None)
    store.settle_waiting_step("run-0013", "gate", late, result={"ok": 1}, gate=True, by="x")
    store.clear_wake_check("run-0003", "gate", T0 + 30 + 60_000)
    store.cancel_steps("run-0053", {"type": "Cancelled", "message": "c"}, late)
    store.cancel_steps("run-0053", {"type": "Cancelled", "message": "c"}, late,
                       while_ended=True)
    # Events: sends (with a key, and its retry), a wait's next event, a run's events, the
    # wake sweep and its end.
    sent, _ = store.send_event(one, "paid", {"n": 1}, late, wake_check_ms=late)
    store.send_event(one, "paid", 2, late, key="k")
    store.send_event(one, "paid", 2, late, key="k")
    store.next_event(one, "paid")
    store.next_event(one, "paid", [sent.seq])
    store.list_events(one)
    store.list_events(one, 10, after=1, payloads=False)  # a page, as the web reads them
    with pytest.raises(WorkflowEventLimitError):  # at the run's limit: refused
        store.send_event(one, "paid", 3, late, max_events=2)
    store.find_event_wakes(late, 10)
    store.clear_event_wake(sent.event_id)
    # Concurrency slots: a limited run created queued, its group's take, give and reads.
    store.create_run(NewRun("run-queued", "wf-1", None, slot="grp"), late)
    store.next_queued("grp")
    store.queued_slots()
    store.take_slot("grp", "run-queued", 2, workflow="wf-1")
    store.take_slot("grp", "run-queued", 2)  # held: the upsert's duplicate path
    store.slot_holders("grp")
    store.list_slots()
    store.give_slot("grp", "run-queued")
    store.slot_group("grp")
    queued = store.get_run("run-queued")
    assert queued is not None
    store.queued_ahead("grp", queued)
    store.get_history(one)
    # Schedules: saved (new, the same, a changed timing), read, listed (all, by name),
    # moved past a tick (and the loser of that race), paused and resumed.
    every = NewSchedule(name="every-1m", workflow="wf-0", cron=None, every_ms=60_000,
                        tz="UTC", data={"n": 1}, catch_up="latest")
    store.save_schedule(every, late + 60_000, late)
    store.save_schedule(every, late + 60_000, late)
    store.save_schedule(dataclasses.replace(every, every_ms=None, cron="*/5 * * * *"),
                        late + 300_000, late)
    store.get_schedule("every-1m")
    store.list_schedules()
    store.list_schedules(["every-1m", "other"])
    store.advance_schedule("every-1m", late + 300_000, late + 600_000, late,
                           fired_ms=late + 300_000)
    store.advance_schedule("every-1m", late + 300_000, late + 600_000, late)
    store.schedules_firing(["every-1m", "other"])  # the tick being started, read and cleared
    store.started_tick("every-1m", late + 300_000, late)
    store.pause_schedule("every-1m", late)
    store.resume_schedule("every-1m", late + 600_000, late)
    transaction = store.step_transaction("a")  # a transactional step's try: opened, dropped
    transaction.abort()
    transaction.close()
    store.record_version("wf-0", "v1", "src", late)
    store.get_version("wf-0", "v1")
    for after in (None, (T0 + 50 + LEASE, "z")):
        store.find_lapsed_steps(late, 10, after=after)
    for after in (None, (T0 + 50, "z")):
        store.find_due_steps(late, late - 30_000, 10, after=after)
    stalled = store.find_stalled_runs(late, 20)
    store.touch_runs([r.run_id for r in stalled], late)
    store.find_unsettled_steps([r.run_id for r in stalled])
    store.count_runs(status="running")
    store.count_runs(status="running", workflow="wf-1")
    store.count_runs(status="completed", updated_before_ms=late)
    store.purge_runs(T0 + 200, limit=5)


def _stages(plan: Any) -> list[str]:
    """Every stage of an explain plan tree (classic or slot-based engine)."""
    found: list[str] = []
    if isinstance(plan, dict):
        if "stage" in plan:
            found.append(str(plan["stage"]))
        for key in ("inputStage", "queryPlan", "winningPlan"):
            found += _stages(plan.get(key))
        for child in plan.get("inputStages", []):
            found += _stages(child)
    return found


def _plan(db: Database[Doc], record: Doc) -> list[str]:
    find: Doc = {"find": record["collection"], "filter": record["filter"]}
    if record.get("sort"):
        find["sort"] = {field: direction for field, direction in record["sort"]}
    explained = db.command("explain", find, verbosity="queryPlanner")
    return _stages(explained["queryPlanner"]["winningPlan"])


def test_every_query_the_store_makes_is_served_by_an_index(
        database: tuple[str, Database[Doc]]) -> None:
    url, db = database
    store = MongoWorkflowStore.from_url(url)
    try:
        _populate(store)
        records: list[Doc] = []
        record_store(store, records.append)
        _exercise(store)
        issued_by = {r["method"] for r in records}
        public = {name for name in vars(MongoWorkflowStore) if not name.startswith("_")}
        # Every public method that selects documents was exercised.
        assert public - issued_by <= {"from_url", "create_indexes", "check_indexes",
                                      "record_version", "describe", "ping",
                                      "insert_replayed_steps"}, (
            public - issued_by)
        problems: dict[str, Doc] = {}
        for record in records:
            assert record["op"] != "aggregate", f"an unrecorded pipeline stage: {record}"
            stages = _plan(db, record)
            bad = sorted({"COLLSCAN", "SORT"} & set(stages))
            if bad:
                shape = json.dumps({k: record[k] for k in ("method", "collection", "sort")})
                problems.setdefault(shape, {"bad": bad, "stages": stages,
                                            "filter": record["filter"]})
        assert problems == {}, "\n".join(f"{shape}: {why}" for shape, why in problems.items())
    finally:
        store.db.client.close()


# --- the sweeps' pages, in the order their indexes read -------------------------------------


@pytest.fixture(params=["memory", "mongod"])
def any_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        yield InMemoryWorkflowStore()
        return
    _, db = request.getfixturevalue("database")
    yield MongoWorkflowStore(db)


def test_the_due_sweep_pages_through_its_backlog_once_in_its_key_order(any_store: Any
                                                                       ) -> None:
    """Pending steps nobody picked up (by dispatch time) and due sleeps and retries (by due
    time) come in one order, ``due_sweep_key``; paging with the last step's key visits each
    once, whatever the page size."""
    store = any_store
    store.create_run(NewRun("run", "wf", None), T0)
    for i in range(6):  # pending since T0 + i, due at T0 + 10 + i: interleaved keys
        store.insert_steps([NewStep(run_id="run", step_name=f"p{i}", function="f")], T0 + i)
        store.insert_steps([NewStep(run_id="run", step_name=f"d{i}", function=None,
                                    status="scheduled", due_ms=T0 + 3 + i)], T0)
    everything = store.find_due_steps(T0 + 100, T0 + 100, 100)
    keys = [due_sweep_key(s) for s in everything]
    assert keys == sorted(keys) and len(keys) == 12
    for size in (1, 2, 5):
        seen: list[str] = []
        after = None
        while True:
            page = store.find_due_steps(T0 + 100, T0 + 100, size, after=after)
            seen += [s.step_name for s in page]
            if len(page) < size:
                break
            after = due_sweep_key(page[-1])
        assert seen == [s.step_name for s in everything], size


def test_the_lapsed_sweep_pages_through_steps_of_one_deadline(any_store: Any) -> None:
    """Many leases renewed by one write share a deadline: the page's tie-break (the
    invocation id, the index's last key) keeps each once."""
    store = any_store
    store.create_run(NewRun("run", "wf", None), T0)
    names = [f"s{i}" for i in range(7)]
    store.insert_steps([NewStep(run_id="run", step_name=n, function="f") for n in names], T0)
    for name in names:
        store.claim_step("run", name, "f", T0, LEASE)
    store.renew_leases([("run", n, 1) for n in names], T0 + 1, LEASE)
    seen: list[str] = []
    after = None
    while True:
        page = store.find_lapsed_steps(T0 + 2 * LEASE, 3, after=after)
        seen += [s.step_name for s in page]
        if len(page) < 3:
            break
        last = page[-1]
        assert last.lease_expires_at is not None
        after = (round(last.lease_expires_at.timestamp() * 1000), last.invocation_id)
    assert sorted(seen) == names and len(seen) == len(names)


def test_the_stalled_run_sweep_reads_only_the_unsettled_steps_of_its_runs(
        database: tuple[str, Database[Doc]]) -> None:
    """A stalled run that already settled most of its steps (a long ``for_each`` waiting on
    its last one), among other runs' live steps: the sweep's step read examines the
    unsettled steps of its runs, neither every step of the run nor every live step of the
    others (the server's own count, ``totalDocsExamined``)."""
    _, db = database
    store = MongoWorkflowStore(db)
    for i in range(40):
        store.create_run(NewRun(f"other-{i}", "wf", None), T0)
        store.insert_steps([NewStep(run_id=f"other-{i}", step_name=n, function="f")
                            for n in ("a", "b")], T0)
        store.claim_step(f"other-{i}", "a", "f", T0, LEASE)
    store.create_run(NewRun("big", "wf", None), T0)
    names = [f"s{i:03d}" for i in range(60)]
    store.insert_steps([NewStep(run_id="big", step_name=n, function="f", max_attempts=2)
                        for n in names], T0)
    for name in names[:-2]:
        store.claim_step("big", name, "f", T0, LEASE)
        store.set_result("big", name, 1, None, T0 + 1)
    store.claim_step("big", names[-2], "f", T0, LEASE)
    store.set_error("big", names[-2], 1, {"type": "E", "message": "m"}, T0 + 1,
                    retry_at_ms=T0 + 100)  # failed, its retry due
    records: list[Doc] = []
    record_store(store, records.append)
    unsettled = store.find_unsettled_steps(["big"])
    assert sorted(s.step_name for s in unsettled) == names[-2:]
    (record,) = records
    explained = db.command("explain", {"find": record["collection"],
                                       "filter": record["filter"]},
                           verbosity="executionStats")
    examined = explained["executionStats"]["totalDocsExamined"]
    # The failed branch fetches its steps to check their due time, and the plan fetches
    # what it returns: at most twice the steps returned (60, every step, without the index).
    assert examined <= 2 * len(unsettled), (f"{examined} steps examined for 2 unsettled ones: "
                           f"{explained['queryPlanner']['winningPlan']}")
