"""``settle_and_insert_steps``: a step's settle and the insert of the steps its pass reached,
one command on MongoDB (issue 34 item 1). On every store: both land together, exactly as
``set_result`` then ``insert_steps`` would leave them; a settle that matches nothing writes
nothing (the steps reached with an unrecorded result are never inserted); a step that
exists is returned untouched, as ``insert_steps`` returns it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.model.errors import InvalidInputError, WorkflowStepSupersededError
from pikku_celery.store.base import NewStep, WorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def _step(run_id: str, name: str, data: object = None) -> NewStep:
    return NewStep(run_id=run_id, step_name=name, function=FN,
                   data={"for": name} if data is None else data, max_attempts=3)


def _claimed(store: WorkflowStore, run_id: str) -> None:
    add_step(store, run_id, "a")
    assert store.claim_step(run_id, "a", FN, T0, LEASE, worker="w").state is not None


def test_the_settle_and_the_inserts_land_as_two_writes_would_leave_them(
        store: WorkflowStore) -> None:
    run_id, twin = new_run(store), new_run(store)
    for run in (run_id, twin):
        _claimed(store, run)
    got = store.settle_and_insert_steps(run_id, "a", 1, {"ok": 1}, T0 + 5,
                                        [_step(run_id, "b"), _step(run_id, "c")], seq=3)
    store.set_result(twin, "a", 1, {"ok": 1}, T0 + 5)
    expected = store.insert_steps([_step(twin, "b"), _step(twin, "c")], T0 + 5, seq=3)
    assert [(s.step_name, s.status, s.data, created) for s, created in got] == [
        (s.step_name, s.status, s.data, created) for s, created in expected]
    assert all(created for _, created in got)
    for name in ("a", "b", "c"):
        mine, theirs = store.get_step(run_id, name), store.get_step(twin, name)
        assert mine is not None and theirs is not None
        assert (mine.status, mine.result, mine.data, mine.attempt, mine.due_at,
                mine.lease_expires_at) == (theirs.status, theirs.result, theirs.data,
                                           theirs.attempt, theirs.due_at,
                                           theirs.lease_expires_at)
    assert [(h.step_name, h.status) for h in store.get_history(run_id)] == [
        ("a", "succeeded")]


def test_a_superseded_settle_writes_nothing_and_inserts_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    _claimed(store, run_id)
    again = store.claim_step(run_id, "a", FN, T0 + LEASE + 1, LEASE).state  # the reaper's
    assert again is not None and again.attempt == 2
    before = store.get_step(run_id, "a")
    with pytest.raises(WorkflowStepSupersededError) as refused:
        store.settle_and_insert_steps(run_id, "a", 1, "late", T0 + LEASE + 2,
                                      [_step(run_id, "b")])
    assert refused.value.current_attempt == 2
    assert store.get_step(run_id, "a") == before
    assert store.get_step(run_id, "b") is None


def test_an_existing_step_is_returned_as_it_is(store: WorkflowStore) -> None:
    run_id = new_run(store)
    _claimed(store, run_id)
    add_step(store, run_id, "b")  # recorded by a pass whose view the caller lacks
    before = store.get_step(run_id, "b")
    got = store.settle_and_insert_steps(run_id, "a", 1, 7, T0 + 1,
                                        [_step(run_id, "b"), _step(run_id, "c")])
    assert [(s.step_name, created) for s, created in got] == [("b", False), ("c", True)]
    assert got[0][0] == before
    assert store.get_step(run_id, "a").status == "succeeded"  # type: ignore[union-attr]


def test_a_result_that_cannot_be_stored_writes_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    _claimed(store, run_id)
    before = store.get_step(run_id, "a")
    with pytest.raises(InvalidInputError):
        store.settle_and_insert_steps(run_id, "a", 1, {"when": object()}, T0 + 1,
                                      [_step(run_id, "b")])
    assert store.get_step(run_id, "a") == before
    assert store.get_step(run_id, "b") is None
