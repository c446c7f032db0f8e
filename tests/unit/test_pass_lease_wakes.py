"""The process's one pass-lease renewal thread (``leases.hold._Renewals``) is woken by a pass
only when that pass's lease needs a renewal before the thread's planned wake-up: a wake per
pass (the thread taking the GIL to find nothing due), with the heartbeat's wake per step,
cost about a fifth of pikku's own CPU per step run in place. A lease short enough to need
it still wakes the thread and stays held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from pikku_celery import InMemoryLeaseService
from pikku_celery.leases import hold
from pikku_celery.leases.hold import hold_granted


class Wakes:
    """Counts the wakes of the renewal thread (its event's ``set``), leaving the event the
    thread waits on in place."""

    def __init__(self, event: threading.Event) -> None:
        self._set = event.set
        self.sets = 0

    def __call__(self) -> None:
        self.sets += 1
        self._set()


@pytest.fixture
def wake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wakes]:
    # A renewal thread of the test's own: no lease another test left held wakes it. (Its
    # daemon thread, idle, waits out the process.)
    monkeypatch.setattr(hold, "_RENEWALS", hold._Renewals())
    event = hold._RENEWALS._wake
    wakes = Wakes(event)
    monkeypatch.setattr(event, "set", wakes)
    yield wakes


def _planned_past_now() -> None:
    """Until the thread has planned its next wake-up (after ``first``'s add)."""
    until = time.monotonic() + 5.0
    while hold._RENEWALS._planned <= time.monotonic() and time.monotonic() < until:
        time.sleep(0.01)
    assert hold._RENEWALS._planned > time.monotonic()


def _hold(leases: InMemoryLeaseService, key: str, ttl_ms: int) -> object:
    lease = leases.acquire(key, "pass", ttl_ms)
    assert lease is not None
    return hold_granted(leases, lease, ttl_ms, time.monotonic())


def test_passes_with_long_leases_do_not_wake_the_renewal_thread(wake: Wakes) -> None:
    leases = InMemoryLeaseService()
    with _hold(leases, "first", 30_000):  # type: ignore[attr-defined]
        _planned_past_now()
        wake.sets = 0
        for i in range(20):
            with _hold(leases, f"run-{i}", 30_000):  # type: ignore[attr-defined]
                pass
    assert wake.sets == 0


def test_a_lease_due_sooner_wakes_the_thread_and_is_kept(wake: Wakes) -> None:
    leases = InMemoryLeaseService()
    with _hold(leases, "first", 30_000):  # type: ignore[attr-defined]
        _planned_past_now()
        wake.sets = 0
        with _hold(leases, "short", 600) as held:  # type: ignore[attr-defined]
            # One wake, unless the thread's plan was already due sooner than this renewal.
            assert wake.sets <= 1
            time.sleep(1.0)  # past the lease's own 0.6 s: renewed meanwhile, or lost
            assert not held.is_lost
            assert leases.get("short") is not None
