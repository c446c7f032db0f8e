"""Mutants that survived issue 21's audit, each killed by a fast test here (see
docs/reliability.md, "Property tests: the store and claim layer"). The reclaim guard's mutant
is killed in tests/property/test_store_examples.py (it needs MongoDB's read-then-write), the
lease hand-back's in tests/contract/test_leases.py (every lease service)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine.claims import Claimed, Claimer
from pikku_celery.model.clock import ServerClock
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.model.records import RUN_CANCELLED
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.worker import tasks as tasks_module
from tests.unit.test_heartbeat_beats import Rig

# --- the heartbeat, when the store's renewal raised ---------------------------------------


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(monkeypatch)


def test_a_vanished_redis_lease_is_not_taken_back_when_the_store_renewal_failed(
        rig: Rig) -> None:
    """Redis lost the lease (a restart) while MongoDB is unreachable: the store could not
    confirm that this attempt still owns the step, so the heartbeat must not take the Redis
    lease back. If it did, the step's retry (the store lease lapses meanwhile, the reaper
    sends the step again) would find the Redis key taken and be dropped."""
    held = rig.claim("a", lease_ms=1_000).held  # store lease until T0 + 1000
    rig.leases.vanish = True
    rig.store.down = True
    rig.clock.ms += 900
    rig.heartbeat.beat([held])
    assert rig.redis_lease("a") is None  # not taken back unconfirmed
    assert not held.lost.is_set()  # kept until its last confirmed deadline, though
    # The worker is in fact gone (paused); MongoDB answers again, the store lease lapses,
    # and the reaper's re-delivery goes to another worker: the Redis key must be free.
    rig.leases.vanish = False
    rig.store.down = False
    rig.heartbeat.remove(held)
    rig.clock.ms += 101  # T0 + 1001: the store lease has lapsed
    other = Claimer(rig.store, rig.leases, ServerClock(rig.leases, resync_s=0),
                    rig.heartbeat)
    retried = other.claim("run", "a", "f", 1_000)
    assert isinstance(retried, Claimed) and retried.state.attempt == 2


# --- a pass that finds its run cancelled when it pauses -----------------------------------


class _Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


def _pikku(clock: _Clock) -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"m21-{uuid.uuid4().hex[:8]}", broker="memory://"),
                        store=InMemoryWorkflowStore(),
                        leases=InMemoryLeaseService(clock_ms=clock), worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # type: ignore[attr-defined]  # follow the fake clock
    return pikku


def test_a_paused_pass_that_finds_its_run_cancelled_fences_its_steps() -> None:
    """The touch of a paused pass reads the run's status: the second line of defence when a
    cancel's mark and wake were both lost (its writer died after the run's write, before
    the mark and the fence). The pass, woken for one step (its view current: it reads no
    run), pauses, finds the run cancelled there and fences what is unsettled."""
    clock = _Clock()
    pikku = _pikku(clock)
    work = pikku.step(name="m21.work")(lambda data: data)

    @pikku.workflow("m21.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("a", work, data)

    dispatched: list[str] = []
    pikku.engine.dispatcher = type("D", (), {
        "dispatch_step": lambda self, fn, run, step: dispatched.append(step),
        "wake_run": lambda self, *a, **kw: None,
        "arm_timer": lambda self, *a, **kw: None})()
    run_id = pikku.start("m21.flow", 1)
    assert pikku.engine.advance(run_id) == "dispatched" and dispatched == ["a"]
    # The cancel's writer stops after its first write: no mark, no wake, no fence.
    store = pikku.engine.store
    assert store.transition_run(run_id, ["running"], RUN_CANCELLED, clock.ms,
                                error={"type": "WorkflowCancelledError", "message": "c"})
    clock.ms += pikku.engine.settings.stalled_after_ms  # the pass's touch is due
    # It fences the step and marks the run, so it passes again and sees the run ended.
    assert pikku.engine.advance(run_id, step_name="a") == "cancelled"
    [step] = pikku.get_steps(run_id)
    assert step.status == "failed" and step.error is not None
    assert step.error["type"] == "WorkflowCancelledError"
    assert pikku.engine.execute_step(pikku.registry.steps["m21.work"], run_id,
                                     "a").kind == "not_claimed"  # its message runs nothing


# --- the Celery task adapter and a superseded attempt -------------------------------------


def test_the_step_task_reports_a_superseded_attempt_to_the_result_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A superseded attempt's task records which attempt it ran before it raises: the
    result backend fences on that number, so the stale outcome cannot replace the one a
    later attempt stored under the same task id. Without it the backend sees attempt 0."""
    clock = _Clock()
    pikku = _pikku(clock)
    store = pikku.engine.store

    @pikku.step(name="m21.slow")
    def slow(data: Any) -> Any:
        # While this body runs its lease lapses and another worker reclaims the step.
        clock.ms += pikku.engine.settings.step_lease_ms + 1
        rival = store.claim_step(run_id, "s", "m21.slow", clock.ms, 60_000)
        assert rival.state is not None and rival.state.attempt == 2
        return "stale"

    run_id = "m21-run"
    store.create_run(NewRun(run_id, "m21.none", None), clock.ms)
    store.insert_step(NewStep(run_id, "s", "m21.slow", max_attempts=3), clock.ms)
    recorded: list[tuple[str, int]] = []
    original = tasks_module.record_attempt

    def record(request: Any, attempt: int) -> None:
        recorded.append((request.id, attempt))
        original(request, attempt)

    monkeypatch.setattr(tasks_module, "record_attempt", record)
    outcome = slow.apply(args=(run_id, "s"), task_id="t-superseded")
    assert isinstance(outcome.result, WorkflowStepSupersededError)
    assert recorded == [("t-superseded", 1)]
