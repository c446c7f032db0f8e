"""Steps run in place (issue 24), in one process on the in-memory store and leases: a pass
whose dispatcher says it may runs the step it records itself, and the settle of each step
travels with the next step's claim. What must hold when that settle is refused (the
attempt was superseded while its body ran): the workflow went on with a result that was
never recorded, so nothing it did since may be written, and the run goes on from the
result the store holds (attempt 2's).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, LeaseLostError, PikkuCelery
from pikku_celery.leases.hold import _RENEWALS
from pikku_celery.model import keys
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from tests.contract.test_store import store

__all__ = ["store"]  # the fixture, parametrized over every store (the last test)

FAR = 10 ** 13  # a time past every lease: a claim then reclaims as the reaper would


class Worker:
    """Delivers what the engine sends, in order, as a worker's tasks would; while it
    delivers, the engine may run steps in place (``runs_here``)."""

    def __init__(self, pikku: PikkuCelery) -> None:
        self.pikku = pikku
        self.queue: deque[tuple[str, str, str | None]] = deque()
        self.sent: list[str] = []
        self.delivering = False
        pikku.engine.dispatcher = self

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        self.sent.append(step_name)
        self.queue.append(("step", run_id, step_name))

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self.queue.append(("run", run_id, step_name))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        """A claim refused because its step was not due yet re-arms the step's timer: the
        engine's estimate of the lease clock may run a few ms ahead of the clock the claim
        reads, so a retry made due "now" can be refused once (``execution``). The timer
        fires, as Celery's countdown would, once the lease clock reaches ``due_ms``."""
        wait_s = (due_ms - self.pikku.engine.leases.now_ms()) / 1000
        assert wait_s < 1.0, f"a timer {wait_s:.3f} s ahead: not a clock's jitter"
        time.sleep(max(0.0, wait_s))
        self.queue.append(("step", run_id, step_name))

    def runs_here(self, function: str, run_id: str, step_name: str) -> bool:
        return self.delivering

    def drain(self) -> None:
        engine = self.pikku.engine
        while self.queue:
            kind, run_id, step_name = self.queue.popleft()
            self.delivering = True
            try:
                if kind == "step":
                    assert step_name is not None
                    function = next(s.function for s in engine.get_steps(run_id)
                                    if s.step_name == step_name)
                    engine.execute_step(engine.registry.steps[function], run_id, step_name)
                else:
                    engine.advance(run_id, step_name=step_name)
            finally:
                self.delivering = False


def _app(store: Any = None) -> tuple[PikkuCelery, InMemoryWorkflowStore, Worker]:
    store = store if store is not None else InMemoryWorkflowStore()
    pikku = PikkuCelery(Celery("in-place", broker="memory://"), store=store,
                        leases=InMemoryLeaseService(), worker_reaper=False)
    return pikku, store, Worker(pikku)


def test_a_sequential_run_runs_in_place_with_no_message() -> None:
    pikku, _, worker = _app()

    @pikku.step(name="ip.inc")
    def inc(n: int) -> int:
        return n + 1

    @pikku.workflow("ip.count")
    def count(wf: Any, n: int) -> int:
        for i in range(n):
            n = wf.do(f"s{i}", inc, n)
        return n

    run_id = pikku.start("ip.count", 5)
    worker.drain()
    assert pikku.get_run(run_id).output == 10
    assert worker.sent == []  # every step ran in the start's pass
    assert [(h.step_name, h.status, h.result) for h in pikku.get_history(run_id)] == [
        (f"s{i}", "succeeded", 6 + i) for i in range(5)]


def stalling_step(pikku: PikkuCelery, store: Any, name: str, run: dict[str, str]) -> Any:
    """A step (one retry) whose attempt 1, given ``"stall"``, loses step ``a`` of the run
    ``run["id"]`` to attempt 2 while its body runs (the reaper's reclaim, as another worker
    would make it), then returns ``"attempt-1"``."""

    @pikku.step(name=name, retries=1)
    def first(tag: str) -> str:
        if tag == "stall":
            again = store.claim_step(run["id"], "a", name, FAR, 60_000)
            assert again.state is not None and again.state.attempt == 2
        return "attempt-1"

    return first


def test_a_refused_settle_voids_the_continuation_it_carried() -> None:
    """Attempt 1 of ``a`` is superseded while its body runs; its result travels with the
    claim of ``b``, reached with that result: the command is refused, ``b`` (whose data
    came from attempt 1) is never recorded, and ``b`` runs later with attempt 2's."""
    pikku, store, worker = _app()
    run: dict[str, str] = {}
    first = stalling_step(pikku, store, "ip.first", run)

    @pikku.step(name="ip.second")
    def second(value: str) -> str:
        return f"after {value}"

    @pikku.workflow("ip.pair")
    def pair(wf: Any, tag: str) -> str:
        return str(wf.do("b", second, wf.do("a", first, tag)))

    run_id = run["id"] = pikku.start("ip.pair", "stall", run_id="ip-pair")
    worker.drain()
    assert pikku.get_run(run_id).status == "running"
    steps = {s.step_name: s for s in pikku.get_steps(run_id)}
    assert set(steps) == {"a"}, steps  # nothing reached with attempt 1's result
    assert (steps["a"].status, steps["a"].attempt) == ("running", 2)
    history = [(h.step_name, h.attempt, h.status) for h in pikku.get_history(run_id)]
    assert history == [("a", 1, "failed"), ("a", 2, "running")]
    # Attempt 2 settles; the run goes on from its result.
    store.set_result(run_id, "a", 2, "attempt-2", FAR + 1)
    worker.queue.append(("run", run_id, "a"))
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "after attempt-2")


def test_a_refused_last_settle_does_not_end_the_run() -> None:
    """The last step's settle is written alone, before the run's end: refused, the run
    does not complete with the unrecorded result."""
    pikku, store, worker = _app()

    @pikku.step(name="ip.only", retries=1)
    def only(data: Any) -> str:
        assert store.claim_step(run_id, "only", "ip.only", FAR, 60_000).state is not None
        return "attempt-1"

    @pikku.workflow("ip.one")
    def one(wf: Any, data: Any) -> str:
        return str(wf.do("only", only, data))

    run_id = pikku.start("ip.one", None)
    worker.drain()
    assert pikku.get_run(run_id).status == "running"
    store.set_result(run_id, "only", 2, "attempt-2", FAR + 1)
    worker.queue.append(("run", run_id, "only"))
    worker.drain()
    run = pikku.get_run(run_id)
    assert (run.status, run.output) == ("completed", "attempt-2")


def test_in_place_steps_bounds_a_streak() -> None:
    pikku, _, worker = _app()
    pikku.engine.settings = type(pikku.engine.settings)(
        **{**vars(pikku.engine.settings), "in_place_steps": 3})

    @pikku.step(name="ip.echo")
    def echo(n: int) -> int:
        return n

    @pikku.workflow("ip.seven")
    def seven(wf: Any, data: Any) -> int:
        return sum(wf.do(f"s{i}", echo, i) for i in range(7))

    run_id = pikku.start("ip.seven", None)
    worker.drain()
    assert pikku.get_run(run_id).output == 21
    # s0-s2 in the start's pass, s3 sent; its task runs it and s4-s6 in place.
    assert worker.sent == ["s3"]


def test_a_streak_stops_at_the_next_step_once_its_run_lease_is_known_lost(
        store: WorkflowStore) -> None:
    """Issue 31 (d): while ``s0`` runs in place, another holder takes the run lease and the
    pass's renewal is refused. No later step of the streak runs here (its body would run
    beside the new holder's pass): the call ends with ``LeaseLostError`` after writing
    ``s0``'s settle, and the run goes on from it once the run is free."""
    pikku, _, worker = _app(store)
    leases = pikku.engine.leases
    key = keys.run_lease_key("ip-lost")
    ran: list[str] = []

    @pikku.step(name="ip.note")
    def note(name: str) -> str:
        ran.append(name)
        if name == "s0":
            held = leases.get(key)
            assert held is not None and leases.release(held)
            assert leases.acquire(key, "another-pass", 60_000) is not None
            renewing = [h for h in _RENEWALS._held.values() if h.key == key]
            assert len(renewing) == 1
            renewing[0].renew_once()  # the renewal thread's next turn: refused
            assert renewing[0].lost.is_set()
        return name

    @pikku.workflow("ip.notes")
    def notes(wf: Any, data: Any) -> list[str]:
        return [wf.do(f"s{i}", note, f"s{i}") for i in range(3)]

    run_id = pikku.start("ip.notes", None, run_id="ip-lost")
    with pytest.raises(LeaseLostError):
        worker.drain()
    assert ran == ["s0"]  # s1 was reached, never run here
    assert [(s.step_name, s.status) for s in pikku.get_steps(run_id)] == [("s0", "succeeded")]
    thief = leases.get(key)
    assert thief is not None and leases.release(thief)
    worker.queue.append(("run", run_id, None))
    worker.drain()
    assert pikku.get_run(run_id).output == ["s0", "s1", "s2"] and ran == ["s0", "s1", "s2"]


def test_a_streak_that_lost_its_run_lease_and_its_step_ends_without_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """As above, but the stalled worker's step was also taken by another attempt (the
    reaper's reclaim): the settle written as the call ends is refused. That is the
    expected end of a stalled streak, logged as a superseded attempt, not an error with a
    traceback (the real-worker test of a stalled step reads the worker's log for one)."""
    pikku, store, worker = _app()
    leases = pikku.engine.leases
    key = keys.run_lease_key("ip-both")

    @pikku.step(name="ip.taken", retries=1)
    def taken(name: str) -> str:
        if name == "s0":
            assert store.claim_step("ip-both", "s0", "ip.taken", FAR, 60_000).state
            held = leases.get(key)
            assert held is not None and leases.release(held)
            assert leases.acquire(key, "another-pass", 60_000) is not None
            [renewing] = [h for h in _RENEWALS._held.values() if h.key == key]
            renewing.renew_once()
        return name

    @pikku.workflow("ip.taken-twice")
    def flow(wf: Any, data: Any) -> list[str]:
        return [wf.do(f"s{i}", taken, f"s{i}") for i in range(2)]

    run_id = pikku.start("ip.taken-twice", None, run_id="ip-both")
    with caplog.at_level(logging.WARNING, "pikku_celery"), pytest.raises(LeaseLostError):
        worker.drain()
    assert "superseded" in caplog.text
    assert "could not be written" not in caplog.text and "Traceback" not in caplog.text
    steps = pikku.get_steps(run_id)
    assert [(s.step_name, s.status, s.attempt) for s in steps] == [("s0", "running", 2)]
