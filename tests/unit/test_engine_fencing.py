"""Engine-level fencing facts no test noticed (issue 13's surviving mutants): an expired
step's claim wakes its run at once, compensation gets ``retries + 1`` attempts like any
step, and the reaper never re-sends a step whose lease is live (on either store).

The lease clock is a fake the test moves, so no test sleeps or races a real clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
)
from tests.conftest import pooled_database
from tests.unit.test_engine import Recorder

T0 = 1_700_000_000_000
LEASE_MS = 1_000


class FakeClock:
    """The lease service's time, and the engine's clock on it: waiting for a time (an
    inline run's timer) moves it there. (A ``ServerClock`` over a time that never moves
    estimated a retry due a millisecond after the frozen time the claims are decided on,
    and an inline run under load re-armed that timer forever.)"""

    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms

    def now_ms(self) -> int:
        return self.ms

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        pass

    def sleep_until(self, due_ms: int) -> None:
        self.ms = max(self.ms, due_ms)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _pikku(clock: FakeClock, store: Any) -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"fencing-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=store, leases=InMemoryLeaseService(clock_ms=clock),
                        step_lease=LEASE_MS / 1000, undispatched_after=30, stalled_after=30,
                        worker_reaper=False)
    pikku.engine.clock = clock
    pikku.engine.dispatcher = Recorder()
    return pikku


@pytest.fixture(params=["memory", "mongod"])
def pikku(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[PikkuCelery]:
    if request.param == "memory":
        yield _pikku(clock, InMemoryWorkflowStore())
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield _pikku(clock, MongoWorkflowStore(db))


def _recorder(pikku: PikkuCelery) -> Recorder:
    recorder = pikku.engine.dispatcher
    assert isinstance(recorder, Recorder)
    return recorder


def _worker_dies_holding(pikku: PikkuCelery, run_id: str, step: str, function: str) -> None:
    """Claim the step as a worker that then dies: its heartbeat never renews the lease."""
    claimed = pikku.engine.claimer.claim(run_id, step, function, LEASE_MS)
    held = getattr(claimed, "held", None)
    assert held is not None, f"the claim of {step!r} was refused: {claimed}"
    pikku.engine.heartbeat.remove(held)


def test_an_expired_steps_claim_wakes_its_run_at_once(pikku: PikkuCelery,
                                                      clock: FakeClock) -> None:
    """A redelivery finds the last attempt's lease lapsed: the claim fails the step with
    WorkflowStepLeaseExpiredError and must wake the run then, so it fails (or compensates)
    now, not when the stalled-run sweep happens by (``stalled_after`` later)."""
    step = pikku.step(name="fencing.once", retries=0)(lambda data: "never")

    @pikku.workflow("fencing.expire")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", step)

    run_id = pikku.start("fencing.expire", None)
    pikku.engine.advance(run_id)
    _worker_dies_holding(pikku, run_id, "s", "fencing.once")
    clock.ms += LEASE_MS + 1
    recorder = _recorder(pikku)
    recorder.wakes.clear()
    outcome = pikku.engine.execute_step(pikku.registry.steps["fencing.once"], run_id, "s")
    assert outcome.kind == "not_claimed"
    state = pikku.get_steps(run_id)[0]
    assert (state.status, (state.error or {}).get("type")) == (
        "failed", "WorkflowStepLeaseExpiredError")
    assert recorder.wakes == [(run_id, 0.0)], "the expired step's run was not woken"
    assert pikku.engine.advance(run_id) == "failed"


def test_compensation_gets_retries_plus_one_attempts(pikku: PikkuCelery) -> None:
    attempts: list[int] = []

    @pikku.step(name="fencing.charge", retries=0)
    def charge(data: Any) -> None:
        raise ValueError("declined")

    @pikku.step(name="fencing.refund", retries=2, retry_delay=0, bind=True)
    def refund(ctx: Any, data: Any) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt <= 2:
            raise ConnectionError(f"refund api down (attempt {ctx.attempt})")
        return "refunded"

    @pikku.workflow("fencing.saga")
    def saga(wf: Any, data: Any) -> Any:
        return wf.do("charge", charge, on_error=refund)

    run_id = pikku.start("fencing.saga", None, inline=True)
    assert attempts == [1, 2, 3], "compensation must get retries + 1 = 3 attempts"
    comp = {s.step_name: s for s in pikku.get_steps(run_id)}["charge:on_error"]
    assert (comp.status, comp.attempt, comp.max_attempts, comp.result) == (
        "succeeded", 3, 3, "refunded")
    assert pikku.get_run(run_id).status == "failed"  # compensated, and the run still fails


def test_the_reaper_never_resends_a_step_under_a_live_lease(pikku: PikkuCelery,
                                                            clock: FakeClock) -> None:
    step = pikku.step(name="fencing.long")(lambda data: None)

    @pikku.workflow("fencing.reap")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", step)

    run_id = pikku.start("fencing.reap", None)
    pikku.engine.advance(run_id)
    _worker_dies_holding(pikku, run_id, "s", "fencing.long")
    recorder = _recorder(pikku)
    recorder.steps.clear()
    clock.ms += LEASE_MS  # the deadline itself: still held
    assert pikku.reap()["lapsed"] == 0
    assert recorder.steps == [], "the reaper re-sent a step whose lease is live"
    clock.ms += 1
    assert pikku.reap()["lapsed"] == 1
    assert recorder.steps == [("fencing.long", run_id, "s")]
