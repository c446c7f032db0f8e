"""A step's progress (``StepContext.progress``, issue 36 item 6) on every store: written by
the running attempt only, fenced like its settle (a superseded or settled attempt's write is
refused and changes nothing), cleared when the next attempt is claimed, and checked for
size and JSON before anything is written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.model.errors import InvalidInputError, WorkflowStepSupersededError
from pikku_celery.model.validate import MAX_PROGRESS_BYTES
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def _progress(store: WorkflowStore, run_id: str) -> tuple[object, object]:
    state = store.get_step(run_id, "charge")
    assert state is not None
    return state.progress, None if state.progress_at is None else state.progress_at.timestamp()


def test_the_running_attempt_records_its_progress(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    assert _progress(store, run_id) == (None, None)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.record_progress(run_id, "charge", 1, {"done": 3, "of": 10}, T0 + 5)
    store.record_progress(run_id, "charge", 1, {"done": 7, "of": 10}, T0 + 9)
    assert _progress(store, run_id) == ({"done": 7, "of": 10}, (T0 + 9) / 1000)


def test_a_superseded_or_settled_attempt_cannot_write_its_progress(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    store.record_progress(run_id, "charge", 1, {"done": 1}, T0 + 1)
    store.claim_step(run_id, "charge", FN, T0 + LEASE + 1, LEASE)  # attempt 2 takes over
    assert _progress(store, run_id) == (None, None)  # the new attempt starts with none
    with pytest.raises(WorkflowStepSupersededError) as refused:
        store.record_progress(run_id, "charge", 1, {"done": 9}, T0 + LEASE + 2)
    assert refused.value.attempt == 1
    assert _progress(store, run_id) == (None, None)
    store.record_progress(run_id, "charge", 2, {"done": 2}, T0 + LEASE + 3)
    store.set_result(run_id, "charge", 2, "ok", T0 + LEASE + 4)
    with pytest.raises(WorkflowStepSupersededError):
        store.record_progress(run_id, "charge", 2, {"done": 3}, T0 + LEASE + 5)
    assert _progress(store, run_id)[0] == {"done": 2}  # the last it said, kept with the result


@pytest.mark.parametrize("bad", [{"at": object()}, "x" * (MAX_PROGRESS_BYTES + 1)])
def test_progress_that_is_not_small_json_is_refused(store: WorkflowStore, bad: object) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE)
    with pytest.raises(InvalidInputError, match="progress of step 'charge'"):
        store.record_progress(run_id, "charge", 1, bad, T0 + 1)
    assert _progress(store, run_id) == (None, None)
