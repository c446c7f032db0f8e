"""A run's limits on its events, and its events read in pages, on every store (issue 35,
item 3).

A send whose payload is larger than ``max_bytes`` as JSON, or to a run that has kept
``max_events`` events, is refused (``WorkflowEventLimitError`` naming the limit) and keeps
nothing: no event, no place in the run's order, no wake check. The count holds under
concurrent sends: it is decided by the guarded write that keeps an event, so a send held
right before that write while another takes the run's last place is refused when it goes
on (a check read before an unguarded write would have let both in). ``list_events``
pages on with ``after`` (a seq) and leaves the payloads out on request, saying how large
each is (``size``), for an event still on its way to its document (MongoDB's pending
event) too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pikku_celery import WorkflowEventLimitError
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import WorkflowEvent
from pikku_celery.store.base import WorkflowStore
from tests.contract.test_store import T0, atomic_store, new_run, store
from tests.contract.test_store_event_order import Race, race
from tests.support.threads import race as contend

__all__ = ["atomic_store", "race", "store"]  # the fixtures, over every store
FAR = T0 + 10**9  # after every wake check of these tests


def size_of(payload: Any) -> int:
    return len(json.dumps(payload, separators=(",", ":")).encode())


def seqs(events: list[WorkflowEvent]) -> list[int]:
    return [e.seq for e in events]


def test_a_payload_over_max_bytes_is_refused_and_keeps_nothing(store: WorkflowStore) -> None:
    run_id = new_run(store)
    payload = {"text": "é" * 40}  # 6 bytes a character as JSON (\u00e9)
    exact = size_of(payload)
    assert exact == 240 + len('{"text":""}')
    event, created = store.send_event(run_id, "note", payload, T0, max_bytes=exact,
                                      wake_check_ms=T0)
    assert created and event.size == exact and event.seq == 1
    with pytest.raises(WorkflowEventLimitError) as refused:
        store.send_event(run_id, "note", {"text": "é" * 41}, T0 + 1, max_bytes=exact,
                         wake_check_ms=T0)
    error = refused.value
    assert error.too_large and (error.limit, error.maximum, error.found) == (
        "max_event_bytes", exact, exact + 6)
    assert "pikku_max_event_bytes" in str(error) and f"{exact + 6} bytes" in str(error)
    # Nothing kept: no event, no place in the order, no wake check.
    assert seqs(store.list_events(run_id)) == [1]
    assert [e.seq for e in store.find_event_wakes(FAR, 10)] == [1]
    assert store.send_event(run_id, "note", None, T0 + 2, max_bytes=exact)[0].seq == 2
    # No limit (None or 0): only the store's own.
    big = {"text": "x" * 100_000}
    assert store.send_event(run_id, "note", big, T0 + 3, max_bytes=0)[0].size == size_of(big)
    assert store.send_event(run_id, "note", big, T0 + 3)[0].seq == 4


def test_a_run_that_kept_max_events_refuses_another_but_a_keys_repeat(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    kept = [store.send_event(run_id, "tick", i, T0 + i, key=f"k{i}", max_events=3,
                             wake_check_ms=T0)[0] for i in range(3)]
    assert seqs(kept) == [1, 2, 3]
    with pytest.raises(WorkflowEventLimitError) as refused:
        store.send_event(run_id, "tick", 3, T0 + 3, max_events=3, wake_check_ms=T0)
    error = refused.value
    assert not error.too_large and (error.limit, error.maximum, error.found) == (
        "max_events_per_run", 3, 3)
    assert "pikku_max_events_per_run" in str(error) and "kept 3 events" in str(error)
    with pytest.raises(WorkflowEventLimitError):  # keyed or not
        store.send_event(run_id, "tick", 3, T0 + 3, key="new", max_events=3)
    # A key already sent is no new event: its first send's event, at the limit too.
    again, created = store.send_event(run_id, "tick", "other", T0 + 4, key="k1",
                                      max_events=3)
    assert (again, created) == (kept[1], False)
    assert seqs(store.list_events(run_id)) == [1, 2, 3]
    assert sorted(seqs(store.find_event_wakes(FAR, 10))) == [1, 2, 3]
    assert store.next_event(run_id, "tick", [1, 2, 3]) is None
    # The limit is the one each send is given (the setting, read by the engine).
    assert store.send_event(run_id, "tick", 4, T0 + 5, max_events=4)[0].seq == 4
    assert store.send_event(run_id, "tick", 5, T0 + 6, max_events=0)[0].seq == 5
    assert store.send_event(run_id, "tick", 6, T0 + 7)[0].seq == 6


def test_concurrent_sends_never_take_a_run_past_max_events(
        atomic_store: WorkflowStore) -> None:
    store = atomic_store
    run_id = new_run(store)
    store.send_event(run_id, "tick", 0, T0)
    kept: list[int] = []
    refused: list[WorkflowEventLimitError] = []

    def send(i: int) -> None:
        try:
            kept.append(store.send_event(run_id, "tick", i, T0 + i, max_events=5)[0].seq)
        except WorkflowEventLimitError as exc:
            refused.append(exc)

    contend(send, 12)
    assert sorted(kept) == [2, 3, 4, 5] and len(refused) == 8
    assert all(e.found == 5 for e in refused)
    assert seqs(store.list_events(run_id)) == [1, 2, 3, 4, 5]


def test_a_send_that_loses_the_last_place_to_another_is_refused(
        store: WorkflowStore, race: Race) -> None:
    """The send is held after its read of the run's count (one place left), before the
    write that keeps its event; another send takes the place; the held send goes on."""
    run_id = new_run(store)
    store.send_event(run_id, "tick", 1, T0)
    paused = race.pause(store, after=False)
    out: dict[str, Any] = {}

    def held() -> None:
        try:
            out["event"] = store.send_event(run_id, "tick", "held", T0 + 1, max_events=2,
                                            wake_check_ms=T0)[0]
        except WorkflowEventLimitError as exc:
            out["error"] = exc
    race.threads.start(held)
    paused.wait_reached()
    last, _ = store.send_event(run_id, "tick", "last", T0 + 2, max_events=2)
    assert last.seq == 2
    paused.go()
    race.threads.join()
    assert isinstance(out.get("error"), WorkflowEventLimitError), out
    assert out["error"].found == 2
    assert [(e.seq, e.payload) for e in store.list_events(run_id)] == [(1, 1), (2, "last")]
    assert store.next_event(run_id, "tick", [1, 2]) is None


def test_events_are_paged_after_a_seq_and_listed_without_payloads(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    payloads = [{"n": i, "pad": "x" * i} for i in range(7)]
    for i, payload in enumerate(payloads):
        store.send_event(run_id, "item", payload, T0 + i, key=f"k{i}" if i % 2 else None)
    whole = store.list_events(run_id)
    assert [e.payload for e in whole] == payloads
    assert [e.size for e in whole] == [size_of(p) for p in payloads]
    assert seqs(store.list_events(run_id, 3)) == [1, 2, 3]
    assert seqs(store.list_events(run_id, 3, after=3)) == [4, 5, 6]
    assert seqs(store.list_events(run_id, 3, after=6)) == [7]
    assert store.list_events(run_id, 3, after=7) == []
    bare = store.list_events(run_id, 100, after=2, payloads=False)
    assert seqs(bare) == [3, 4, 5, 6, 7]
    assert all(e.payload is None for e in bare)
    assert bare == [e.__class__(**{**e.__dict__, "payload": None}) for e in whole[2:]]
    for limit, after in ((0, 0), (-1, 0), (1, -1), (True, 0), (1, "2")):
        with pytest.raises(InvalidInputError):
            store.list_events(run_id, limit, after=after)  # type: ignore[arg-type]


def test_an_event_on_its_way_is_paged_and_listed_without_its_payload(
        store: WorkflowStore, race: Race) -> None:
    """MongoDB's pending event (its place given, its document not told yet) is listed at
    its seq, on the page its seq is on, without its payload when so asked."""
    run_id = new_run(store)
    store.send_event(run_id, "item", "first", T0)
    paused = race.pause(store)
    race.threads.start(lambda: store.send_event(run_id, "item", {"big": "y" * 50}, T0 + 1))
    paused.wait_reached()  # seq 2 is given out; its document has no seq yet
    bare = store.list_events(run_id, 10, after=1, payloads=False)
    assert [(e.seq, e.payload, e.size) for e in bare] == [(2, None, size_of({"big": "y" * 50}))]
    assert [(e.seq, e.payload) for e in store.list_events(run_id, 1)] == [(1, "first")]
    assert store.list_events(run_id, 10, after=2) == []
    assert [e.payload for e in store.list_events(run_id, 1, after=1)] == [{"big": "y" * 50}]
    paused.go()
    race.threads.join()
    assert seqs(store.list_events(run_id, 10, after=1, payloads=False)) == [2]
