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


def test_the_settle_is_the_transactions_own_write(store: WorkflowStore) -> None:
    """The settle is written in the transaction's session (issue 31, a surviving mutant):
    nobody sees it before the commit, and an aborted transaction takes it back with the
    body's writes. Written beside the session, it would commit alone: a commit that then
    failed would leave a recorded success without the writes it stands for."""
    if isinstance(store, InMemoryWorkflowStore):
        return  # no transactions: the first test says so
    run_id, app, txn = _claimed_in_a_transaction(store)
    try:
        app.insert_one({"_id": run_id}, session=txn.session)
        settled = txn.settle(run_id, "charge", 1, {"ok": True}, T0 + 1)
        assert settled.status == "succeeded"  # as the transaction sees it
        outside = store.get_step(run_id, "charge")
        assert outside is not None and (outside.status, outside.result) == ("running", None)
        txn.abort()
    finally:
        txn.close()
    assert app.find_one({"_id": run_id}) is None
    step = store.get_step(run_id, "charge")
    assert step is not None and (step.status, step.attempt) == ("running", 1)
    # The attempt still owns its step: its settle, made again, lands.
    again = store.set_result(run_id, "charge", 1, {"ok": True}, T0 + 2)
    assert (again.status, again.attempt) == ("succeeded", 1)
