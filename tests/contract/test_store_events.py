"""Events on every store (issue 26, item 1): a send keeps an event next in its run's order
only while the run is live; a key makes a send idempotent, and so does a send's own
``send_id`` for its retries (issue 31); ``next_event`` gives the first event of a name not
taken yet; a send's wake check is found when due and ended once; a purge deletes a run's
events with it. Sends racing each other and the run's end: ``test_store_event_order``."""

from __future__ import annotations

import pytest

from pikku_celery import WorkflowEventError, WorkflowRunNotFoundError
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import RUN_COMPLETED, RUN_RUNNING, RUN_SUSPENDED
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import T0, new_run, store

__all__ = ["store"]  # the fixture, parametrized over every store


def test_sends_are_kept_in_order_and_a_wait_takes_the_first_not_taken(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    sent = [store.send_event(run_id, name, payload, T0 + i)
            for i, (name, payload) in enumerate([("paid", {"n": 1}), ("ship", None),
                                                  ("paid", [1, (2, 3)])])]
    assert [(e.seq, created) for e, created in sent] == [(1, True), (2, True), (3, True)]
    first = store.next_event(run_id, "paid")
    assert first is not None and (first.seq, first.payload) == (1, {"n": 1})
    second = store.next_event(run_id, "paid", [1])
    assert second is not None and (second.seq, second.payload) == (3, [1, [2, 3]])
    assert store.next_event(run_id, "paid", [1, 2, 3]) is None
    assert store.next_event(run_id, "other") is None
    listed = store.list_events(run_id)
    assert [(e.name, e.seq) for e in listed] == [("paid", 1), ("ship", 2), ("paid", 3)]
    assert listed[0].sent_at.timestamp() * 1000 == T0
    assert store.list_events(run_id, limit=1) == listed[:1]
    assert store.list_events(new_run(store)) == []


def test_a_key_lands_a_retried_send_on_the_first(store: WorkflowStore) -> None:
    run_id = new_run(store)
    first, created = store.send_event(run_id, "paid", 1, T0, key="pay-1")
    again, created_again = store.send_event(run_id, "paid", 2, T0 + 5, key="pay-1")
    assert created and not created_again
    assert again == first and again.payload == 1 and again.key == "pay-1"
    other, _ = store.send_event(run_id, "paid", 3, T0 + 6, key="pay-2")
    assert [e.payload for e in store.list_events(run_id)] == [1, 3]
    assert other.seq > first.seq
    # The same key on another run is another event.
    elsewhere, created_elsewhere = store.send_event(new_run(store), "paid", 9, T0, key="pay-1")
    assert created_elsewhere and elsewhere.payload == 9


def test_a_send_repeated_with_its_send_id_keeps_one_event(store: WorkflowStore) -> None:
    """A call's retry after an error whose outcome it could not know (issue 31)."""
    run_id = new_run(store)
    first, created = store.send_event(run_id, "paid", 1, T0, send_id="call-1")
    again, created_again = store.send_event(run_id, "paid", 1, T0 + 5, send_id="call-1")
    assert created and created_again  # the same send: it wrote it
    assert again == first and first.seq == 1
    other, _ = store.send_event(run_id, "paid", 1, T0 + 6)  # another call: another event
    assert other.seq == 2 and other.event_id != first.event_id
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_COMPLETED, T0 + 7)
    # Kept while the run was live: its retry after the end returns it, and keeps nothing.
    assert store.send_event(run_id, "paid", 1, T0 + 8, send_id="call-1")[0] == first
    with pytest.raises(WorkflowEventError):
        store.send_event(run_id, "paid", 1, T0 + 8, send_id="call-2")
    assert [e.seq for e in store.list_events(run_id)] == [1, 2]


def test_an_unknown_or_ended_run_keeps_nothing(store: WorkflowStore) -> None:
    with pytest.raises(WorkflowRunNotFoundError):
        store.send_event("nobody", "paid", 1, T0)
    run_id = new_run(store)
    assert store.transition_run(run_id, [RUN_RUNNING], RUN_SUSPENDED, T0)
    assert store.send_event(run_id, "paid", 1, T0)[0].seq == 1  # suspended takes events
    assert store.transition_run(run_id, [RUN_SUSPENDED], RUN_COMPLETED, T0 + 1)
    with pytest.raises(WorkflowEventError, match=r"the run has ended \(completed\)"):
        store.send_event(run_id, "paid", 2, T0 + 2)
    assert [e.seq for e in store.list_events(run_id)] == [1]


@pytest.mark.parametrize(("name", "key", "payload"), [
    ("a#1", None, None), ("", None, None), ("ok", "", None), ("ok", None, {"$x": 1}),
])
def test_a_bad_send_is_refused_before_anything_is_written(
        store: WorkflowStore, name: str, key: str | None, payload: object) -> None:
    run_id = new_run(store)
    with pytest.raises(InvalidInputError):
        store.send_event(run_id, name, payload, T0, key=key)
    assert store.list_events(run_id) == []
    assert store.send_event(run_id, "ok", None, T0)[0].seq == 1  # no number was spent


def test_a_wake_check_is_found_when_due_and_ended_once(store: WorkflowStore) -> None:
    run_id = new_run(store)
    checked, _ = store.send_event(run_id, "paid", 1, T0, wake_check_ms=T0 + 100)
    store.send_event(run_id, "paid", 2, T0)  # no check
    assert store.find_event_wakes(T0 + 99, 10) == []
    assert store.find_event_wakes(T0 + 100, 10) == [checked]
    assert store.clear_event_wake(checked.event_id)
    assert not store.clear_event_wake(checked.event_id)
    assert store.find_event_wakes(T0 + 1000, 10) == []


def test_a_purge_deletes_a_runs_events(store: WorkflowStore) -> None:
    ended, live = new_run(store), new_run(store)
    store.send_event(ended, "paid", 1, T0)
    store.send_event(live, "paid", 1, T0)
    assert store.transition_run(ended, [RUN_RUNNING], RUN_COMPLETED, T0 + 1)
    assert store.purge_runs(T0 + 10_000) == [ended]
    assert store.list_events(ended) == [] and len(store.list_events(live)) == 1
