"""A first claim made from what the step's message says (``store._claim_hint``, issue 34
items 1 and 3): it must return exactly what a claim that reads returns, read nothing on
MongoDB when the hint matches, never take a value from a hint that does not match (a
message is untrusted), and keep the claim's half of the Dekker pair with a run's end."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pikku_celery.model.keys import invocation_id
from pikku_celery.model.records import RUN_RUNNING, STEP_FAILED, STEP_RUNNING
from pikku_celery.store._claim_hint import MAX_HINT_BYTES, checked_hint, hint_of
from pikku_celery.store._docs import new_step_doc
from pikku_celery.store.base import NewStep, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, LEASE, T0, new_run
from tests.contract.test_store_end_marks import _ENDS, _MOST_WRITES, Stopped, _stopping

DATA = {"order": 7, "lines": [{"sku": "a", "qty": 2.0}], "note": None}


def _recorded(store: WorkflowStore, run_id: str, name: str = "charge",
              data: Any = None) -> dict[str, Any]:
    """Insert a pending step as a pass records it; its hint, as the pass sends it."""
    step = NewStep(run_id=run_id, step_name=name, function=FN,
                   data=DATA if data is None else data, max_attempts=3, retry_delay_ms=250)
    store.insert_steps([step], T0, seq=4)
    hint = hint_of(new_step_doc(step, T0, 4))
    assert hint is not None
    return hint


class _NoReads:
    """A collection that fails the test on any read, or any write that returns a document."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name in ("find", "find_one", "find_one_and_update", "aggregate", "count_documents"):
            raise AssertionError(f"the hinted claim called {name} on {self._real.name}")
        return getattr(self._real, name)


def test_a_hinted_claim_returns_the_step_as_stored(store: WorkflowStore) -> None:
    run_id = new_run(store)
    hint = _recorded(store, run_id)
    claimed = store.claim_step(run_id, "charge", FN, T0 + 5, LEASE, worker="w1", task_id="t1",
                               expected=hint).state
    assert claimed is not None and claimed.status == STEP_RUNNING and claimed.attempt == 1
    assert claimed == store.get_step(run_id, "charge")
    assert claimed.data == DATA and claimed.retry_delay_ms == 250 and claimed.task_id == "t1"


def test_on_mongodb_a_hinted_claim_reads_nothing(mongo_store: MongoWorkflowStore) -> None:
    store = mongo_store
    run_id = new_run(store)
    hint = _recorded(store, run_id)
    steps, runs = store._steps, store._runs
    store._steps, store._runs = _NoReads(steps), _NoReads(runs)  # type: ignore[assignment]
    try:
        claimed = store.claim_step(run_id, "charge", FN, T0 + 5, LEASE, expected=hint).state
    finally:
        store._steps, store._runs = steps, runs  # type: ignore[assignment]
    assert claimed == store.get_step(run_id, "charge")


@pytest.mark.parametrize("forge", ["data", "operator", "max_attempts", "seq", "extra_field",
                                   "forked_from", "errors_retried"])
def test_a_hint_that_does_not_match_gives_nothing_of_its_own(store: WorkflowStore,
                                                             forge: str) -> None:
    """A forged or outdated hint: the claim goes the usual way, and what it returns is the
    step as stored. Without the guard's comparison of each field the claim would hand the
    body the hint's data (or its attempts)."""
    run_id = new_run(store)
    hint = copy.deepcopy(_recorded(store, run_id))
    if forge == "data":
        hint["data"] = {"order": 8, "lines": [], "note": None}
    elif forge == "operator":
        hint["data"] = {"$exists": True}
    elif forge == "max_attempts":
        hint["max_attempts"] = 99
    elif forge == "seq":
        hint["seq"] = 5
    elif forge == "extra_field":
        hint["result"] = {"paid": True}
    elif forge == "forked_from":
        hint["forked_from"] = "another-run"
    else:
        hint["errors_retried"] = False
    claimed = store.claim_step(run_id, "charge", FN, T0 + 5, LEASE, expected=hint).state
    assert claimed is not None and claimed.attempt == 1
    assert claimed == store.get_step(run_id, "charge")
    assert claimed.data == DATA and claimed.max_attempts == 3 and claimed.errors_retried


def test_a_hint_for_a_step_claimed_since_claims_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    hint = _recorded(store, run_id)
    first = store.claim_step(run_id, "charge", FN, T0 + 5, LEASE, expected=hint).state
    assert first is not None
    again = store.claim_step(run_id, "charge", FN, T0 + 6, LEASE, expected=hint)  # redelivered
    assert again.state is None
    assert store.get_step(run_id, "charge") == first


def test_a_hint_naming_another_function_is_refused_as_the_message_is(
        store: WorkflowStore) -> None:
    from pikku_celery.model.errors import WorkflowStepFunctionMismatchError
    run_id = new_run(store)
    hint = _recorded(store, run_id)
    with pytest.raises(WorkflowStepFunctionMismatchError):
        store.claim_step(run_id, "charge", "other:fn", T0 + 5, LEASE,
                         expected={**hint, "function": "other:fn"})
    assert store.get_step(run_id, "charge").status == "pending"  # type: ignore[union-attr]


@pytest.mark.parametrize("status", sorted(_ENDS))
def test_an_ender_stopped_at_any_write_lets_no_hinted_claim_run_on_the_ended_run(
        store: WorkflowStore, status: str) -> None:
    """The hinted claim writes, then checks for the end's mark in the same command: an end
    that landed (or half-landed: its mark alone) is seen, as a claim that reads sees it."""
    for writes in range(_MOST_WRITES + 1):
        run_id = new_run(store)
        hint = _recorded(store, run_id)
        try:
            assert _ENDS[status](_stopping(store, writes), run_id)
            finished = True
        except Stopped:
            finished = False
        got = store.claim_step(run_id, "charge", FN, T0 + 2, LEASE, expected=hint)
        run = store.get_run(run_id)
        assert run is not None
        if run.status == RUN_RUNNING:
            assert got.state is not None and got.state.status == STEP_RUNNING
        else:
            assert got.state is None, f"a hinted claim ran a step on a run {run.status}"
            assert got.run_status == run.status
            fenced = store.get_step(run_id, "charge")
            assert fenced is not None and fenced.status == STEP_FAILED
            assert fenced.due_at is None
        if finished:
            return
    pytest.fail(f"an end made more than {_MOST_WRITES} writes")


def test_what_carries_a_hint_and_what_does_not() -> None:
    step = NewStep(run_id="r", step_name="s", function=FN, data={"n": 1}, max_attempts=2)
    hint = hint_of(new_step_doc(step, T0, 1))
    step_id = invocation_id("r", "s")
    assert hint is not None and checked_hint(hint, step_id, FN) is not None
    big = NewStep(run_id="r", step_name="s", function=FN, data="x" * MAX_HINT_BYTES,
                  max_attempts=2)
    assert hint_of(new_step_doc(big, T0, 1)) is None  # the message stays small
    gate = NewStep(run_id="r", step_name="g", function=None, data=None, max_attempts=1)
    assert hint_of(new_step_doc(gate, T0, 1)) is None
    assert checked_hint(hint, invocation_id("r", "other"), FN) is None
    assert checked_hint(hint, step_id, "another") is None
    assert checked_hint({**hint, "seq": True}, step_id, FN) is None
    assert checked_hint({**hint, "status": "pending"}, step_id, FN) is None
    assert checked_hint(["not", "a", "map"], step_id, FN) is None
    assert checked_hint({k: v for k, v in hint.items() if k != "data"}, step_id, FN) is None


def test_a_hint_that_leaves_out_a_field_the_step_has_gives_nothing_of_its_own(
        store: WorkflowStore) -> None:
    """A step recorded with ``errors_retried`` false, and a hint without the field (which
    reads as true): the guard requires the field absent, so the claim reads the step."""
    run_id = new_run(store)
    step = NewStep(run_id=run_id, step_name="charge", function=FN, data=DATA, max_attempts=3,
                   errors_retried=False)
    store.insert_steps([step], T0, seq=4)
    hint = hint_of(new_step_doc(step, T0, 4))
    assert hint is not None and hint.pop("errors_retried") is False
    claimed = store.claim_step(run_id, "charge", FN, T0 + 5, LEASE, expected=hint).state
    assert claimed is not None and claimed.errors_retried is False
    assert claimed == store.get_step(run_id, "charge")
