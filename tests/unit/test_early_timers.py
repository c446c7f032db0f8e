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

from typing import Any

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
