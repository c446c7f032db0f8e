"""A run's end against a claim landing inside its fence (issue 21, defect 1).

A run ends with one write on the run, then ``cancel_steps`` reads the run's unsettled steps
and fences each with a write guarded on what it read. A claim landing between that read and
that write made the guard match nothing: the step ran on an ended run, its renewals were
accepted and its result recorded. The claim now reads the run after its own write and
fences itself when the run has ended (``pikku_celery.store._ended``).

The window is produced deterministically on the real MongoDB store: the steps collection is
wrapped so that a claim runs right after the fence's read of the steps, before its writes.
The in-memory store fences under one lock (no window), but a claim of a step of an ended
run must be refused there too, so the rule is checked on both stores.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    MongoWorkflowStore,
    PikkuCelery,
)
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.records import RUN_CANCELLED, RUN_COMPLETED, RUN_FAILED, RUN_RUNNING
from pikku_celery.store.base import WorkflowStore
from tests.conftest import mongo_database
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, add_step, new_run
from tests.unit.test_engine import Recorder

CANCELLED = {"type": "WorkflowCancelledError", "message": "run was cancelled: by a test"}


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


class _ClaimsAfterFenceRead:
    """The steps collection, with ``act`` run once right after the fence's read of a run's
    unsettled steps (the ``find`` whose filter has the unsettled ``$or``), before any of
    its guarded writes: a claim lands inside the fence's window."""

    def __init__(self, inner: Any, act: Callable[[], None]) -> None:
        self._inner = inner
        self._act: Callable[[], None] | None = act

    def find(self, query: Any = None, *args: Any, **kwargs: Any) -> Any:
        found = self._inner.find(query, *args, **kwargs)
        if self._act is None or "$or" not in (query or {}):
            return found
        docs = list(found)  # the read is over before the claim lands
        act, self._act = self._act, None
        act()
        return docs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# --- the store: a claim of a step of an ended run fences itself ------------------------------


@pytest.mark.parametrize("ended", [RUN_CANCELLED, RUN_COMPLETED, RUN_FAILED])
def test_a_claim_of_a_step_of_an_ended_run_fences_its_own_attempt(
        store: WorkflowStore, ended: str) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    assert store.transition_run(run_id, [RUN_RUNNING], ended, T0 + 1,
                                error=CANCELLED if ended == RUN_CANCELLED else None)
    assert store.claim_step(run_id, "charge", FN, T0 + 2, LEASE).state is None
    step = store.get_step(run_id, "charge")
    assert step is not None and step.status == "failed" and step.due_at is None
    expected = "WorkflowCancelledError" if ended == RUN_CANCELLED else "WorkflowRunEnded"
    assert (step.error or {}).get("type") == expected
    if ended == RUN_CANCELLED:
        assert step.error == CANCELLED  # the cancel's own error, as cancel_steps writes it
    # Fenced for good: no retry is ever due, a renewal and a settle of attempt 1 refused.
    assert store.claim_step(run_id, "charge", FN, T0 + 10 * LEASE, LEASE).state is None
    assert store.renew_leases([(run_id, "charge", 1)], T0 + 3, LEASE) == {(run_id, "charge")}
    with pytest.raises(WorkflowStepSupersededError):
        store.set_result(run_id, "charge", 1, "charged", T0 + 4)
    history = store.get_history(run_id)
    assert [(h.attempt, h.status) for h in history] == [(1, "failed")]


def test_a_claim_of_a_live_run_is_unchanged(store: WorkflowStore) -> None:
    run_id = new_run(store)
    add_step(store, run_id)
    claimed = store.claim_step(run_id, "charge", FN, T0 + 1, LEASE).state
    assert claimed is not None and claimed.status == "running"


# --- the window, on the real MongoDB store -------------------------------------------------


def _mongod_store(request: pytest.FixtureRequest) -> Iterator[MongoWorkflowStore]:
    db, client = mongo_database("mongod", request.getfixturevalue("mongo_server"))
    yield MongoWorkflowStore(db)
    client.drop_database(db.name)  # type: ignore[attr-defined]


@pytest.fixture
def mongod_store(request: pytest.FixtureRequest) -> Iterator[MongoWorkflowStore]:
    yield from _mongod_store(request)


@pytest.mark.parametrize("ended", [RUN_CANCELLED, RUN_COMPLETED])
def test_a_step_claimed_inside_the_fence_window_is_fenced(
        mongod_store: MongoWorkflowStore, ended: str) -> None:
    """The fence reads the step ``pending``; a claim (another worker, same database) lands;
    the fence's write, guarded on ``pending``, matches nothing. The claim must not stand."""
    store = mongod_store
    run_id = new_run(store)
    add_step(store, run_id)
    worker = MongoWorkflowStore(store.db, create_indexes=False)
    claims: list[Any] = []
    assert store.transition_run(run_id, [RUN_RUNNING], ended, T0 + 1)
    store._steps = _ClaimsAfterFenceRead(  # type: ignore[assignment]
        store._steps, lambda: claims.append(worker.claim_step(run_id, "charge", FN, T0 + 2,
                                                              LEASE).state))
    error = CANCELLED if ended == RUN_CANCELLED else {"type": "WorkflowRunEnded",
                                                      "message": "ended"}
    store.cancel_steps(run_id, error, T0 + 3)
    assert len(claims) == 1, "the claim did not land inside the fence's window"
    assert claims[0] is None, "a step of an ended run was claimed: its body would run"
    step = store.get_step(run_id, "charge")
    assert step is not None and (step.status, step.lease_expires_at) == ("failed", None)
    assert worker.renew_leases([(run_id, "charge", 1)], T0 + 4, LEASE) == {(run_id, "charge")}
    with pytest.raises(WorkflowStepSupersededError):
        worker.set_result(run_id, "charge", 1, "charged", T0 + 5)


# --- the window, end to end: a worker's delivery inside a cancel or a run's end -------------


class FakeClock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms


def _pikku(store: Any) -> PikkuCelery:
    clock = FakeClock()
    pikku = PikkuCelery(Celery(f"windows-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(clock_ms=clock),
                        step_lease=30, worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # type: ignore[attr-defined]  # follow the fake clock
    pikku.engine.dispatcher = Recorder()
    return pikku


@pytest.fixture
def mongod_pikku(mongod_store: MongoWorkflowStore) -> PikkuCelery:
    return _pikku(mongod_store)


@pytest.mark.parametrize("end", ["cancel", "complete"])
def test_a_delivery_inside_the_window_runs_no_body_and_records_nothing(
        mongod_pikku: PikkuCelery, end: str) -> None:
    """``pikku.cancel`` (or a run's completion, whose pass fences the steps it left
    behind): the step's message is delivered right after the fence read the steps. The
    body must not run, nothing is recorded, no heartbeat keeps the attempt alive."""
    pikku = mongod_pikku
    ran: list[Any] = []

    def body(data: Any) -> str:
        ran.append(data)
        return "charged"

    charge = pikku.step(name="windows.charge")(body)

    @pikku.workflow("windows.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge, data)

    run_id = pikku.start("windows.flow", {"n": 1})
    pikku.engine.advance(run_id)  # records and dispatches the step: pending
    store = pikku.engine.store
    assert isinstance(store, MongoWorkflowStore)
    outcomes: list[Any] = []

    def delivered() -> None:
        outcomes.append(pikku.engine.execute_step(pikku.registry.steps["windows.charge"],
                                                  run_id, "charge"))

    store._steps = _ClaimsAfterFenceRead(store._steps, delivered)  # type: ignore[assignment]
    if end == "cancel":
        assert pikku.cancel(run_id, "by a test")
        expected = ("cancelled", "WorkflowCancelledError")
    else:
        run = pikku.get_run(run_id)
        pikku.engine.finish(run, RUN_COMPLETED, output="done early")
        expected = ("completed", "WorkflowRunEnded")
    assert [o.kind for o in outcomes] == ["not_claimed"], outcomes
    assert ran == [], "the body ran on an ended run"
    assert pikku.engine.heartbeat.held() == [], "an attempt of an ended run is kept alive"
    step = pikku.get_steps(run_id)[0]
    assert (pikku.get_run(run_id).status, (step.error or {}).get("type")) == expected
    assert (step.status, step.result) == ("failed", None)
