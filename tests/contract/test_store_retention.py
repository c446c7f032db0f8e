"""Retention and counts on every store: ``purge_runs`` deletes ended runs with their steps
and history, one bounded batch at a time, and never a live run; ``count_runs`` stops at
its limit. (The index check of ``tests/unit/test_hardening_infra.py`` records these
queries too.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.store.base import NewRun, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import (
    FN,
    KINDS,
    LEASE,
    T0,
    _make_store,
    add_step,
    new_run,
    store,
    supersede,
)

__all__ = ["store"]  # the fixture, parametrized over every store

DAY = 86_400_000


def ended(store: WorkflowStore, status: str, at_ms: int, *, steps: int = 2) -> str:
    """A run that ended with ``status`` at ``at_ms``, with settled steps and history (one
    step superseded once, so it has two history entries)."""
    run_id = new_run(store)
    for i in range(steps):
        add_step(store, run_id, f"s{i}")
        _, attempt = supersede(store, run_id, f"s{i}")
        store.set_result(run_id, f"s{i}", attempt, i, T0 + LEASE + 2)
    assert store.transition_run(run_id, ["running"], status, at_ms)
    return run_id


def live(store: WorkflowStore, status: str = "running") -> str:
    run_id = new_run(store)
    add_step(store, run_id)
    assert store.claim_step(run_id, "charge", FN, T0, LEASE).state is not None
    if status != "running":
        assert store.transition_run(run_id, ["running"], status, T0)
    return run_id


def test_purge_deletes_old_ended_runs_with_their_steps_and_history(
        store: WorkflowStore) -> None:
    old = [ended(store, status, T0 + 1) for status in ("completed", "failed", "cancelled")]
    recent = ended(store, "completed", T0 + 10 * DAY)
    assert len(store.get_history(old[0])) == 4  # two attempts of each of two steps

    purged = store.purge_runs(T0 + DAY)

    assert sorted(purged) == sorted(old)
    for run_id in old:
        assert store.get_run(run_id) is None
        assert store.list_steps(run_id) == [] and store.get_history(run_id) == []
    assert store.get_run(recent) is not None and len(store.list_steps(recent)) == 2


def test_purge_never_deletes_a_live_run_however_old(store: WorkflowStore) -> None:
    running, suspended = live(store), live(store, "suspended")
    gone = ended(store, "completed", T0)
    assert store.purge_runs(T0 + 365 * DAY) == [gone]
    for run_id in (running, suspended):
        assert store.get_run(run_id) is not None
        assert len(store.list_steps(run_id)) == 1


@pytest.mark.parametrize("statuses", [["running"], ["completed", "suspended"], []])
def test_purge_refuses_a_live_status(store: WorkflowStore, statuses: list[str]) -> None:
    run_id = live(store)
    with pytest.raises(InvalidInputError, match="ended runs only"):
        store.purge_runs(T0 + DAY, statuses=statuses)
    assert store.get_run(run_id) is not None


def test_purge_takes_only_the_statuses_asked_for(store: WorkflowStore) -> None:
    done, failed = ended(store, "completed", T0), ended(store, "failed", T0)
    assert store.purge_runs(T0 + DAY, statuses=["failed"]) == [failed]
    assert store.get_run(done) is not None


def test_purge_is_one_bounded_batch_per_call(store: WorkflowStore) -> None:
    runs = {ended(store, "completed", T0 + i, steps=1) for i in range(5)}
    first = store.purge_runs(T0 + DAY, limit=2)
    second = store.purge_runs(T0 + DAY, limit=2)
    third = store.purge_runs(T0 + DAY, limit=2)
    assert (len(first), len(second), len(third)) == (2, 2, 1)
    assert set(first) | set(second) | set(third) == runs
    assert store.purge_runs(T0 + DAY, limit=2) == []
    with pytest.raises(InvalidInputError, match="limit"):
        store.purge_runs(T0 + DAY, limit=0)


def test_a_run_id_taken_again_after_a_purge_is_a_new_run(store: WorkflowStore) -> None:
    run_id = ended(store, "completed", T0)
    store.purge_runs(T0 + DAY)
    run, created = store.create_run(NewRun(run_id, "order", {"n": 2}), T0 + 2 * DAY)
    assert created and run.input == {"n": 2} and store.list_steps(run_id) == []


def test_count_runs_counts_by_status_and_stops_at_its_limit(store: WorkflowStore) -> None:
    for _ in range(3):
        ended(store, "completed", T0 + 5, steps=0)
    other = new_run(store)
    store.transition_run(other, ["running"], "failed", T0 + 5)
    store.create_run(NewRun("x-1", "refund", None), T0)
    assert store.count_runs(status="completed") == 3
    assert store.count_runs(status="completed", limit=2) == 2
    assert store.count_runs(status="failed", workflow="order") == 1
    assert store.count_runs(status="running", workflow="refund") == 1
    assert store.count_runs(status="running", workflow="order") == 0
    assert store.count_runs(status="completed", updated_before_ms=T0 + 5) == 0
    assert store.count_runs(status="completed", updated_before_ms=T0 + 6) == 3
    with pytest.raises(InvalidInputError, match="not both"):
        store.count_runs(status="completed", workflow="order", updated_before_ms=T0)
    with pytest.raises(InvalidInputError, match="unknown run status"):
        store.count_runs(status="done")


@pytest.fixture(params=[k for k in KINDS if k != "memory"])
def mongo_store(request: pytest.FixtureRequest) -> Iterator[MongoWorkflowStore]:
    """MongoDB only: the in-memory store decides under one lock and leaves no marks."""
    for made in _make_store(request):
        assert isinstance(made, MongoWorkflowStore)
        yield made


def test_purge_deletes_the_marks_the_runs_ends_left(mongo_store: MongoWorkflowStore) -> None:
    """A run's end leaves a mark among the steps before its own write (``store._ended``);
    a purge takes it with the run, and a recent run keeps its own."""
    store = mongo_store
    old, recent = ended(store, "completed", T0 + 1), ended(store, "cancelled", T0 + 10 * DAY)
    steps = store.db[keys.STEPS]  # not the store's own handle: the index check records that
    assert steps.count_documents({"_id": keys.run_end_mark_id(old)}) == 1
    assert store.purge_runs(T0 + DAY) == [old]
    assert steps.count_documents({"_id": keys.run_end_mark_id(old)}) == 0
    assert steps.count_documents({"_id": keys.run_end_mark_id(recent)}) == 1
