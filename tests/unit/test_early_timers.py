"""A retry's timer that fires early is armed again (issue 31, "tests that hang under load").

A process reads the lease service's time through an estimate (``clock.ServerClock``: the
server's time anchored to the local monotonic clock at each sample, placed half-way through
the sample's round trip). A claim, though, is decided on the exact server time its lease
grant returns. When a sample's round trip stalls before the server read its clock (a
loaded machine), the estimate runs ahead of the server by up to half the stall: a retry's
timer then fires (``gates.fire_timer``: due on the estimate) a few milliseconds before the
retry is due on the server, and its claim is refused as not due yet. Nothing armed the
timer again, so only a reaper sweep would have sent the retry; an inline run has no reaper
and waited forever. That is why ``test_engine.py::test_39_...`` and
``test_graph.py::test_a_node_that_fails_for_good_fails_the_run`` hung under load.

Here the estimate is ahead of the lease service by a fixed amount until a lease grant
re-anchors it, as ``ServerClock.observe`` does; nothing depends on real time.
"""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, PikkuCelery
from pikku_celery.store.base import WorkflowStore
from pikku_celery.worker.inline import InlineDispatcher
from tests.contract.test_store import store

__all__ = ["store"]  # the fixture, parametrized over every store

START_MS = 1_800_000_000_000


class ServerTime:
    """The lease service's clock, moved by hand."""

    def __init__(self) -> None:
        self.ms = START_MS

    def __call__(self) -> int:
        return self.ms


class AheadEstimate:
    """This process's estimate of the server's time: ``ahead`` ms ahead of it until the
    next observation re-anchors it. Sleeping moves the server's time to the instant the
    estimate waited for."""

    def __init__(self, server: ServerTime) -> None:
        self.server = server
        self.ahead = 0

    def now_ms(self) -> int:
        return self.server() + self.ahead

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        self.ahead = 0

    def sleep_until(self, due_ms: int) -> None:
        self.server.ms = max(self.server.ms, due_ms - self.ahead)


def test_a_retry_whose_timer_fired_early_is_armed_again_and_runs(
        store: WorkflowStore) -> None:
    server = ServerTime()
    estimate = AheadEstimate(server)
    pikku = PikkuCelery(Celery("early-timers", broker="memory://"), worker_reaper=False)
    engine = pikku.make_engine(store=store,
                               leases=InMemoryLeaseService(clock_ms=server), clock=estimate)
    calls: list[int] = []

    @pikku.step(name="early.flaky", retries=2, retry_delay="10ms", bind=True)
    def flaky(ctx: Any, data: Any) -> str:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise ConnectionError("try 1")
        return "ok"

    @pikku.workflow("early.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("flaky", flaky)

    dispatcher = InlineDispatcher(engine)
    engine.dispatcher = dispatcher
    run_id = engine.create_run("early.flow", None)[0].run_id
    dispatcher.wake_run(run_id)
    while dispatcher.queue:  # the pass, attempt 1 (fails), its retry's timer armed
        dispatcher.do_next()
    assert calls == [1] and len(dispatcher.timers) == 1
    # The estimate runs 5 ms ahead (a re-anchor on a stalled sample): the timer fires,
    # and its delivery's claim, on the server's time, finds the retry 5 ms from due.
    estimate.ahead = 5
    for _ in range(20):  # a bound: each round does one queued item or one timer
        if not dispatcher.do_next():
            break
    assert calls == [1, 2], engine.get_steps(run_id)
    run = engine.get_run(run_id)
    assert (run.status, run.output) == ("completed", "ok")


@pytest.mark.parametrize("gate", ["sleep", "approval expiry", "event timeout"])
def test_a_sleep_or_expiry_whose_timer_fired_ahead_of_its_pass_is_armed_again(
        store: WorkflowStore, gate: str) -> None:
    """The timer fires in a process whose estimate is ahead (due there), and the pass it
    wakes runs in one whose estimate is behind (not due there): the pass pauses, and
    without a timer armed again nothing would wake the run (seen in
    ``test_on_rabbitmq_steps_run_in_place_are_one_trace_per_run``: a run left waiting
    on its ``nap`` with the reaper off)."""
    server = ServerTime()
    estimate = _Unanchored(server)
    pikku = PikkuCelery(Celery("early-sleeps", broker="memory://"), worker_reaper=False)
    engine = pikku.make_engine(store=store,
                               leases=InMemoryLeaseService(clock_ms=server), clock=estimate)

    @pikku.workflow("early.nap")
    def flow(wf: Any, data: Any) -> Any:
        if gate == "sleep":
            wf.sleep("nap", "10ms")
            return "rested"
        if gate == "approval expiry":
            return wf.approval("ok", expiry="10ms")
        return wf.wait_for_event("go", timeout="10ms", default="timed out")

    dispatcher = _BehindAtThePass(engine, estimate)
    engine.dispatcher = dispatcher
    run_id = engine.create_run("early.nap", None)[0].run_id
    dispatcher.wake_run(run_id)
    while dispatcher.queue:  # the pass records the gate and arms its timer
        dispatcher.do_next()
    assert len(dispatcher.timers) == 1
    for _ in range(20):  # a bound: each round does one queued item or one timer
        if not dispatcher.do_next():
            break
    run = engine.get_run(run_id)
    expected = {"sleep": "rested", "approval expiry": {"expired": True},
                "event timeout": "timed out"}[gate]
    assert (run.status, run.output) == ("completed", expected), engine.get_steps(run_id)
    assert dispatcher.early_passes >= 2  # the first timer's pass found it not due


class _Unanchored(AheadEstimate):
    """An estimate a lease grant does not correct: the re-anchor's own round trip stalled
    as much as the sample it replaces (what is left of a disagreement after each
    process's last sample)."""

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        pass


class _BehindAtThePass(InlineDispatcher):
    """Timers fire 5 ms ahead of the lease service; the passes they wake run 5 ms behind
    it (two processes' estimates, each re-anchored on a stalled sample). A timer is a
    countdown: due on the estimate of the process that armed it."""

    def __init__(self, engine: Any, estimate: AheadEstimate) -> None:
        super().__init__(engine)
        self.estimate = estimate
        self.early_passes = 0

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        heapq.heappush(self.timers, (due_ms - self.estimate.ahead, "timer",
                                     f"{run_id}\x00{step_name}"))

    def _fire(self, timer: tuple[int, str, str]) -> None:
        server_due, _, target = timer
        self.estimate.server.ms = max(self.estimate.server.ms, server_due)
        self.estimate.ahead = 5
        run_id, step_name = target.split("\x00")
        self._engine.fire_timer(run_id, step_name, dispatcher=self)

    def do_next(self) -> bool:
        if self.queue and self.queue[0][0] == "run":
            woken = bool(self.queue[0][1])  # by a timer's mark: in the process behind
            self.estimate.ahead = -5 if woken else 0
            self.early_passes += woken
        return super().do_next()
