"""Concurrency slots on every store (issue 26, item 3): a group holds at most ``limit``
runs, a run at most one slot of it (taking again is idempotent), giving back is idempotent,
a group's queued runs come out oldest first, and a run of a limited workflow is created
``queued`` in its group."""

from __future__ import annotations

import threading

import pytest

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.store.base import NewRun, WorkflowStore
from tests.contract.test_store import T0, store

__all__ = ["store"]  # the fixture, parametrized over every store


def test_a_group_holds_at_most_its_limit(store: WorkflowStore) -> None:
    assert store.take_slot("g1", "r1", 2, workflow="wf", key="ann")
    assert store.take_slot("g1", "r1", 2)  # held already: still one slot
    assert store.take_slot("g1", "r2", 2)
    assert not store.take_slot("g1", "r3", 2)
    assert sorted(store.slot_holders("g1")) == ["r1", "r2"]
    assert store.give_slot("g1", "r1") and not store.give_slot("g1", "r1")
    assert store.take_slot("g1", "r3", 2)
    assert sorted(store.slot_holders("g1")) == ["r2", "r3"]
    assert store.slot_holders("nobody") == []
    groups = store.list_slots()
    assert [(g["slot"], g["workflow"], g["key"], sorted(g["holders"])) for g in groups] == [
        ("g1", "wf", "ann", ["r2", "r3"])]
    store.give_slot("g1", "r2")
    store.give_slot("g1", "r3")
    assert store.list_slots() == []  # a group without holders is not listed


def test_racing_takes_never_exceed_the_limit(store: WorkflowStore) -> None:
    won: list[str] = []

    def take(run_id: str) -> None:
        if store.take_slot("race", run_id, 3):
            won.append(run_id)
    threads = [threading.Thread(target=take, args=(f"r{i}",)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 3 and sorted(store.slot_holders("race")) == sorted(won)


def test_a_limited_run_is_created_queued_and_its_group_lists_it(store: WorkflowStore) -> None:
    for i, run_id in enumerate(["q-b", "q-a", "q-c"]):
        run, _ = store.create_run(NewRun(run_id, "wf", {"i": i}, slot="grp"), T0 + (i // 2))
        assert (run.status, run.slot) == ("queued", "grp")
    store.create_run(NewRun("free", "wf", None), T0)
    assert store.get_run("free").status == "running"  # type: ignore[union-attr]
    oldest = store.next_queued("grp")
    assert oldest is not None and oldest.run_id == "q-a"  # same ms as q-b: by run id
    assert store.transition_run("q-a", ["queued"], "running", T0 + 5)
    assert store.next_queued("grp").run_id == "q-b"  # type: ignore[union-attr]
    assert store.queued_slots() == ["grp"]
    assert store.next_queued("other") is None


@pytest.mark.parametrize("limit", [0, -1, True, 10_001, "2"])
def test_a_bad_limit_is_refused(store: WorkflowStore, limit: object) -> None:
    with pytest.raises(InvalidInputError, match="concurrency must be an int"):
        store.take_slot("g", "r", limit)  # type: ignore[arg-type]
    assert store.slot_holders("g") == []


def test_a_group_tells_its_key_limit_and_holders(store: WorkflowStore) -> None:
    """What a queued run is told it waits on (issue 36 item 5)."""
    assert store.slot_group("g2") is None
    store.take_slot("g2", "r1", 2, workflow="wf", key="acme")
    store.take_slot("g2", "r2", 2)
    assert store.slot_group("g2") == {"slot": "g2", "workflow": "wf", "key": "acme",
                                      "holders": ["r1", "r2"], "limit": 2}
    store.give_slot("g2", "r1")
    assert store.slot_group("g2")["holders"] == ["r2"]  # type: ignore[index]


def test_a_queued_run_knows_how_many_are_ahead_of_it(store: WorkflowStore) -> None:
    runs = {}
    for i, run_id in enumerate(["a-b", "a-a", "a-c", "a-d"]):
        runs[run_id], _ = store.create_run(NewRun(run_id, "wf", {"i": i}, slot="ahead"),
                                           T0 + (i // 2))
    store.create_run(NewRun("elsewhere", "wf", None, slot="other"), T0 - 10)
    # a-a and a-b share a millisecond: by run id. Admission order: a-a, a-b, a-c, a-d.
    assert [store.queued_ahead("ahead", runs[r]) for r in ("a-a", "a-b", "a-c", "a-d")] == [
        0, 1, 2, 3]
    assert store.transition_run("a-a", ["queued"], "running", T0 + 5)
    assert store.queued_ahead("ahead", runs["a-d"]) == 2
