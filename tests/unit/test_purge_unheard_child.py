"""Retention never purges a child run its parent has not heard yet (issue 21, minor item).

A child ends, and its parent's step parked on it is settled by ``notify_parent``. Should
that notification be lost (the notifier died in between), the parent's next pass looks at
the child again; had retention deleted the child meanwhile, that pass created it again and
it ran every step a second time. A purge now keeps such a child (its parent's step is still
``running`` on it), and reads past it so the batch is still full. On both stores.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pikku_celery.model.records import RUN_COMPLETED, RUN_RUNNING
from pikku_celery.store.base import NewRun, NewStep, WorkflowStore
from tests.contract.test_store import KINDS, T0, _make_store


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def _ended_run(store: WorkflowStore, at_ms: int, **parent: str) -> str:
    run_id = str(uuid.uuid4())
    store.create_run(NewRun(run_id=run_id, workflow="wf", input=None, **parent), at_ms)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_COMPLETED, at_ms, output="out")
    return run_id


def _parent_waiting_on(store: WorkflowStore) -> tuple[str, str]:
    parent = str(uuid.uuid4())
    child = f"{parent}-child"
    store.create_run(NewRun(run_id=parent, workflow="wf", input=None), T0)
    store.insert_step(NewStep(run_id=parent, step_name="sub", function="pikku.child:wf",
                              status="running", child_run_id=child), T0)
    store.create_run(NewRun(run_id=child, workflow="wf", input=None, parent_run_id=parent,
                            parent_step_name="sub"), T0)
    assert store.transition_run(child, [RUN_RUNNING], RUN_COMPLETED, T0 + 1, output="out")
    return parent, child


def test_a_child_its_parent_has_not_heard_is_kept_until_it_has(store: WorkflowStore) -> None:
    parent, child = _parent_waiting_on(store)
    assert store.purge_runs(T0 + 1_000) == []
    assert store.get_run(child) is not None, "the parent would create and run it again"
    assert store.settle_waiting_step(parent, "sub", T0 + 2, result="out", child_run_id=child)
    assert store.purge_runs(T0 + 1_000) == [child]
    assert store.get_run(child) is None


def test_a_kept_child_does_not_cut_a_batch_short(store: WorkflowStore) -> None:
    _, child = _parent_waiting_on(store)  # the oldest ended run: first in the batch
    others = [_ended_run(store, T0 + 2 + i) for i in range(3)]
    first = store.purge_runs(T0 + 1_000, limit=2)
    assert len(first) == 2 and child not in first
    assert store.purge_runs(T0 + 1_000, limit=2) == [r for r in others if r not in first]
    assert store.purge_runs(T0 + 1_000, limit=2) == []
    assert store.get_run(child) is not None


def test_a_child_whose_parent_step_settled_or_moved_on_is_purged(store: WorkflowStore) -> None:
    """A child run whose parent step waits on another child (an id reused by a caller), or
    whose parent is gone, is an ordinary ended run."""
    orphan = _ended_run(store, T0 + 1, parent_run_id="gone", parent_step_name="sub")
    assert store.purge_runs(T0 + 1_000) == [orphan]
