"""Two schedule firers on either side of the catch-up boundary (issue 31, (c)), on every
store.

Both read the schedule at its next tick N. The early one's clock says N is on time, so it
fires N (and the ticks after it that are on time too); the late one's says N was missed,
so with ``catch_up="latest"`` it fires only the latest tick L and skips N up to L. Either
decision is right alone. Together they must still give one run per tick, and a tick the
late firer skipped must never start a run *after* L's run was created: a firer that
created its tick's run before claiming the tick did exactly that when the other firer ran
between its decision and its create (the early firer's N after L), or between its create
and its claim (the late firer's L before the early one's N, N+1, ...).

Every interleaving of the two is tried: one firer is stopped before each of its store
calls in turn (and its run creations), the other fires its whole round there, and the
first goes on. Nothing here depends on real time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, PikkuCelery
from pikku_celery.model import keys
from pikku_celery.schedules.firing import MISSED_AFTER_MS, Scheduler
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import store

__all__ = ["store"]  # the fixture, parametrized over every store

EVERY_MS = 1000
N = 1_800_000_000_000  # the tick both firers read
EARLY_NOW = N + 5 * EVERY_MS  # N (and up to N+5 s) on time
LATE_NOW = N + MISSED_AFTER_MS + 10 * EVERY_MS  # N missed: only the latest, L, fires
LATEST = LATE_NOW


class _Quiet:
    """The dispatcher: a run's wake-up is no concern of these tests."""

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        pass

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        pass

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        pass


class _Interrupted:
    """Forwards to ``target``; before the ``at``-th call counted by ``calls`` (shared with
    the host's other interrupted part), runs ``meanwhile`` once."""

    def __init__(self, target: Any, calls: list[int], at: int,
                 meanwhile: Callable[[], object]) -> None:
        self._target, self._calls, self._at, self._meanwhile = target, calls, at, meanwhile

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._target, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls[0] += 1
            if self._calls[0] == self._at:
                self._meanwhile()
            return found(*args, **kwargs)
        return call


class _Firer:
    """A worker's view for a ``Scheduler``: the engine's store and runs (each call counted
    and maybe interrupted), its own clock."""

    def __init__(self, engine: Any, now: int, *, at: int = 0,
                 meanwhile: Callable[[], object] = lambda: None) -> None:
        self.calls = [0]
        self.store = _Interrupted(engine.store, self.calls, at, meanwhile)
        self.runs = _Interrupted(engine.runs, self.calls, at, meanwhile)
        self.registry = engine.registry
        self.dispatcher = _Quiet()
        self._now = now

    def now_ms(self) -> int:
        return self._now


def _round(store: WorkflowStore, stopped: str, at: int) -> tuple[list[int], Any]:
    """One schedule of its own on ``store``; the ``stopped`` firer ("early" or "late") is
    interrupted before its ``at``-th call by the other's whole round. The ticks whose runs
    were created, in the order they were; and the engine."""
    name = f"edge-{uuid.uuid4().hex[:8]}"
    pikku = PikkuCelery(Celery(name, broker="memory://"), store=store,
                        leases=InMemoryLeaseService(), worker_reaper=False)

    @pikku.workflow("edge.report")
    def report(wf: Any, data: Any) -> Any:
        return data

    pikku.schedule(name, "edge.report", every=f"{EVERY_MS}ms")
    engine = pikku.engine
    store.save_schedule(pikku.registry.schedules[name].stored(), N, N - 1)
    created: list[int] = []
    original = engine.runs.create_run

    def create_run(*args: Any, **kwargs: Any) -> Any:
        run, made = original(*args, **kwargs)
        if made:
            created.append(kwargs["scheduled"][1])
        return run, made

    engine.runs.create_run = create_run  # type: ignore[method-assign]
    other_now, own_now = (LATE_NOW, EARLY_NOW) if stopped == "early" else (EARLY_NOW,
                                                                            LATE_NOW)
    other = Scheduler(_Firer(engine, other_now))
    Scheduler(_Firer(engine, own_now, at=at,
                     meanwhile=other.fire_due)).fire_due()
    return created, engine


def _calls_of_a_round(store: WorkflowStore, stopped: str) -> int:
    """How many calls the ``stopped`` firer makes when nobody interrupts it."""
    name = f"count-{uuid.uuid4().hex[:8]}"
    pikku = PikkuCelery(Celery(name, broker="memory://"), store=store,
                        leases=InMemoryLeaseService(), worker_reaper=False)
    pikku.workflow("edge.report")(lambda wf, data: data)
    pikku.schedule(name, "edge.report", every=f"{EVERY_MS}ms")
    store.save_schedule(pikku.registry.schedules[name].stored(), N, N - 1)
    firer = _Firer(pikku.engine, EARLY_NOW if stopped == "early" else LATE_NOW)
    Scheduler(firer).fire_due()
    return firer.calls[0]


@pytest.mark.parametrize("stopped", ["early", "late"])
def test_firers_either_side_of_the_catch_up_boundary_start_ticks_in_order(
        store: WorkflowStore, stopped: str) -> None:
    rounds = _calls_of_a_round(store, stopped)
    assert rounds >= 3  # a read, a claim, a create at least
    for at in range(1, rounds + 1):
        created, engine = _round(store, stopped, at)
        where = f"the {stopped} firer stopped before its call {at}: runs of {created}"
        assert len(created) == len(set(created)), where  # one run per tick
        assert created == sorted(created), where  # never a skipped tick after the latest
        assert created[-1] == LATEST, where  # the late firer's latest tick has its run
        assert all(t <= EARLY_NOW for t in created[:-1]), where  # on time, or none
        [name] = engine.registry.schedules
        assert engine.get_run(keys.scheduled_run_id(name, LATEST)).status == "running"
        schedule = engine.store.get_schedule(name)
        assert round(schedule.next_at.timestamp() * 1000) == LATEST + EVERY_MS, where
