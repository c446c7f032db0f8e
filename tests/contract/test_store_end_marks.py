"""A run's end and the steps a pass runs in place, when the ender stops half-way or a retry
is refused (issue 31, surviving mutants; the orders are ``store._ended``'s).

A step run in place is inserted already claimed (``claim_new_step``) and reads the run only
when it finds the end's mark among the steps. So the mark must be written *before* the run's
end: an ender that stops between its two writes must leave either a live run (the mark
alone: the step reads the run, finds it live, and runs) or both, never an ended run without
its mark (the step would run on it unseen: its body starts after the end, and nobody fences
it). And a ``retry_run`` that is refused (the run is not failed or cancelled) must leave
the mark where it was: without it the next step inserted claimed on a completed run runs.

The ender "stops" by an exception raised before its k-th write to MongoDB, for every k up
to the writes an end makes, so the test holds whatever the writes are; the in-memory store
makes its end in one step under its lock (no point to stop at), and is held to the same
outcome for the whole end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_COMPLETED,
    RUN_FAILED,
    RUN_RUNNING,
    STEP_FAILED,
    STEP_RUNNING,
)
from pikku_celery.store.base import NewStep, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, new_run

_WRITES = frozenset({"insert_one", "insert_many", "update_one", "update_many", "replace_one",
                     "delete_one", "delete_many", "find_one_and_update", "find_one_and_replace",
                     "find_one_and_delete", "bulk_write"})
_MOST_WRITES = 8  # an end makes two today; more would still be covered up to here


class Stopped(Exception):
    """The process making the writes stopped here (killed, its host lost)."""


class _Budget:
    def __init__(self, writes: int) -> None:
        self.left = writes

    def spend(self, what: str) -> None:
        if self.left == 0:
            raise Stopped(f"stopped before {what}")
        self.left -= 1


class _Collection:
    """A collection whose writes stop once the budget is spent; reads go through."""

    def __init__(self, real: Any, budget: _Budget) -> None:
        self._real, self._budget = real, budget

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._real, name)
        if name not in _WRITES:
            return found

        def write(*args: Any, **kwargs: Any) -> Any:
            self._budget.spend(f"{name} on {self._real.name}")
            return found(*args, **kwargs)
        return write


class _StopsAfter:
    """The store's database, with every collection's writes under one budget."""

    def __init__(self, db: Any, budget: _Budget) -> None:
        self._db, self._budget = db, budget

    def __getitem__(self, name: str) -> _Collection:
        return _Collection(self._db[name], self._budget)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _stopping(store: WorkflowStore, writes: int) -> WorkflowStore:
    """Another process's store on the same data, that stops before its ``writes + 1``-th
    write (the in-memory store: the store itself, which never stops half-way)."""
    if not isinstance(store, MongoWorkflowStore):
        return store
    return MongoWorkflowStore(_StopsAfter(store.db, _Budget(writes)),  # type: ignore[arg-type]
                              create_indexes=False)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def _step(run_id: str) -> NewStep:
    return NewStep(run_id=run_id, step_name="ship", function=FN, data={"n": 1},
                   max_attempts=3)


def _assert_no_step_runs_on_an_ended_run(store: WorkflowStore, run_id: str, at: int) -> None:
    got = store.claim_new_step(_step(run_id), at, LEASE)
    run = store.get_run(run_id)
    assert run is not None and got.created
    if run.status == RUN_RUNNING:  # the end never landed: the step is the run's to run
        assert got.state is not None and got.state.status == STEP_RUNNING
        return
    assert got.state is None, f"a step was claimed in place on a run {run.status}"
    assert got.run_status == run.status
    fenced = store.get_step(run_id, "ship")
    assert fenced is not None and fenced.status == STEP_FAILED and fenced.due_at is None


_ENDS: dict[str, Callable[[WorkflowStore, str], bool]] = {
    RUN_COMPLETED: lambda s, r: s.transition_run(r, [RUN_RUNNING], RUN_COMPLETED, T0 + 1,
                                                 output={"shipped": 1}),
    RUN_FAILED: lambda s, r: s.transition_run(r, [RUN_RUNNING], RUN_FAILED, T0 + 1,
                                              error={"type": "E", "message": "boom"}),
    RUN_CANCELLED: lambda s, r: s.transition_run(r, [RUN_RUNNING], RUN_CANCELLED, T0 + 1,
                                                 cancel_reason="no"),
}


def _stopped_at_each_write(store: WorkflowStore, status: str,
                           end: Callable[[WorkflowStore, str], None],
                           prepare: Callable[[str], None] = lambda run_id: None) -> str:
    """``end`` a fresh run (``prepare``d) by a writer stopped before its first write, then
    its second, and so on until it finishes: after each, no step may run in place on an
    ended run. The run it finished on."""
    for writes in range(_MOST_WRITES + 1):
        run_id = new_run(store)
        prepare(run_id)
        try:
            end(_stopping(store, writes), run_id)
            finished = True
        except Stopped:
            finished = False
        _assert_no_step_runs_on_an_ended_run(store, run_id, T0 + 2)
        if finished:
            assert store.get_run(run_id).status == status  # type: ignore[union-attr]
            return run_id
    pytest.fail(f"an end made more than {_MOST_WRITES} writes")


@pytest.mark.parametrize("status", sorted(_ENDS))
def test_an_ender_stopped_at_any_write_lets_no_step_run_in_place_on_the_ended_run(
        store: WorkflowStore, status: str) -> None:
    def end(writer: WorkflowStore, run_id: str) -> None:
        assert _ENDS[status](writer, run_id)
    _stopped_at_each_write(store, status, end)


_END_FIELDS: dict[str, dict[str, Any]] = {
    RUN_COMPLETED: {"output": {"shipped": 1}},
    RUN_FAILED: {"error": {"type": "E", "message": "boom"}},
    RUN_CANCELLED: {"cancel_reason": "no"},
}


@pytest.mark.parametrize("status", sorted(_ENDS))
def test_an_end_whose_mark_came_with_the_last_settle_lets_no_step_run_in_place_on_it(
        store: WorkflowStore, status: str) -> None:
    """A pass that ends its run right after its last step writes the end's mark with that
    step's settle (``settle_and_insert_steps``'s ``end_mark``) and the end without one
    (``transition_run``'s ``marked``). Stopped at any write, it must leave what an ender
    writing its own mark leaves: a live run, or an ended run with its mark."""
    def run_last_step(run_id: str) -> None:
        last = NewStep(run_id=run_id, step_name="last", function=FN, data={"n": 0},
                       max_attempts=3)
        claimed = store.claim_new_step(last, T0, LEASE).state
        assert claimed is not None and claimed.attempt == 1

    def settle_and_end(writer: WorkflowStore, run_id: str) -> None:
        writer.settle_and_insert_steps(run_id, "last", 1, {"ok": 1}, T0 + 1, [],
                                       end_mark=True)
        assert writer.transition_run(run_id, [RUN_RUNNING], status, T0 + 1, marked=True,
                                     **_END_FIELDS[status])

    run_id = _stopped_at_each_write(store, status, settle_and_end, run_last_step)
    settled = store.get_step(run_id, "last")
    assert settled is not None and settled.status == "succeeded"


@pytest.mark.parametrize("status", [RUN_COMPLETED, RUN_RUNNING])
def test_a_refused_retry_leaves_the_end_in_force_for_steps_run_in_place(
        store: WorkflowStore, status: str) -> None:
    """A retry of a run that is not failed or cancelled is refused and changes nothing: a
    completed run stays completed for the next step inserted claimed on it (its end's fence
    may not have run yet, or a pass may still be replaying it); a running one runs it."""
    run_id = new_run(store)
    if status != RUN_RUNNING:
        assert _ENDS[status](store, run_id)
    assert store.retry_run(run_id, T0 + 2) is None
    assert store.get_run(run_id).status == status  # type: ignore[union-attr]
    _assert_no_step_runs_on_an_ended_run(store, run_id, T0 + 3)
