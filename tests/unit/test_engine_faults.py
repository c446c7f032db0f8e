"""Fault paths of the engine with a controllable lease clock: supersession mid-body (upstream
8-10), the reaper (20, 43, 44), and a failed dispatch (40)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowStepSupersededError,
)
from pikku_celery.worker.tasks import internal_task
from tests.unit.test_engine import Recorder

T0 = 1_700_000_000_000


class FakeClock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pikku(clock: FakeClock) -> Iterator[PikkuCelery]:
    app = Celery("faults", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(),
                        leases=InMemoryLeaseService(clock_ms=clock), step_lease=1.0,
                        undispatched_after=30, stalled_after=30, worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # follow the fake clock on every read
    pikku.engine.dispatcher = Recorder()
    yield pikku


def _one_step_workflow(pikku: PikkuCelery, body: Any) -> tuple[str, Any]:
    step = pikku.step(name="faults.body", bind=True, retries=3)(body)  # reclaimed: attempt 2

    @pikku.workflow("faults.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", step)

    run_id = pikku.start("faults.flow", None)
    pikku.engine.advance(run_id)
    return run_id, pikku.registry.steps["faults.body"]


@pytest.mark.parametrize("ending", ["error", "success"])
def test_9_10_a_body_superseded_mid_run_changes_nothing(pikku: PikkuCelery, clock: FakeClock,
                                                        ending: str) -> None:
    def body(ctx: Any, data: Any) -> str:
        # This worker stalls past its lease; another worker reclaims the step meanwhile.
        pikku.engine.store.claim_step(ctx.run_id, ctx.step_name, "faults.body",
                                      clock.ms + 5_000, 1_000)
        if ending == "error":
            raise RuntimeError("stale failure")
        return "stale result"

    run_id, definition = _one_step_workflow(pikku, body)
    recorder = pikku.engine.dispatcher
    recorder.wakes.clear()
    with pytest.raises(WorkflowStepSupersededError) as info:
        pikku.engine.execute_step(definition, run_id, "s")
    assert (info.value.attempt, info.value.current_attempt) == (1, 2)
    step = pikku.get_steps(run_id)[0]
    assert (step.status, step.attempt, step.result, step.error) == ("running", 2, None, None)
    assert pikku.get_run(run_id).status == "running"
    assert recorder.wakes == [] and recorder.timers == []  # nothing woken or retried


def test_20_the_reaper_redispatches_a_lapsed_step_once_per_lease(pikku: PikkuCelery,
                                                                 clock: FakeClock) -> None:
    run_id, _definition = _one_step_workflow(pikku, lambda ctx, data: None)
    held = pikku.engine.claimer.claim(run_id, "s", "faults.body", 1_000)
    pikku.engine.heartbeat.remove(held.held)  # the worker died: nobody renews
    recorder = pikku.engine.dispatcher
    recorder.steps.clear()
    assert pikku.reap()["lapsed"] == 0
    clock.ms += 1_001
    assert pikku.reap()["lapsed"] == 1
    assert recorder.steps == [("faults.body", run_id, "s")]
    assert pikku.reap()["lapsed"] == 0  # backed off for one lease
    clock.ms += 1_001
    assert pikku.reap()["lapsed"] == 1


def test_44_the_reaper_resends_a_pending_step_nobody_picked_up(pikku: PikkuCelery,
                                                               clock: FakeClock) -> None:
    run_id, _ = _one_step_workflow(pikku, lambda ctx, data: None)
    recorder = pikku.engine.dispatcher
    recorder.steps.clear()
    assert pikku.reap()["due"] == 0  # fresh: its message is probably in a queue
    clock.ms += 30_001
    assert pikku.reap()["due"] == 1
    assert recorder.steps == [("faults.body", run_id, "s")]


def test_43_the_reaper_wakes_a_run_whose_wake_up_was_lost(pikku: PikkuCelery,
                                                          clock: FakeClock) -> None:
    # A settle that sends a wake-up message (continue_in_place off), and the message lost.
    pikku.engine.settings = dataclasses.replace(pikku.engine.settings, continue_in_place=False)
    run_id, definition = _one_step_workflow(pikku, lambda ctx, data: "done")
    pikku.engine.execute_step(definition, run_id, "s")  # its wake-up message is lost
    recorder = pikku.engine.dispatcher
    recorder.wakes.clear()
    assert pikku.reap()["stalled"] == 0
    clock.ms += 30_001
    assert pikku.reap()["stalled"] == 1
    assert recorder.wakes == [(run_id, 0.0)]
    assert pikku.engine.advance(run_id) == "completed"
    clock.ms += 60_000
    assert pikku.reap()["stalled"] == 0  # settled runs are left alone


def test_one_stalled_sweep_judges_each_run_by_its_own_steps(pikku: PikkuCelery,
                                                            clock: FakeClock) -> None:
    """Three idle runs in one sweep (one touch and one read of unsettled steps for all):
    the one whose step holds a live lease is left alone, the one whose wake-up was lost and
    the one whose step lease lapsed are woken."""
    pikku.engine.settings = dataclasses.replace(pikku.engine.settings, continue_in_place=False)
    lost_wake, definition = _one_step_workflow(pikku, lambda ctx, data: "done")
    pikku.engine.execute_step(definition, lost_wake, "s")  # its wake-up message is lost
    live, lapsed = pikku.start("faults.flow", None), pikku.start("faults.flow", None)
    pikku.engine.advance(live)
    pikku.engine.advance(lapsed)
    store = pikku.engine.store
    assert store.claim_step(live, "s", "faults.body", clock.ms, 10 * 60_000).state
    assert store.claim_step(lapsed, "s", "faults.body", clock.ms, 1_000).state
    recorder = pikku.engine.dispatcher
    recorder.wakes.clear()
    clock.ms += 30_001
    assert pikku.reap()["stalled"] == 2
    assert sorted(run for run, _ in recorder.wakes) == sorted([lost_wake, lapsed])
    assert pikku.reap()["stalled"] == 0  # touched by the sweep: not idle again yet


def test_43_a_run_with_a_live_step_is_not_woken(pikku: PikkuCelery, clock: FakeClock) -> None:
    run_id, _ = _one_step_workflow(pikku, lambda ctx, data: None)
    pikku.engine.claimer.claim(run_id, "s", "faults.body", 120_000)  # live, renewed lease
    clock.ms += 31_000
    recorder = pikku.engine.dispatcher
    recorder.wakes.clear()
    assert pikku.reap() == {"events": 0, "slots": 0, "lapsed": 0, "due": 0, "stalled": 0}
    assert recorder.wakes == []


def test_40_a_failed_dispatch_leaves_the_step_pending_and_the_run_running(
        pikku: PikkuCelery) -> None:
    class BrokerDown(Recorder):
        def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
            raise ConnectionError("broker unreachable")

    pikku.engine.dispatcher = BrokerDown()
    step = pikku.step(name="faults.never")(lambda data: None)

    @pikku.workflow("faults.dispatch")
    def flow(wf: Any, data: Any) -> Any:
        try:
            return wf.do("s", step)
        except Exception as exc:  # a body catching errors cannot hide a failed dispatch
            return f"swallowed {type(exc).__name__}"

    run_id = pikku.start("faults.dispatch", None)
    with pytest.raises(ConnectionError, match="broker unreachable"):
        pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "running"
    assert [s.status for s in pikku.get_steps(run_id)] == ["pending"]


def test_a_pass_resends_a_pending_step_whose_message_was_lost(pikku: PikkuCelery,
                                                              clock: FakeClock) -> None:
    run_id, _ = _one_step_workflow(pikku, lambda ctx, data: None)
    recorder = pikku.engine.dispatcher
    recorder.steps.clear()
    pikku.engine.advance(run_id)
    assert recorder.steps == []  # fresh: its message is probably in a queue
    clock.ms += 30_001
    pikku.engine.advance(run_id)
    assert recorder.steps == [("faults.body", run_id, "s")]


def test_52_a_graph_node_whose_worker_died_is_dispatched_again(pikku: PikkuCelery,
                                                               clock: FakeClock) -> None:
    node = pikku.step(name="faults.node", retries=1)(lambda data: "node done")  # runs again
    pikku.graph("faults.graph", nodes={"a": node, "b": node}, edges=[("a", "b")])
    run_id = pikku.start("faults.graph", None)
    pikku.engine.advance(run_id)
    held = pikku.engine.claimer.claim(run_id, "a", "faults.node", 1_000)
    pikku.engine.heartbeat.remove(held.held)  # the worker running node "a" died
    recorder = pikku.engine.dispatcher
    recorder.steps.clear()
    clock.ms += 1_001
    pikku.engine.advance(run_id)  # the planner sees the lapsed lease and re-sends the node
    assert recorder.steps == [("faults.node", run_id, "a")]
    definition = pikku.registry.steps["faults.node"]
    assert pikku.engine.execute_step(definition, run_id, "a").attempt == 2
    pikku.engine.advance(run_id)
    pikku.engine.execute_step(definition, run_id, "b")
    assert pikku.engine.advance(run_id) == "completed"
    assert [(h.step_name, h.attempt, h.status) for h in pikku.get_history(run_id)] == [
        ("a", 1, "failed"), ("a", 2, "succeeded"), ("b", 1, "succeeded")]


def test_13_a_graph_run_leased_elsewhere_is_marked_not_planned(pikku: PikkuCelery) -> None:
    from pikku_celery.model import keys

    node = pikku.step(name="faults.g13")(lambda data: None)
    pikku.graph("faults.g13", nodes={"a": node}, edges=[])
    run_id = pikku.start("faults.g13", None)
    recorder = pikku.engine.dispatcher
    recorder.wakes.clear()
    recorder.steps.clear()
    held = pikku.engine.leases.acquire(keys.run_lease_key(run_id), "elsewhere", 60_000)
    assert held is not None
    assert internal_task(pikku.app, "orchestrate").run(run_id) == "marked"
    assert recorder.steps == []  # nothing planned: the holder plans, with the mark
    assert [countdown > 60 for _, countdown in recorder.wakes] == [True]  # the grant's watch
    assert pikku.engine.leases.release_or_take_marks(held, 60_000) == ("$all",)


def test_42_retry_delays_are_fixed_when_set_and_exponential_otherwise() -> None:
    from pikku_celery.workflow.definitions import make_step

    fixed = make_step(lambda d: d, "f", retries=3, retry_delay="250ms", lease=None, bind=False)
    backoff = make_step(lambda d: d, "b", retries=30, retry_delay=None, lease=None, bind=False)
    assert [fixed.delay_before(n) for n in (2, 3, 4)] == [250, 250, 250]
    assert [backoff.delay_before(n) for n in (2, 3, 4, 5)] == [1000, 2000, 4000, 8000]
    assert backoff.delay_before(30) == 300_000  # capped at five minutes
    assert fixed.delay_before(2, override_ms=0) == 0  # wf.do(retry_delay=...) wins
