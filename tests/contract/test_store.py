"""One store contract suite, run on every store: in-memory, and a real MongoDB (id ``mongod``:
the session's ``mongod`` replica set, or ``PIKKU_TEST_MONGO_URL``'s server). Numbers in test
names refer to the upstream scenarios of section 7 of ``shared/reference/upstream-semantics.md``.

Time is passed explicitly (``now_ms``), as the engine passes the lease service's clock, so
lapses are exact and the suite never sleeps.
"""

from __future__ import annotations

import random
import re
import threading
import uuid
from collections.abc import Iterator

import pytest

from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowRunConflictError,
    WorkflowStepFunctionMismatchError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.store.base import NewRun, NewStep, WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.conftest import mongo_database, pooled_database
from tests.support.raw import drop_entries, drop_run_state_fields, raw_history
from tests.support.threads import race

KINDS = ["memory", "mongod"]
T0 = 1_700_000_000_000
LEASE = 60_000
FN = "charge:card"


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


@pytest.fixture(params=KINDS)
def atomic_store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    """Stores whose writes are atomic across threads (every store here is: races never run
    on mongomock, whose writes are not, test-infrastructure.md)."""
    yield from _make_store(request)


def _make_store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    if request.param == "memory":
        yield InMemoryWorkflowStore()
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield MongoWorkflowStore(db)


def new_run(store: WorkflowStore, **kw: object) -> str:
    run_id = str(uuid.uuid4())
    store.create_run(NewRun(run_id=run_id, workflow="order", input={"n": 1}), T0)
    return run_id


def add_step(store: WorkflowStore, run_id: str, name: str = "charge", *, retries: int = 5,
             **kw: object) -> None:
    store.insert_step(NewStep(run_id=run_id, step_name=name, function=kw.pop("function", FN),
                              max_attempts=retries + 1, **kw), T0)  # type: ignore[arg-type]


def supersede(store: WorkflowStore, run_id: str, name: str = "charge") -> tuple[int, int]:
    """Claim, let the lease lapse, claim again: returns (stale attempt, current attempt)."""
    first = store.claim_step(run_id, name, FN, T0, LEASE).state
    second = store.claim_step(run_id, name, FN, T0 + LEASE + 1, LEASE).state
    assert first is not None and second is not None
    return first.attempt, second.attempt


# --- runs ------------------------------------------------------------------------------


def test_create_run_is_idempotent_by_id(store: WorkflowStore) -> None:
    run = NewRun(run_id="r-1", workflow="order", input={"a": 1})
    first, created = store.create_run(run, T0)
    again, created_again = store.create_run(NewRun("r-1", "order", {"a": 2}), T0 + 5)
    assert created and not created_again
    assert again.input == {"a": 1} and again.created_at == first.created_at


def test_create_run_refuses_the_same_id_for_another_workflow(store: WorkflowStore) -> None:
    store.create_run(NewRun("r-2", "order", None), T0)
    with pytest.raises(WorkflowRunConflictError, match="already belongs to workflow 'order'"):
        store.create_run(NewRun("r-2", "refund", None), T0)
    run = store.get_run("r-2")
    assert run is not None and run.workflow == "order"


def test_transition_run_is_guarded_and_keeps_output(store: WorkflowStore) -> None:
    run_id = new_run(store)
    assert store.transition_run(run_id, ["running"], "completed", T0 + 1, output={"ok": 0})
    assert not store.transition_run(run_id, ["running"], "failed", T0 + 2,
                                    error={"message": "late"})
    run = store.get_run(run_id)
    assert run is not None and run.status == "completed" and run.output == {"ok": 0}
    assert run.error is None


# --- run state ------------------------------------------------------------------------


def test_run_state_writes_are_versioned_and_guarded_on_the_version(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    fresh = store.get_run(run_id)
    assert fresh is not None and (fresh.state, fresh.state_version) == ({}, 0)
    first = store.write_run_state(run_id, "a", {"count": 1, "tag": "x"}, 0, T0 + 1)
    assert first is not None and first.state == {"count": 1, "tag": "x"}
    second = store.write_run_state(run_id, "b#2", {"count": 2}, 1, T0 + 2)
    assert second is not None and second.state == {"count": 2, "tag": "x"}
    # A write at a version the state has moved past is refused and changes nothing.
    assert store.write_run_state(run_id, "c", {"count": 99}, 1, T0 + 3) is None
    assert store.write_run_state("no-such-run", "c", {"count": 99}, 0, T0 + 3) is None
    run = store.get_run(run_id)
    assert run is not None and run.state == {"count": 2, "tag": "x"}
    assert (run.state_version, run.state_writers) == (2, ("a", "b#2"))
    assert [r.state_version for r in store.list_runs() if r.run_id == run_id] == [2]


@pytest.mark.parametrize(("values", "says"), [
    ({"a.b": 1}, "run state key 'a.b'"),
    ({"$set": 1}, "run state key '$set'"),
    ({}, "non-empty mapping"),
    ({"big": "x" * 70_000}, "over the 65536-byte limit"),
    ({"bad": float("nan")}, "run state written by 'w'"),
])
def test_bad_run_state_writes_are_refused_and_change_nothing(
        store: WorkflowStore, values: dict[str, object], says: str) -> None:
    run_id = new_run(store)
    assert store.write_run_state(run_id, "w0", {"kept": True}, 0, T0) is not None
    with pytest.raises(InvalidInputError, match=re.escape(says)):
        store.write_run_state(run_id, "w", values, 1, T0 + 1)
    run = store.get_run(run_id)
    assert run is not None and (run.state, run.state_version) == ({"kept": True}, 1)


def test_a_run_stored_before_run_state_takes_its_first_write(store: WorkflowStore) -> None:
    run_id = new_run(store)
    drop_run_state_fields(store, run_id)
    run = store.get_run(run_id)
    assert run is not None and (run.state, run.state_version, run.state_writers) == ({}, 0, ())
    assert store.write_run_state(run_id, "w", {"n": 1}, 1, T0) is None
    written = store.write_run_state(run_id, "w", {"n": 1}, 0, T0)
    assert written is not None and (written.state, written.state_version) == ({"n": 1}, 1)


def test_concurrent_run_state_writes_at_one_version_have_one_winner(
        atomic_store: WorkflowStore) -> None:
    store = atomic_store
    run_id = new_run(store)
    won: list[int] = []

    def write(i: int) -> None:
        if store.write_run_state(run_id, f"w{i}", {"by": i}, 0, T0) is not None:
            won.append(i)

    race(write, 8)
    run = store.get_run(run_id)
    assert len(won) == 1 and run is not None
    assert (run.state, run.state_version, run.state_writers) == (
        {"by": won[0]}, 1, (f"w{won[0]}",))


def test_list_runs_newest_first_filtered_and_bounded(store: WorkflowStore) -> None:
    ids = []
    for i in range(5):
        run_id = f"run-{i}"
        store.create_run(NewRun(run_id, "order" if i % 2 == 0 else "refund", i), T0 + i)
        ids.append(run_id)
    store.transition_run("run-4", ["running"], "completed", T0 + 10)
    assert [r.run_id for r in store.list_runs(limit=3)] == ["run-4", "run-3", "run-2"]
    assert [r.run_id for r in store.list_runs(workflow="order")] == ["run-4", "run-2", "run-0"]
    assert [r.run_id for r in store.list_runs(status="completed")] == ["run-4"]
    page = store.list_runs(limit=2, created_before_ms=T0 + 3)
    assert [r.run_id for r in page] == ["run-2", "run-1"]


def test_unknown_run_reads_none(store: WorkflowStore) -> None:
    assert store.get_run("nope") is None
    assert store.list_steps("nope") == []
    assert store.get_history("nope") == []


# --- steps and the claim -----------------------------------------------------------------


def test_insert_step_is_idempotent_under_concurrent_insert(atomic_store: WorkflowStore) -> None:
    store = atomic_store
    run_id = new_run(store)
    created = []

    def insert() -> None:
        _, was_created = store.insert_step(
            NewStep(run_id=run_id, step_name="charge", function=FN, max_attempts=6), T0)
        created.append(was_created)

    threads = [threading.Thread(target=insert) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(created) == [False, False, False, True]
    assert [s.step_name for s in store.list_steps(run_id)] == ["charge"]


def test_invocation_id_is_stable_and_distinct_per_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "charge")
    add_step(store, run_id, "charge#2")
    one, two = store.list_steps(run_id)
    assert one.invocation_id != two.invocation_id
    supersede(store, run_id, "charge")
    again = store.get_step(run_id, "charge")
    assert again is not None and again.invocation_id == one.invocation_id and again.attempt == 2


def test_first_claim_grants_a_lease_and_keeps_attempt_1(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    state = store.claim_step(run_id, "charge", FN, T0, LEASE, worker="w1").state
    assert state is not None and state.status == "running" and state.attempt == 1
    assert state.lease_expires_at is not None
    assert int(state.lease_expires_at.timestamp() * 1000) == T0 + LEASE


def test_17_a_live_lease_refuses_a_second_claim(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    assert store.claim_step(run_id, "charge", FN, T0, LEASE).state is not None
    assert store.claim_step(run_id, "charge", FN, T0 + LEASE - 1, LEASE).state is None
    state = store.get_step(run_id, "charge")
    assert state is not None and state.attempt == 1


def test_18_a_lapsed_lease_is_reclaimed_as_attempt_2(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    assert (stale, current) == (1, 2)


def test_19_a_renewed_lease_is_not_reclaimed(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    assert store.renew_leases([(run_id, "charge", 1)], T0 + LEASE - 10, LEASE) == set()
    assert store.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE).state is None


def test_21_lapsed_leases_use_up_attempts_then_fail_with_lease_expired(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, retries=1)
    supersede(store, run_id)
    outcome = store.claim_step(run_id, "charge", FN, T0 + 3 * LEASE, LEASE)
    assert outcome.state is None and outcome.wake_run
    state = store.get_step(run_id, "charge")
    assert state is not None and state.status == "failed" and state.attempt == 2
    assert state.error is not None and state.error["type"] == "WorkflowStepLeaseExpiredError"
    # A redelivered message never buys a settled step another attempt.
    later = store.claim_step(run_id, "charge", FN, T0 + 9 * LEASE, LEASE)
    assert later.state is None and not later.wake_run


def test_24_concurrent_first_claims_have_one_winner(atomic_store: WorkflowStore) -> None:
    store = atomic_store
    run_id = new_run(store)
    add_step(store, run_id)
    assert _race(store, run_id, T0) == 1


def test_25_concurrent_reclaims_of_a_failed_step_advance_the_attempt_once(
        atomic_store: WorkflowStore) -> None:
    store = atomic_store
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 1)
    assert _race(store, run_id, T0 + 2) == 1
    state = store.get_step(run_id, "charge")
    assert state is not None and state.attempt == 2 and state.status == "running"


def _race(store: WorkflowStore, run_id: str, now_ms: int, n: int = 6) -> int:
    """Claims by ``n`` threads at once; a claimer that raised fails the test, it is not a
    loser."""
    wins: list[int] = []

    def claim(_: int) -> None:
        if store.claim_step(run_id, "charge", FN, now_ms, LEASE).state is not None:
            wins.append(1)

    race(claim, n)
    return len(wins)


def test_26_succeeded_and_claimed_steps_are_not_claimable(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    assert store.claim_step(run_id, "charge", FN, T0 + 1, LEASE).state is None
    store.set_result(run_id, "charge", 1, {"ok": True}, T0 + 2)
    assert store.claim_step(run_id, "charge", FN, T0 + 10 * LEASE, LEASE).state is None


def test_27_a_failed_attempt_is_reclaimed_as_attempt_2(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 1, retry_at_ms=T0 + 1000)
    assert store.claim_step(run_id, "charge", FN, T0 + 999, LEASE).state is None  # not due
    state = store.claim_step(run_id, "charge", FN, T0 + 1000, LEASE).state
    assert state is not None and state.attempt == 2 and state.status == "running"
    assert state.error is None


def test_a_failed_step_with_no_attempts_left_is_never_reclaimed(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, retries=0)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    failed = store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 1,
                             retry_at_ms=T0 + 2)
    assert failed.due_at is None and failed.attempts_left == 0
    assert store.claim_step(run_id, "charge", FN, T0 + 10 * LEASE, LEASE).state is None


def test_28_a_claim_naming_another_function_is_refused_before_any_write(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    before = store.get_step(run_id, "charge")
    with pytest.raises(WorkflowStepFunctionMismatchError, match="charge:card"):
        store.claim_step(run_id, "charge", "refund:all", T0, LEASE)
    assert store.get_step(run_id, "charge") == before


def test_claim_of_an_unknown_step_names_it(store: WorkflowStore) -> None:
    run_id = new_run(store)
    with pytest.raises(WorkflowStepNotFoundError, match="ghost"):
        store.claim_step(run_id, "ghost", FN, T0, LEASE)


def test_a_scheduled_step_is_claimable_once_due_and_only_once(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, status="scheduled", due_ms=T0 + 500)
    assert store.claim_step(run_id, "charge", FN, T0 + 499, LEASE).state is None
    assert store.claim_step(run_id, "charge", FN, T0 + 500, LEASE).state is not None
    assert store.claim_step(run_id, "charge", FN, T0 + 501, LEASE).state is None


def test_a_step_parked_on_a_child_is_never_reclaimed(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "child", function="workflow:refund", status="running",
             child_run_id="child-1")
    assert store.claim_step(run_id, "child", "workflow:refund", T0 + 10**9, LEASE).state is None
    assert store.find_lapsed_steps(T0 + 10**9, 10) == []
    assert not store.settle_waiting_step(run_id, "child", T0, result=1, child_run_id="other")
    assert store.settle_waiting_step(run_id, "child", T0, result={"ok": 1},
                                     child_run_id="child-1")
    state = store.get_step(run_id, "child")
    assert state is not None and state.status == "succeeded" and state.result == {"ok": 1}


def test_a_released_lease_parks_the_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    assert not store.release_lease(run_id, "charge", 2)
    assert store.release_lease(run_id, "charge", 1)
    assert store.claim_step(run_id, "charge", FN, T0 + 10 * LEASE, LEASE).state is None


# --- fencing (scenarios 1-7) ---------------------------------------------------------------


def test_1_a_superseded_result_is_refused_and_history_keeps_both(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    with pytest.raises(WorkflowStepSupersededError) as info:
        store.set_result(run_id, "charge", stale, {"stale": True}, T0 + LEASE + 2)
    assert info.value.attempt == 1 and info.value.current_attempt == 2
    store.set_result(run_id, "charge", current, {"fresh": True}, T0 + LEASE + 3)
    state = store.get_step(run_id, "charge")
    assert state is not None and state.result == {"fresh": True}
    history = store.get_history(run_id)
    assert [(h.attempt, h.status) for h in history] == [(1, "failed"), (2, "succeeded")]
    assert history[0].result is None
    assert history[0].error is not None
    assert history[0].error["type"] == "WorkflowStepLeaseExpiredError"


def test_2_a_superseded_error_is_refused(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    before = store.get_step(run_id, "charge")
    with pytest.raises(WorkflowStepSupersededError):
        store.set_error(run_id, "charge", stale, {"message": "stale"}, T0 + LEASE + 2)
    assert store.get_step(run_id, "charge") == before
    assert before is not None and before.status == "running" and before.attempt == current


def test_3_superseded_renewals_and_releases_return_false(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    before = store.get_step(run_id, "charge")
    assert store.renew_leases([(run_id, "charge", stale)], T0 + 5 * LEASE, LEASE) == {
        (run_id, "charge")}
    assert not store.release_lease(run_id, "charge", stale)
    assert store.get_step(run_id, "charge") == before
    assert store.renew_leases([(run_id, "charge", current)], T0 + 5 * LEASE, LEASE) == set()


def test_4_a_stale_write_cannot_touch_a_succeeded_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    store.set_result(run_id, "charge", current, "fresh", T0 + LEASE + 2)
    for write in (lambda: store.set_result(run_id, "charge", stale, "stale", T0 + LEASE + 3),
                  lambda: store.set_error(run_id, "charge", stale, {"m": 1}, T0 + LEASE + 3)):
        with pytest.raises(WorkflowStepSupersededError):
            write()
    state = store.get_step(run_id, "charge")
    assert state is not None and state.status == "succeeded" and state.result == "fresh"


def test_5_a_stale_result_cannot_touch_a_failed_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    stale, current = supersede(store, run_id)
    store.set_error(run_id, "charge", current, {"message": "fresh"}, T0 + LEASE + 2)
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", stale, "stale", T0 + LEASE + 3)
    state = store.get_step(run_id, "charge")
    assert state is not None and state.status == "failed" and state.error == {"message": "fresh"}


def test_6_concurrent_stale_and_current_writes(atomic_store: WorkflowStore) -> None:
    store = atomic_store
    rng = random.Random(6)
    for round_no in range(25):
        run_id = new_run(store)
        add_step(store, run_id)
        stale, current = supersede(store, run_id)
        outcomes: dict[str, object] = {}

        def write(attempt: int, who: str, as_error: bool, run_id: str = run_id,
                  outcomes: dict[str, object] = outcomes) -> None:
            try:
                if as_error:
                    store.set_error(run_id, "charge", attempt, {"who": who}, T0 + 5 * LEASE)
                else:
                    store.set_result(run_id, "charge", attempt, who, T0 + 5 * LEASE)
                outcomes[who] = "ok"
            except WorkflowStepSupersededError:
                outcomes[who] = "refused"

        pair = [threading.Thread(target=write, args=(stale, "stale", rng.random() < 0.5)),
                threading.Thread(target=write, args=(current, "current", rng.random() < 0.5))]
        rng.shuffle(pair)
        for t in pair:
            t.start()
        for t in pair:
            t.join()
        assert outcomes == {"stale": "refused", "current": "ok"}, round_no


def test_7_a_third_claim_fences_out_both_earlier_attempts(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    supersede(store, run_id)
    third = store.claim_step(run_id, "charge", FN, T0 + 3 * LEASE, LEASE).state
    assert third is not None and third.attempt == 3
    for stale in (1, 2):
        with pytest.raises(WorkflowStepSupersededError):
            store.set_result(run_id, "charge", stale, "x", T0 + 3 * LEASE + 1)
        with pytest.raises(WorkflowStepSupersededError):
            store.set_error(run_id, "charge", stale, {"m": 1}, T0 + 3 * LEASE + 1)
        assert store.renew_leases([(run_id, "charge", stale)], T0 + 3 * LEASE + 1, LEASE)
    store.set_result(run_id, "charge", 3, "third", T0 + 3 * LEASE + 2)
    assert [h.attempt for h in store.get_history(run_id)] == [1, 2, 3]


def test_a_double_settle_of_the_same_attempt_is_refused(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_result(run_id, "charge", 1, "first", T0 + 1)
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", 1, "second", T0 + 2)
    state = store.get_step(run_id, "charge")
    assert state is not None and state.result == "first"


# --- history (scenarios 22-23) -------------------------------------------------------------


def test_22_23_history_has_one_entry_per_attempt_with_times(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0 + 10, LEASE, worker="w1")
    store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 20)
    store.claim_step(run_id, "charge", FN, T0 + 30, LEASE, worker="w2")
    store.set_result(run_id, "charge", 2, {"ok": True}, T0 + 40)
    history = store.get_history(run_id)
    assert [(h.attempt, h.status) for h in history] == [(1, "failed"), (2, "succeeded")]
    assert history[0].error == {"message": "boom"} and history[0].result is None
    assert history[1].result == {"ok": True} and history[1].error is None
    assert history[0].worker == "w1" and history[1].worker == "w2"
    assert history[1].started_at is not None and history[1].ended_at is not None
    assert int(history[1].started_at.timestamp() * 1000) == T0 + 30
    state = store.get_step(run_id, "charge")
    assert state is not None and state.result == {"ok": True} and state.error is None


def test_history_reports_the_current_attempt_from_the_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    assert store.get_history(run_id) == []  # never claimed: no attempt yet
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    assert [(h.attempt, h.status) for h in store.get_history(run_id)] == [(1, "running")]


# --- cancellation, versions, sweeps ------------------------------------------------------


def test_cancel_steps_fences_in_flight_attempts(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "a")
    add_step(store, run_id, "b")
    store.claim_step(run_id, "a", FN, T0, LEASE)
    assert store.cancel_steps(run_id, {"type": "WorkflowCancelledError"}, T0 + 1) == 2
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "a", 1, "late", T0 + 2)
    assert store.renew_leases([(run_id, "a", 1)], T0 + 2, LEASE) == {(run_id, "a")}
    assert store.claim_step(run_id, "b", FN, T0 + 3, LEASE).state is None
    assert {s.status for s in store.list_steps(run_id)} == {"failed"}


def test_versions_first_writer_wins(store: WorkflowStore) -> None:
    assert store.record_version("order", "abc", "def order(): ...", T0)
    assert not store.record_version("order", "abc", "something else", T0 + 1)
    version = store.get_version("order", "abc")
    assert version is not None and version["source"] == "def order(): ..."
    assert store.get_version("order", "zzz") is None


def test_sweeps_find_lapsed_due_and_stalled(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "lapsed")
    add_step(store, run_id, "fresh")
    add_step(store, run_id, "sleep", function=None, status="scheduled", due_ms=T0 + 100)
    store.claim_step(run_id, "lapsed", FN, T0, 50)
    lapsed = store.find_lapsed_steps(T0 + 51, 10)
    assert [s.step_name for s in lapsed] == ["lapsed"]
    due = store.find_due_steps(T0 + 100, T0 + 1, 10)
    assert sorted(s.step_name for s in due) == ["fresh", "sleep"]
    assert store.find_due_steps(T0 + 99, T0, 10) == []
    assert [r.run_id for r in store.find_stalled_runs(T0 + 1, 10)] == [run_id]
    store.touch_run(run_id, T0 + 5)
    assert store.find_stalled_runs(T0 + 1, 10) == []
    assert len(store.find_due_steps(T0 + 100, T0 + 1, 1)) == 1  # bounded by limit


def test_the_stalled_sweep_touches_many_runs_and_reads_their_unsettled_steps_at_once(
        store: WorkflowStore) -> None:
    first, second, other = new_run(store), new_run(store), new_run(store)
    for run_id in (first, second, other):
        add_step(store, run_id, "pending")
    add_step(store, first, "done")
    store.claim_step(first, "done", FN, T0, LEASE)
    store.set_result(first, "done", 1, "ok", T0 + 1)
    add_step(store, first, "retrying", retries=1)
    store.claim_step(first, "retrying", FN, T0, LEASE)
    store.set_error(first, "retrying", 1, {"message": "again"}, T0 + 1, retry_at_ms=T0 + 500)
    add_step(store, second, "failed", retries=0)
    store.claim_step(second, "failed", FN, T0, LEASE)
    store.set_error(second, "failed", 1, {"message": "for good"}, T0 + 1)
    add_step(store, second, "nap", function=None, status="scheduled", due_ms=T0 + 100)
    found = {(s.run_id, s.step_name) for s in store.find_unsettled_steps([first, second])}
    assert found == {(first, "pending"), (first, "retrying"), (second, "pending"),
                     (second, "nap")}
    assert store.find_unsettled_steps([]) == []
    store.touch_runs([first, second, "no-such-run"], T0 + 50)
    assert [r.run_id for r in store.find_stalled_runs(T0 + 10, 10)] == [other]
    store.touch_runs([first], T0 + 20)  # never moves a run's last touch back
    assert sorted(r.run_id for r in store.find_stalled_runs(T0 + 49, 10)) == [other]
    store.touch_runs([], T0 + 60)


def test_a_due_sleep_settles_once(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "nap", function=None, status="scheduled", due_ms=T0 + 100)
    assert not store.settle_waiting_step(run_id, "nap", T0 + 99)
    assert store.settle_waiting_step(run_id, "nap", T0 + 100)
    assert not store.settle_waiting_step(run_id, "nap", T0 + 101)
    state = store.get_step(run_id, "nap")
    assert state is not None and state.status == "succeeded"


def test_an_approval_gate_settles_once_by_decision_before_its_expiry_or_by_expiry_after(
        store: WorkflowStore) -> None:
    """A decision settles the gate as a gate (not due yet), the expiry as a due step: at
    any instant of the one clock only one of the two writes can match, so a decision and
    the expiry never both land."""
    run_id = new_run(store)
    for name in ("decided", "expired", "open"):
        add_step(store, run_id, name, function=None, status="scheduled",
                 due_ms=None if name == "open" else T0 + 100)
    assert not store.settle_waiting_step(run_id, "decided", T0 + 99, result={"x": 1})
    assert store.settle_waiting_step(run_id, "decided", T0 + 99, gate=True, result={"x": 1},
                                     by="ann")
    assert not store.settle_waiting_step(run_id, "decided", T0 + 100, result={"expired": True})
    assert not store.settle_waiting_step(run_id, "expired", T0 + 100, gate=True, result=2)
    assert store.settle_waiting_step(run_id, "expired", T0 + 100, result={"expired": True})
    assert not store.settle_waiting_step(run_id, "expired", T0 + 100, gate=True, result=2)
    assert store.settle_waiting_step(run_id, "open", T0 + 10**9, gate=True, result=3)
    results = {s.step_name: (s.status, s.result) for s in store.list_steps(run_id)}
    assert results == {"decided": ("succeeded", {"x": 1}),
                       "expired": ("succeeded", {"expired": True}), "open": ("succeeded", 3)}
    deciders = {a.step_name: a.worker for a in store.get_history(run_id)}
    assert deciders == {"decided": "ann", "expired": None, "open": None}  # who decided
    assert [e[H.WORKER] for e in raw_history(store, run_id) if e[H.NAME] == "decided"] == ["ann"]



def test_an_opened_gate_keeps_a_wake_check_the_due_sweep_finds_until_it_is_cleared(
        store: WorkflowStore) -> None:
    """A gate is opened before its run moves (a second write): its wake check, kept in the
    settled step's due time, is how the reaper finds a run whose opener died in between."""
    run_id = new_run(store)
    add_step(store, run_id, "gate", function=None, status="scheduled")
    add_step(store, run_id, "plain", function=None, status="scheduled")
    assert store.settle_waiting_step(run_id, "gate", T0, gate=True, result={"ok": True},
                                     wake_check_ms=T0 + 100)
    assert store.settle_waiting_step(run_id, "plain", T0, gate=True, result=1)
    assert store.find_due_steps(T0 + 99, T0, 10) == []
    due = store.find_due_steps(T0 + 100, T0, 10)
    assert [(s.step_name, s.status, s.result) for s in due] == [
        ("gate", "succeeded", {"ok": True})]
    assert not store.clear_wake_check(run_id, "gate", T0 + 99)  # not the check read
    assert not store.clear_wake_check(run_id, "plain", T0 + 100)
    assert store.clear_wake_check(run_id, "gate", T0 + 100)
    assert not store.clear_wake_check(run_id, "gate", T0 + 100)
    assert store.find_due_steps(T0 + 10**6, T0, 10) == []
    state = store.get_step(run_id, "gate")
    assert state is not None and state.status == "succeeded" and state.result == {"ok": True}


# --- bad input: a clear error and no write -------------------------------------------------


@pytest.mark.parametrize("name", ["$where", "", " padded", "x" * 201, 7])
def test_bad_step_names_are_refused_without_a_write(store: WorkflowStore, name: object) -> None:
    run_id = new_run(store)
    with pytest.raises(InvalidInputError, match="step name"):
        store.insert_step(NewStep(run_id=run_id, step_name=name, function=FN), T0)  # type: ignore[arg-type]
    assert store.list_steps(run_id) == []


@pytest.mark.parametrize("data", [{"$where": "1"}, {"a.b": 1}, {"ok": {"$gt": 1}},
                                  {"x": object()}, {"n": float("nan")}, {1: "int key"},
                                  {"big": 2**70}])
def test_bad_data_is_refused_without_a_write(store: WorkflowStore, data: object) -> None:
    run_id = new_run(store)
    with pytest.raises(InvalidInputError, match="data of step 'charge'"):
        store.insert_step(NewStep(run_id=run_id, step_name="charge", function=FN, data=data), T0)
    assert store.list_steps(run_id) == []


def test_bad_results_are_refused_and_the_step_is_unchanged(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    before = store.get_step(run_id, "charge")
    with pytest.raises(InvalidInputError, match="result of step 'charge'"):
        store.set_result(run_id, "charge", 1, {"$set": 1}, T0 + 1)
    with pytest.raises(InvalidInputError, match="over the"):
        store.set_result(run_id, "charge", 1, "x" * (16 * 1024 * 1024), T0 + 1)
    assert store.get_step(run_id, "charge") == before


def test_a_step_for_an_unknown_run_is_refused(store: WorkflowStore) -> None:
    with pytest.raises(InvalidInputError, match="no run 'ghost'"):
        store.insert_step(NewStep(run_id="ghost", step_name="a", function=FN), T0)


def test_bad_run_input_is_refused_without_a_write(store: WorkflowStore) -> None:
    with pytest.raises(InvalidInputError, match="workflow input"):
        store.create_run(NewRun("r-bad", "order", {"$where": "x"}), T0)
    assert store.get_run("r-bad") is None


def test_claims_and_renewals_touch_only_their_own_step(store: WorkflowStore) -> None:
    """Regression: on nx-27017 an ``$or`` in a ``find_one_and_update`` filter ignored the
    ``_id`` and claimed another run's due sleep step (found by the demo)."""
    other = new_run(store)
    add_step(store, other, "nap", function=None, status="scheduled", due_ms=T0)
    add_step(store, other, "queued")
    before = store.list_steps(other)
    run_id = new_run(store)
    add_step(store, run_id, "mine", function="ship")
    claimed = store.claim_step(run_id, "mine", "ship", T0 + 10, LEASE).state
    assert claimed is not None and claimed.step_name == "mine" and claimed.run_id == run_id
    # A duplicate delivery of a step held under a live lease must claim nothing at all.
    assert store.claim_step(run_id, "mine", "ship", T0 + 11, LEASE).state is None
    store.renew_leases([(run_id, "mine", 1)], T0 + 20, LEASE)
    store.set_result(run_id, "mine", 1, "done", T0 + 30)
    assert store.list_steps(other) == before


# --- review findings: operator injection through ids, paging, BSON size ---------------------


@pytest.mark.parametrize("bad", [{"$gt": ""}, {"$ne": None}, 5, None])
def test_ids_that_would_be_operators_are_refused_everywhere(store: WorkflowStore,
                                                            bad: object) -> None:
    victim = new_run(store)
    add_step(store, victim)
    for call in (lambda: store.get_run(bad), lambda: store.list_steps(bad),
                 lambda: store.get_history(bad),
                 lambda: store.cancel_steps(bad, {"m": 1}, T0),
                 lambda: store.transition_run(bad, ["running"], "cancelled", T0),
                 lambda: store.touch_run(bad, T0)):
        with pytest.raises(InvalidInputError, match="run id"):
            call()  # type: ignore[no-untyped-call]
    run = store.get_run(victim)
    assert run is not None and run.status == "running"
    assert [s.status for s in store.list_steps(victim)] == ["pending"]


@pytest.mark.parametrize(("kw", "fragment"), [({"status": "runing"}, "unknown run status"),
                                               ({"status": {"$ne": None}}, "unknown run status"),
                                               ({"limit": 0}, "limit"),
                                               ({"limit": 10_001}, "limit"),
                                               ({"workflow": {"$gt": ""}}, "workflow name")])
def test_list_runs_refuses_bad_filters(store: WorkflowStore, kw: dict[str, object],
                                       fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment):
        store.list_runs(**kw)  # type: ignore[arg-type]


def test_paging_keeps_runs_created_in_the_same_millisecond(store: WorkflowStore) -> None:
    for i in range(5):
        store.create_run(NewRun(f"same-{i}", "order", None), T0)
    seen: list[str] = []
    page = store.list_runs(limit=2)
    while page:
        seen += [r.run_id for r in page]
        last = page[-1]
        page = store.list_runs(limit=2, created_before_ms=int(last.created_at.timestamp() * 1000),
                               before_run_id=last.run_id)
    assert seen == [f"same-{i}" for i in (4, 3, 2, 1, 0)]


def test_a_result_too_large_as_bson_is_refused_as_bad_input(mongo_server: object) -> None:
    """JSON of 2M zeros is 4 MB; as BSON (every array index is a key) it is over 16 MB."""
    db, client = mongo_database("mongod", mongo_server)
    try:
        store = MongoWorkflowStore(db)
        run_id = new_run(store)
        add_step(store, run_id)
        store.claim_step(run_id, "charge", FN, T0, LEASE)
        before = store.get_step(run_id, "charge")
        with pytest.raises(InvalidInputError, match="cannot be stored in MongoDB"):
            store.set_result(run_id, "charge", 1, [0] * 2_000_000, T0 + 1)
        assert store.get_step(run_id, "charge") == before
    finally:
        client.drop_database(db.name)  # type: ignore[attr-defined]


def test_from_url_opens_no_connection() -> None:
    store = MongoWorkflowStore.from_url("mongodb://127.0.0.1:1/never?directConnection=true")
    assert store.db.client._topology._opened is False  # nothing to inherit across a fork


def test_a_final_error_spends_the_step_whatever_attempts_are_left(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, retries=5)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    state = store.set_error(run_id, "charge", 1, {"message": "declined"}, T0 + 1,
                            retry_at_ms=T0 + 2, final=True)
    assert state.status == "failed" and state.due_at is None
    assert store.claim_step(run_id, "charge", FN, T0 + 10, LEASE).state is None


def test_9_a_step_without_its_history_entries_is_never_misreported(
        store: WorkflowStore) -> None:
    """A step document without its entries (written by hand, or by a version that kept
    history apart and died between the two writes): readers still report the step's
    current attempt and status from the step document."""
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_result(run_id, "charge", 1, "done", T0 + 1)
    drop_entries(store, run_id, "charge")
    history = store.get_history(run_id)
    assert [(h.attempt, h.status, h.result) for h in history] == [(1, "succeeded", "done")]


def test_the_reapers_sweeps_leave_a_steps_body_data_behind(store: WorkflowStore) -> None:
    """Every live worker's reaper sweeps every interval: a lapsed step of 8 MiB was read whole
    by each until it was claimed again (the chaos harness's full profile with partitions,
    where those reads filled the network). The sweeps may leave ``data``, ``progress`` and
    the attempts' history out (the reaper reads none of them); MongoDB's do."""
    run_id = new_run(store)
    add_step(store, run_id, "big", data={"blob": "x" * 100_000})
    assert store.claim_step(run_id, "big", FN, T0, LEASE).state is not None
    (lapsed,) = store.find_lapsed_steps(T0 + LEASE + 1, 10)
    (unsettled,) = store.find_unsettled_steps([run_id])
    for swept in (lapsed, unsettled):
        assert (swept.step_name, swept.status, swept.attempt, swept.function) == (
            "big", "running", 1, FN)
        if isinstance(store, MongoWorkflowStore):
            assert swept.data is None, "a sweep carried the step's body data"
    full = store.get_step(run_id, "big")
    assert full is not None and full.data == {"blob": "x" * 100_000}
