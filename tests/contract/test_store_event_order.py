"""Sends racing each other and the run's end, with the interleaving forced (issue 31,
suspected defects (a) and (b)), on every store.

A send's write that raises the run's counter is the moment its event is kept: it checks
the run is live and gives the event its ``seq``. On MongoDB the event's document is
written apart from it, so a send can stop right after that write (``Paused`` holds it
there, in a thread, until the test lets it go) while another send, a wait's read or the
run's end happens. The in-memory store keeps the event in that same write, under its
lock: there the pause comes after the whole send, and the same outcomes must hold.

(a) Two sends get seq 1 and 2; the first stops before its event is written. Before the
fix a wait took seq 2 while seq 1 was still on its way, then seq 1 arrived.
(b) A send's counter write sees the run live; the run ends; the send goes on. Before the
fix the event appeared in the run after its end (the ended run's events changed) and the
send returned success: a reader after the end saw no such event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pikku_celery import WorkflowEventError
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_COMPLETED, RUN_RUNNING, WorkflowEvent
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from tests.contract.test_store import T0, new_run, store
from tests.support.threads import ThreadsJoined

__all__ = ["store"]  # the fixture, parametrized over every store
WAIT_S = 30.0  # a bound on a wait for the other thread, never reached when all is well


def _raises_counter(update: Any) -> bool:
    """Whether a run update writes the run's events counter (``events_sent``)."""
    return isinstance(update, dict) and any(
        isinstance(part, dict) and R.EVENTS_SENT in part for part in update.values())


class Paused:
    """Holds the first send that reaches the pause point (``after``: right after its
    counter write; else right before it) until ``go``."""

    def __init__(self, store: WorkflowStore, *, after: bool = True) -> None:
        self.reached = threading.Event()
        self.released = threading.Event()
        self._armed = True
        self._lock = threading.Lock()
        if isinstance(store, InMemoryWorkflowStore):  # one write: pause after the send
            real_send = store.send_event

            def send_event(*args: Any, **kwargs: Any) -> Any:
                if not after:
                    self._hold()
                sent = real_send(*args, **kwargs)
                if after:
                    self._hold()
                return sent
            store.send_event = send_event  # type: ignore[method-assign]
            return
        store._runs = _CounterHook(store._runs, self._hold, after)  # type: ignore[attr-defined]

    def _hold(self) -> None:
        with self._lock:
            first, self._armed = self._armed, False
        if first:
            self.reached.set()
            assert self.released.wait(WAIT_S), "the test never let the send go on"

    def wait_reached(self) -> None:
        assert self.reached.wait(WAIT_S), "the send never reached its counter write"

    def go(self) -> None:
        self.released.set()


class _CounterHook:
    """The runs collection, calling ``hook`` around each write of the events counter."""

    def __init__(self, runs: Any, hook: Callable[[], None], after: bool) -> None:
        self._runs, self._hook, self._after = runs, hook, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runs, name)

    def _around(self, method: str, update: Any, *args: Any, **kwargs: Any) -> Any:
        counter = _raises_counter(update)
        if counter and not self._after:
            self._hook()
        result = getattr(self._runs, method)(*args, update, **kwargs)
        if counter and self._after:
            self._hook()
        return result

    def update_one(self, query: Any, update: Any, *args: Any, **kwargs: Any) -> Any:
        return self._around("update_one", update, query, *args, **kwargs)

    def find_one_and_update(self, query: Any, update: Any, *args: Any, **kwargs: Any) -> Any:
        return self._around("find_one_and_update", update, query, *args, **kwargs)


class Race:
    """The test's threads and pauses: on teardown every pause is let go before the
    threads are joined, so a failed assertion never leaves a send held."""

    def __init__(self, threads: ThreadsJoined) -> None:
        self.threads = threads
        self.pauses: list[Paused] = []

    def pause(self, store: WorkflowStore, *, after: bool = True) -> Paused:
        self.pauses.append(paused := Paused(store, after=after))
        return paused


@pytest.fixture
def race() -> Iterator[Race]:
    with ThreadsJoined(timeout_s=WAIT_S) as joined:
        race = Race(joined)
        try:
            yield race
        finally:
            for paused in race.pauses:
                paused.go()


def _send_in_thread(race: Race, store: WorkflowStore, run_id: str, name: str,
                    payload: Any) -> dict[str, Any]:
    """Start a send in a thread; the dict gets its ``event`` or its ``error``."""
    out: dict[str, Any] = {}

    def send() -> None:
        try:
            out["event"] = store.send_event(run_id, name, payload, T0)[0]
        except WorkflowEventError as exc:
            out["error"] = exc
    race.threads.start(send)
    return out


def _seqs(events: list[WorkflowEvent]) -> list[tuple[int, Any]]:
    return [(e.seq, e.payload) for e in events]


def test_a_wait_never_takes_an_event_before_an_earlier_one_still_on_its_way(
        store: WorkflowStore, race: Race) -> None:
    run_id = new_run(store)
    paused = race.pause(store)
    first = _send_in_thread(race, store, run_id, "item", "first")
    paused.wait_reached()  # seq 1 is given out; its send stops there
    second, _ = store.send_event(run_id, "item", "second", T0 + 1)
    assert second.seq == 2
    # A wait reading now takes seq 1 (not seq 2 while seq 1 may still arrive), and a
    # reader sees the run's events in their order, with no hole.
    taken = store.next_event(run_id, "item")
    assert taken is not None and (taken.seq, taken.payload) == (1, "first")
    assert _seqs(store.list_events(run_id)) == [(1, "first"), (2, "second")]
    paused.go()
    race.threads.join()
    assert first["event"] == taken  # the send returns the event the wait took
    later = store.next_event(run_id, "item", [1])
    assert later is not None and later.seq == 2
    assert store.next_event(run_id, "item", [1, 2]) is None
    assert _seqs(store.list_events(run_id)) == [(1, "first"), (2, "second")]


def test_an_event_kept_before_the_run_ended_is_in_the_run_from_that_write_on(
        store: WorkflowStore, race: Race) -> None:
    run_id = new_run(store)
    paused = race.pause(store)
    sending = _send_in_thread(race, store, run_id, "paid", {"amount": 12})
    paused.wait_reached()  # the counter write saw the run live
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_COMPLETED, T0 + 1)
    # Read after the end: the ended run's events, which must never change after it.
    at_end = _seqs(store.list_events(run_id))
    waiting = store.next_event(run_id, "paid")
    paused.go()
    race.threads.join()
    assert "error" not in sending
    assert at_end == [(1, {"amount": 12})] == _seqs(store.list_events(run_id))
    assert waiting == sending["event"]
    with pytest.raises(WorkflowEventError, match=r"the run has ended \(completed\)"):
        store.send_event(run_id, "paid", 2, T0 + 2)
    assert _seqs(store.list_events(run_id)) == at_end


def test_a_send_whose_counter_write_comes_after_the_end_is_refused_and_keeps_nothing(
        store: WorkflowStore, race: Race) -> None:
    run_id = new_run(store)
    paused = race.pause(store, after=False)
    sending = _send_in_thread(race, store, run_id, "paid", {"amount": 12})
    paused.wait_reached()  # the send is under way, its counter write not made
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_COMPLETED, T0 + 1)
    paused.go()
    race.threads.join()
    assert isinstance(sending.get("error"), WorkflowEventError), sending
    assert store.list_events(run_id) == [] and store.next_event(run_id, "paid") is None
