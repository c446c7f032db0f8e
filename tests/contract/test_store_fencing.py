"""Fencing facts the store contract suite could not fail on (issue 13's surviving mutants).

* A claim is decided on one read and written with a guard repeating what was read, attempt
  included: a claim whose read went stale loses, even when status and lapse still match.
* A superseded attempt gets a history entry of its own, *written* by the reclaim: read from
  the raw documents, because ``get_history`` fills a missing one in.
* The lapsed-step sweep lists exactly the steps a claim would call lapsed: never one under a
  live lease, never one parked on a child.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run
from tests.support.raw import entries, raw_history

LEASE_EXPIRED = "WorkflowStepLeaseExpiredError"


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


@pytest.fixture(params=[k for k in KINDS if k != "memory"])
def mongo_store(request: pytest.FixtureRequest) -> Iterator[MongoWorkflowStore]:
    """MongoDB stores only: the in-memory store decides and writes under one lock, so no
    read can go stale there."""
    for made in _make_store(request):
        assert isinstance(made, MongoWorkflowStore)
        yield made


class _ActsAfterRead:
    """The steps collection, with ``act`` run right after the next ``find_one``: another
    claimer wins in the window between a claim's read and its guarded write."""

    def __init__(self, inner: Any, act: Callable[[], None]) -> None:
        self._inner = inner
        self._act: Callable[[], None] | None = act

    def find_one(self, *args: Any, **kwargs: Any) -> Any:
        doc = self._inner.find_one(*args, **kwargs)
        act, self._act = self._act, None
        if act is not None:
            act()
        return doc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# --- the claim guard checks the attempt it read --------------------------------------------


def test_a_claim_decided_on_a_stale_read_loses(mongo_store: MongoWorkflowStore) -> None:
    """Timeline: A reads attempt 1 running with a lapsed lease (a reclaim: attempt 2 of 2);
    B reclaims first (attempt 2), and B's lease has lapsed too by A's clock; A writes.
    Status and lapse still match A's read; only the attempt shows it went stale. Without
    the attempt in the guard A would reclaim as attempt 3 of 2."""
    store = mongo_store
    run_id = new_run(store)
    add_step(store, run_id, retries=1)  # two attempts at most
    assert store.claim_step(run_id, "charge", FN, T0, LEASE).state is not None
    rival = MongoWorkflowStore(store.db, create_indexes=False)  # another process, same db
    won: list[Any] = []

    def rival_reclaims() -> None:
        won.append(rival.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE).state)

    store._steps = _ActsAfterRead(store._steps, rival_reclaims)  # type: ignore[assignment]
    late = store.claim_step(run_id, "charge", FN, T0 + 5 * LEASE, LEASE)
    assert won and won[0] is not None and won[0].attempt == 2, "the rival must win first"
    assert late.state is None, (
        f"a claim decided on attempt 1 won after attempt 2 took the step: {late.state}")
    step = store.get_step(run_id, "charge")
    assert step is not None and (step.attempt, step.status) == (2, "running")


# --- a superseded attempt's history entry is written, not inferred -------------------------


def test_a_superseded_attempt_has_its_own_history_entry(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE, worker="w1")
    store.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE, worker="w2")
    assert entries(store, run_id, "charge") == [(1, "failed"), (2, "running")], (
        "the reclaim must close the entry of the attempt it fenced out, and open its own")
    first = raw_history(store, run_id)[0]
    assert first["error"]["type"] == LEASE_EXPIRED and first["worker"] == "w1"
    store.claim_step(run_id, "charge", FN, T0 + 3 * LEASE, LEASE, worker="w3")
    store.set_result(run_id, "charge", 3, "third", T0 + 3 * LEASE + 1)
    assert entries(store, run_id, "charge") == [(1, "failed"), (2, "failed"), (3, "succeeded")]
    store.claim_step(run_id, "charge", FN, T0 + 4 * LEASE, LEASE)  # settled: nothing written
    assert entries(store, run_id, "charge") == [(1, "failed"), (2, "failed"), (3, "succeeded")]
    assert [d["worker"] for d in raw_history(store, run_id)] == ["w1", "w2", "w3"]


def test_a_retried_failure_keeps_the_entry_its_settle_wrote(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_error(run_id, "charge", 1, {"message": "boom"}, T0 + 1, retry_at_ms=T0 + 2)
    store.claim_step(run_id, "charge", FN, T0 + 2, LEASE)
    store.set_result(run_id, "charge", 2, "ok", T0 + 3)
    history = raw_history(store, run_id)
    assert [(d["attempt"], d["status"]) for d in history] == [(1, "failed"), (2, "succeeded")]
    assert history[0]["error"] == {"message": "boom"}


def test_an_expired_last_attempt_has_its_entry_written(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, retries=0)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    outcome = store.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE)
    assert outcome.state is None and outcome.wake_run
    assert entries(store, run_id, "charge") == [(1, "failed")]
    assert raw_history(store, run_id)[0]["error"]["type"] == LEASE_EXPIRED


# --- the lapsed sweep agrees with the claim ------------------------------------------------


def test_the_lapsed_sweep_never_lists_a_live_lease(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id, "short")
    add_step(store, run_id, "live")
    add_step(store, run_id, "child", function="workflow:refund", status="running",
             child_run_id="child-1")
    store.claim_step(run_id, "short", FN, T0, 50)
    store.claim_step(run_id, "live", FN, T0, LEASE)
    # At the deadline itself the lease still holds: the sweep and the claim agree on it.
    assert store.find_lapsed_steps(T0 + 50, 10) == []
    assert store.claim_step(run_id, "short", FN, T0 + 50, LEASE).state is None
    assert [s.step_name for s in store.find_lapsed_steps(T0 + 51, 10)] == ["short"]
    assert [s.step_name for s in store.find_lapsed_steps(T0 + LEASE, 10)] == ["short"]
    assert store.renew_leases([(run_id, "live", 1)], T0 + LEASE - 1, LEASE) == set()
    assert [s.step_name for s in store.find_lapsed_steps(T0 + LEASE + 1, 10)] == ["short"]
    assert sorted(s.step_name for s in store.find_lapsed_steps(T0 + 3 * LEASE, 10)) == [
        "live", "short"]


# --- survivors of ./dev mutate in the stores -------------------------------------------------


def test_ending_a_run_leaves_a_step_failed_for_good_with_its_own_error(
        store: WorkflowStore) -> None:
    """``cancel_steps`` fences unsettled steps only: a step already failed for good keeps
    the error that failed it (and its entry), never the run-ended error written over it."""
    run_id = new_run(store)
    add_step(store, run_id, retries=0)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.set_error(run_id, "charge", 1, {"message": "declined"}, T0 + 1)
    assert store.cancel_steps(run_id, {"type": "WorkflowRunEnded"}, T0 + 2) == 0
    step = store.get_step(run_id, "charge")
    assert step is not None and step.error == {"message": "declined"}
    assert raw_history(store, run_id)[0]["error"] == {"message": "declined"}


def test_a_step_parked_on_a_child_refuses_lease_renewals(store: WorkflowStore) -> None:
    """A renewal may only extend a lease that exists: giving a parked step a lease would
    let the reaper call it lapsed and re-send a step that waits on a child run."""
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    assert store.release_lease(run_id, "charge", 1)  # parked: it now waits on a child
    assert store.renew_leases([(run_id, "charge", 1)], T0 + 1, LEASE) == {(run_id, "charge")}
    step = store.get_step(run_id, "charge")
    assert step is not None and step.lease_expires_at is None
    assert store.find_lapsed_steps(T0 + 10 * LEASE, 10) == []
