"""Every store records the Celery task id of each attempt (the claim writes it beside the
worker) and carries it into that attempt's history entry, whichever way the attempt ended:
succeeded, failed, or superseded by a reclaim. Users correlate attempts with Flower, Sentry
and worker logs by it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.model.keys import HistoryField as H
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run
from tests.support.raw import raw_history


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def test_each_attempt_keeps_the_task_id_that_claimed_it(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    # Attempt 1 fails, with its retry due at once.
    store.claim_step(run_id, "charge", FN, T0, LEASE, worker="w1", task_id="task-1")
    store.set_error(run_id, "charge", 1, {"type": "E", "message": "no"}, T0 + 1,
                    retry_at_ms=T0 + 2)
    # Attempt 2 is claimed and its worker dies: attempt 3 supersedes it after the lapse.
    store.claim_step(run_id, "charge", FN, T0 + 2, LEASE, worker="w2", task_id="task-2")
    store.claim_step(run_id, "charge", FN, T0 + LEASE + 3, LEASE, worker="w3", task_id="task-3")
    store.set_result(run_id, "charge", 3, {"ok": True}, T0 + LEASE + 4)

    history = store.get_history(run_id)
    assert [(h.attempt, h.status, h.task_id, h.worker) for h in history] == [
        (1, "failed", "task-1", "w1"), (2, "failed", "task-2", "w2"),
        (3, "succeeded", "task-3", "w3")]
    # Written, not only merged in from the step document by get_history.
    assert [(d[H.ATTEMPT], d[H.TASK_ID]) for d in raw_history(store, run_id)] == [
        (1, "task-1"), (2, "task-2"), (3, "task-3")]


def test_an_attempt_claimed_inline_has_no_task_id(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    store.claim_step(run_id, "charge", FN, T0, LEASE, worker="w1")
    running = store.get_history(run_id)
    assert [(h.status, h.task_id) for h in running] == [("running", None)]
