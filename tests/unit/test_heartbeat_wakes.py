"""The heartbeat's loop is woken by a new step only when that step's lease needs a beat
sooner than the one planned: a step run in place adds a held attempt per step, and a wake
per add (the loop taking the GIL to find nothing to do), with the pass-lease thread's wake
per pass, cost about a fifth of pikku's own CPU per step run in place. A shorter lease still
wakes it, and is renewed in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pikku_celery.engine.claims import Claimed, Claimer
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.model.clock import ServerClock
from pikku_celery.store.base import NewRun, NewStep
from tests.unit.test_heartbeat_beats import T0, Clock, Leases, Store


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


@pytest.fixture
def beating() -> Iterator[tuple[Heartbeat, Claimer, Store, CountingEvent]]:
    clock = Clock()
    store, leases = Store(), Leases(clock)
    heartbeat = Heartbeat(store, leases, ServerClock(leases, resync_s=0))
    wake = CountingEvent()
    heartbeat._wake = wake  # before the first add starts the loop
    claimer = Claimer(store, leases, ServerClock(leases, resync_s=0), heartbeat)
    store.create_run(NewRun("run", "wf", None), T0)
    yield heartbeat, claimer, store, wake
    heartbeat.stop()


def _claim(claimer: Claimer, store: Store, name: str, lease_ms: int) -> Claimed:
    store.insert_step(NewStep(run_id="run", step_name=name, function="f", max_attempts=3), T0)
    claimed = claimer.claim("run", name, "f", lease_ms)
    assert isinstance(claimed, Claimed)
    return claimed


def test_steps_with_leases_no_shorter_do_not_wake_the_loop(
        beating: tuple[Heartbeat, Claimer, Store, CountingEvent]) -> None:
    heartbeat, claimer, store, wake = beating
    for i in range(20):
        _claim(claimer, store, f"s{i}", 60_000)
    assert len(heartbeat.held()) == 20
    assert wake.sets == 0


def test_a_shorter_lease_wakes_the_loop_and_is_renewed_soon(
        beating: tuple[Heartbeat, Claimer, Store, CountingEvent]) -> None:
    heartbeat, claimer, store, wake = beating
    _claim(claimer, store, "long", 60_000)
    until = time.monotonic() + 5.0
    while heartbeat._next_beat == 0.0 and time.monotonic() < until:
        time.sleep(0.01)  # until the loop has planned its beat, 20 s away
    assert heartbeat._next_beat > time.monotonic() + 10
    _claim(claimer, store, "short", 600)
    assert wake.sets == 1
    # Renewed a third of the short lease after the wake; the loop had planned its next
    # beat 20 s away. Waiting up to 5 s leaves a loaded machine room and still tells them
    # apart.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not any(
            ("run", "short", 1) in held for held, _, _ in store.renewals):
        time.sleep(0.01)
    assert any(("run", "short", 1) in held for held, _, _ in store.renewals), store.renewals
