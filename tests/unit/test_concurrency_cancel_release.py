"""A queued run cancelled while it is being admitted gives its slot back at once (issue 31,
surviving mutants).

The admitter takes a slot for the group's oldest queued run, then moves the run to
``running`` with a guarded write (``concurrency.Admission.admit``). A cancel landing
between the two leaves the run cancelled and the slot taken for it: the admitter must give
that slot back and admit the next queued run in the same call. Left to the reaper's sweep,
the slot would be lost to the group for a sweep interval (and the next run would wait that
long, though a slot is free). On the in-memory store and the real ``mongod``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery.engine.concurrency import Admission
from pikku_celery.model.records import RUN_CANCELLED, RUN_QUEUED, RUN_RUNNING
from pikku_celery.store.base import NewRun, WorkflowStore
from tests.contract.test_store import KINDS, T0, _make_store
from tests.unit.test_engine import Recorder

GROUP = "limited:ann"


class _CancelledWhileTaking:
    """The store, with a cancel of ``run_id`` landing just before the admitter takes its
    slot (after it read the run as the oldest queued)."""

    def __init__(self, store: WorkflowStore, run_id: str) -> None:
        self._store, self._run_id = store, run_id

    def take_slot(self, slot: str, run_id: str, limit: int, **kwargs: Any) -> bool:
        if run_id == self._run_id:
            assert self._store.transition_run(run_id, [RUN_QUEUED], RUN_CANCELLED, T0 + 1,
                                              cancel_reason="changed my mind")
        return self._store.take_slot(slot, run_id, limit, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def test_a_run_cancelled_while_admitted_frees_its_slot_for_the_next(
        store: WorkflowStore) -> None:
    first, second = "q-1", "q-2"
    for i, run_id in enumerate((first, second)):
        run, _ = store.create_run(NewRun(run_id, "limited", {"i": i}, slot=GROUP), T0 + i)
        assert run.status == RUN_QUEUED
    recorder = Recorder()
    admission = Admission(_CancelledWhileTaking(store, first),
                          lambda workflow: 1, lambda: T0 + 2)
    assert admission.admit(GROUP, recorder) == [second]
    assert store.get_run(first).status == RUN_CANCELLED  # type: ignore[union-attr]
    assert store.get_run(second).status == RUN_RUNNING  # type: ignore[union-attr]
    assert store.slot_holders(GROUP) == [second]
    assert [run_id for run_id, _ in recorder.wakes] == [second]
