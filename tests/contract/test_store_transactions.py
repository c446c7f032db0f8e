"""A transactional step's transaction on the stores (issue 26, item 4): on MongoDB the
body's writes and the fenced settle commit together, and a refused settle leaves neither;
the in-memory store has no transactions (the test kit runs such a body with no session)."""

from __future__ import annotations

from typing import Any

import pytest

from pikku_celery import InMemoryWorkflowStore, WorkflowStepSupersededError
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import FN, LEASE, T0, add_step, new_run, store

__all__ = ["store"]  # the fixture, parametrized over every store


def _claimed_in_a_transaction(store: WorkflowStore) -> tuple[str, Any, Any]:
    """A run whose step ``charge`` attempt 1 is claimed, the app's collection, and a
    transaction open for the step's body."""
    run_id = new_run(store)
    add_step(store, run_id)
    assert store.claim_step(run_id, "charge", FN, T0, LEASE).state is not None
    return (run_id, store.db["txn_orders"],  # type: ignore[attr-defined]
            store.step_transaction("charge"))  # type: ignore[attr-defined]


def test_the_bodys_writes_commit_with_the_settle(store: WorkflowStore) -> None:
    if isinstance(store, InMemoryWorkflowStore):
        assert not hasattr(store, "step_transaction")
        return
    run_id, app, txn = _claimed_in_a_transaction(store)
    try:
        app.insert_one({"_id": run_id}, session=txn.session)
        settled = txn.settle(run_id, "charge", 1, {"ok": True}, T0 + 1)
        assert app.find_one({"_id": run_id}) is None  # not committed yet
        txn.commit()
    finally:
        txn.close()
    assert settled.status == "succeeded"
    assert app.find_one({"_id": run_id}) is not None
    step = store.get_step(run_id, "charge")
    assert step is not None and (step.status, step.result) == ("succeeded", {"ok": True})


def test_a_refused_settle_leaves_no_write(store: WorkflowStore) -> None:
    if isinstance(store, InMemoryWorkflowStore):
        return  # no transactions: the test above says so
    run_id, app, txn = _claimed_in_a_transaction(store)
    try:
        app.insert_one({"_id": run_id}, session=txn.session)
        with pytest.raises(WorkflowStepSupersededError):
            txn.settle(run_id, "charge", 2, {"ok": True}, T0 + 1)  # not its attempt
    finally:
        txn.close()  # aborts
    assert app.find_one({"_id": run_id}) is None
    step = store.get_step(run_id, "charge")
    assert step is not None and (step.status, step.attempt) == ("running", 1)
