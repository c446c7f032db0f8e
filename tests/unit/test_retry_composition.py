"""A retry composed with the other primitives (issue 31, defects 1, 3 and 4), on the
in-memory store and the real ``mongod``, driven as workers would run it
(``tests.unit.test_in_place.Worker`` delivers every message) with a clock the test moves:

- a wait the run had not passed (an event wait, an approval, a sleep) waits again after a
  retry, until its own deadline, instead of ending at once with its default;
- a retried run of a limited workflow never runs beside another run of its key beyond the
  limit, whatever a reaper's sweep or a start does while the retry is under way;
- a retry landing between a run's end and the end's fence of its steps is not undone by
  that fence: the run it revived goes on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
)
from pikku_celery.model.records import RUN_RUNNING, RUN_SUSPENDED
from pikku_celery.store import _retry
from pikku_celery.store._slots import holder_run, slot_id
from pikku_celery.workflow import replay
from tests.conftest import pooled_database
from tests.unit.test_in_place import Worker

T0 = 1_700_000_000_000
MINUTE = 60_000
LIVE = (RUN_RUNNING, RUN_SUSPENDED)


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms


class TimedWorker(Worker):
    """A ``Worker`` whose timers are kept, not refused: the test moves the clock and wakes
    the run as a timer (or the reaper) would."""

    def __init__(self, pikku: PikkuCelery) -> None:
        super().__init__(pikku)
        self.timers: list[tuple[str, str, int]] = []

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self.timers.append((run_id, step_name, due_ms))


@pytest.fixture(params=["memory", "mongod"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        yield InMemoryWorkflowStore()
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield MongoWorkflowStore(db)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _app(store: Any, clock: Clock) -> tuple[PikkuCelery, TimedWorker]:
    pikku = PikkuCelery(Celery(f"rc-{uuid.uuid4().hex[:8]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(clock_ms=clock),
                        worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # follow the test's clock on every read
    return pikku, TimedWorker(pikku)


def _status(pikku: PikkuCelery, run_id: str) -> str:
    return pikku.get_run(run_id).status


def test_the_store_knows_every_wait_prefix_replay_records() -> None:
    """``store._retry`` repeats ``replay``'s prefixes (``replay`` imports the store)."""
    assert set(_retry.WAIT_PREFIXES) == {replay.APPROVAL_PREFIX, replay.EVENT_PREFIX}
    assert set(_retry.NO_DEADLINE_PREFIXES) == {replay.SUSPEND_PREFIX, replay.PUBLISH_PREFIX}


# --- defect 1: a reopened wait waits ------------------------------------------------------


def _order_app(store: Any, clock: Clock) -> tuple[PikkuCelery, TimedWorker]:
    pikku, worker = _app(store, clock)

    @pikku.step(name="rc.ship")
    def ship(payment: Any) -> Any:
        return {"shipped_with": payment}

    @pikku.workflow("rc.order")
    def order(wf: Any, data: Any) -> Any:
        payment = wf.wait_for_event("paid", timeout=data.get("timeout"),
                                    default="NO-PAYMENT")
        return wf.do("ship", ship, payment)

    return pikku, worker


def _cancel_and_retry(pikku: PikkuCelery, worker: Worker, run_id: str) -> None:
    assert pikku.cancel(run_id, "by mistake")
    worker.drain()
    assert _status(pikku, run_id) == "cancelled"
    assert pikku.retry(run_id)
    worker.drain()


def test_a_retried_event_wait_waits_for_its_event(store: Any, clock: Clock) -> None:
    pikku, worker = _order_app(store, clock)
    run_id = pikku.start("rc.order", {})
    worker.drain()
    assert _status(pikku, run_id) == "suspended"
    _cancel_and_retry(pikku, worker, run_id)
    run = pikku.get_run(run_id)
    assert run.status == "suspended", run.output  # not shipped with the default
    pikku.send_event(run_id, "paid", "card-1")
    worker.drain()
    assert pikku.get_run(run_id).output == {"shipped_with": "card-1"}


def test_a_retried_event_wait_with_a_timeout_waits_until_its_own_expiry(
        store: Any, clock: Clock) -> None:
    pikku, worker = _order_app(store, clock)
    run_id = pikku.start("rc.order", {"timeout": "1h"})
    worker.drain()
    clock.ms += 10 * MINUTE
    _cancel_and_retry(pikku, worker, run_id)
    assert _status(pikku, run_id) == "suspended"
    clock.ms = T0 + 59 * MINUTE  # a timer, or the reaper, wakes the run early
    worker.wake_run(run_id)
    worker.drain()
    assert _status(pikku, run_id) == "suspended"
    clock.ms = T0 + 61 * MINUTE  # past the expiry the wait was recorded with
    worker.wake_run(run_id)
    worker.drain()
    assert pikku.get_run(run_id).output == {"shipped_with": "NO-PAYMENT"}


def test_a_retried_approval_waits_for_its_decision(store: Any, clock: Clock) -> None:
    pikku, worker = _app(store, clock)

    @pikku.workflow("rc.approved")
    def approved(wf: Any, data: Any) -> Any:
        return wf.approval("manager", expiry="1h")

    run_id = pikku.start("rc.approved", None)
    worker.drain()
    clock.ms += 10 * MINUTE
    _cancel_and_retry(pikku, worker, run_id)
    assert _status(pikku, run_id) == "suspended"
    pikku.approve(run_id, "manager", {"ok": True})
    worker.drain()
    assert pikku.get_run(run_id).output == {"ok": True}


def test_a_retried_sleep_sleeps_until_its_own_end(store: Any, clock: Clock) -> None:
    pikku, worker = _app(store, clock)
    woke: list[int] = []

    @pikku.step(name="rc.after")
    def after(data: Any) -> str:
        woke.append(clock.ms)
        return "awake"

    @pikku.workflow("rc.nap")
    def nap(wf: Any, data: Any) -> Any:
        wf.sleep("nap", "1h")
        return wf.do("after", after, None)

    run_id = pikku.start("rc.nap", None)
    worker.drain()
    clock.ms += 10 * MINUTE
    _cancel_and_retry(pikku, worker, run_id)
    assert woke == [] and not pikku.get_run(run_id).is_terminal
    clock.ms = T0 + 61 * MINUTE
    worker.wake_run(run_id)
    worker.drain()
    assert pikku.get_run(run_id).output == "awake" and woke == [T0 + 61 * MINUTE]


# --- defect 3: a retry never breaks a concurrency limit -------------------------------------


def _limited_app(store: Any, clock: Clock) -> tuple[PikkuCelery, TimedWorker]:
    pikku, worker = _app(store, clock)

    @pikku.workflow("rc.limited", concurrency=1, concurrency_key=lambda data: data["key"])
    def limited(wf: Any, data: Any) -> Any:
        if data.get("fail"):
            raise RuntimeError("boom")
        return wf.wait_for_event("done")

    return pikku, worker


def _live_and_held(pikku: PikkuCelery, key: str) -> tuple[set[str], set[str]]:
    live = {r.run_id for r in pikku.list_runs(workflow="rc.limited", limit=100)
            if r.status in LIVE and r.input["key"] == key}
    holders = pikku.engine.store.slot_holders(slot_id("rc.limited", key))
    return live, {holder_run(holder)[0] for holder in holders}


def _before_first(store: Any, method: str, meanwhile: Callable[[], None]) -> None:
    """Run ``meanwhile`` once, just before the store's next call of ``method``."""
    real = getattr(store, method)
    pending = [meanwhile]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if pending:
            pending.pop()()
        return real(*args, **kwargs)

    setattr(store, method, wrapped)


def test_a_sweep_and_a_start_during_a_retry_never_run_two_of_a_key(
        store: Any, clock: Clock) -> None:
    pikku, worker = _limited_app(store, clock)
    failed = pikku.start("rc.limited", {"key": "ann", "fail": True})
    worker.drain()
    assert _status(pikku, failed) == "failed"
    started: list[str] = []

    def sweep_then_start() -> None:  # every worker's reaper sweeps; a caller starts a run
        pikku.engine.reap(worker)
        started.append(pikku.start("rc.limited", {"key": "ann"}))

    _before_first(store, "retry_run", sweep_then_start)
    assert pikku.retry(failed)
    live, held = _live_and_held(pikku, "ann")
    assert len(live) <= 1 and live <= held, (live, held)  # before any message is delivered
    worker.drain()
    live, held = _live_and_held(pikku, "ann")
    assert len(live) <= 1 and live <= held, (live, held)
    assert live == set(started) and _status(pikku, failed) == "queued"
    pikku.send_event(started[0], "done")
    worker.drain()  # its end admits the retried run, which fails again and frees the slot
    assert _status(pikku, failed) == "failed"
    assert _live_and_held(pikku, "ann") == (set(), set())


def test_a_retry_between_a_cancel_and_its_slots_release_keeps_the_limit(
        store: Any, clock: Clock) -> None:
    """The cancel gives the slot back after its fence; a retry landing before that (found
    by the model-based test) revives the run in a new life, whose slot the cancel's late
    release does not give away: the next queued run is not let in beside it."""
    pikku, worker = _limited_app(store, clock)
    first = pikku.start("rc.limited", {"key": "ann"})
    clock.ms += 1  # the queue's order is the runs' creation time (ties: by run id)
    waiting = pikku.start("rc.limited", {"key": "ann"})
    worker.drain()
    assert (_status(pikku, first), _status(pikku, waiting)) == ("suspended", "queued")
    _before_first(store, "cancel_steps", lambda: pikku.retry(first))
    assert pikku.cancel(first, "by mistake")
    live, held = _live_and_held(pikku, "ann")
    assert len(live) <= 1 and live <= held, (live, held)
    worker.drain()
    live, held = _live_and_held(pikku, "ann")
    assert live == held == {first} and _status(pikku, waiting) == "queued"
    pikku.send_event(first, "done")
    worker.drain()
    assert _live_and_held(pikku, "ann") == ({waiting}, {waiting})


def test_the_sweep_gives_back_the_slot_of_an_ended_life(store: Any, clock: Clock) -> None:
    """A cancel whose writer stopped after the run's end, before its release: the ended
    life still holds the slot, so the retried run waits queued; the sweep gives that slot
    back (its holder's life is over) and admits the run in its new life, and the run's end
    leaves no slot behind."""
    pikku, worker = _limited_app(store, clock)
    first = pikku.start("rc.limited", {"key": "ann"})
    worker.drain()
    assert store.transition_run(first, LIVE, "cancelled", clock.ms)  # then the ender stopped
    assert pikku.retry(first) and _status(pikku, first) == "queued"
    slot = slot_id("rc.limited", "ann")
    assert store.slot_holders(slot) == [first]  # the ended life's
    pikku.engine.reap(worker)
    worker.drain()
    assert store.slot_holders(slot) == [f"{first} #1"] and _status(pikku, first) == "suspended"
    pikku.send_event(first, "done")
    worker.drain()
    assert _status(pikku, first) == "completed" and store.slot_holders(slot) == []


# --- defect 4: a retry inside an end's fence window stands --------------------------------


def test_a_retry_between_a_cancel_and_its_fence_is_not_undone(
        store: Any, clock: Clock) -> None:
    pikku, worker = _order_app(store, clock)
    run_id = pikku.start("rc.order", {})
    worker.drain()
    retried: list[bool] = []
    _before_first(store, "cancel_steps", lambda: retried.append(pikku.retry(run_id)))
    assert pikku.cancel(run_id, "by mistake")
    worker.drain()
    assert retried == [True]
    gate = next(s for s in pikku.get_steps(run_id) if s.step_name == "__event:paid")
    assert (gate.status, gate.error) == ("scheduled", None)  # reopened, not fenced again
    assert _status(pikku, run_id) == "suspended"
    pikku.send_event(run_id, "paid", "card-2")
    worker.drain()
    assert pikku.get_run(run_id).output == {"shipped_with": "card-2"}


def test_a_late_fence_of_a_failed_run_leaves_what_a_retry_reopened(
        store: Any, clock: Clock) -> None:
    """The writer that ended a run fences its leftovers after its end (``finish``), and
    whoever finds the run ended does it again: a fence that lands after a retry revived the
    run (the writer stopped in between, then went on) fences nothing the retry reopened."""
    pikku, worker = _app(store, clock)
    fixed = {"yet": False}

    @pikku.step(name="rc.flaky", retries=0)
    def flaky(data: Any) -> str:
        if not fixed["yet"]:
            raise RuntimeError("the bug")
        return "fixed"

    @pikku.workflow("rc.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("b", flaky, data)

    run_id = pikku.start("rc.flow", None)
    worker.drain()
    assert _status(pikku, run_id) == "failed"
    fixed["yet"] = True
    assert pikku.retry(run_id)
    pikku.engine.fence_leftovers(run_id, "failed")  # the ender's fence, late
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "fixed")


# --- a retried step parked on a child run --------------------------------------------------


def test_a_retried_child_step_is_settled_as_its_new_attempt(store: Any, clock: Clock) -> None:
    """A parent cancelled while its step waits on a child run, then retried: the step is
    parked again as attempt 2, and the child's end settles attempt 2, leaving attempt 1's
    history entry as the cancel closed it (found by the model-based test)."""
    pikku, worker = _app(store, clock)

    @pikku.workflow("rc.kid")
    def kid(wf: Any, data: Any) -> Any:
        return wf.wait_for_event("go")

    @pikku.workflow("rc.parent")
    def parent(wf: Any, data: Any) -> Any:
        return {"kid": wf.child("kid", "rc.kid", None)}

    run_id = pikku.start("rc.parent", None)
    worker.drain()
    step = next(s for s in pikku.get_steps(run_id) if s.step_name == "kid")
    assert step.child_run_id is not None
    child = step.child_run_id
    _cancel_and_retry(pikku, worker, run_id)
    assert _status(pikku, child) == "suspended"  # retried with its parent
    pikku.send_event(child, "go", "went")
    worker.drain()
    assert pikku.get_run(run_id).output == {"kid": "went"}
    entries = [(h.attempt, h.status) for h in pikku.get_history(run_id)
               if h.step_name == "kid"]
    assert entries == [(1, "failed"), (2, "succeeded")]
