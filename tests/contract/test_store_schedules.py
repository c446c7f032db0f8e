"""Schedules on every store (issue 26, item 2): a schedule is kept once by name; saving it
again keeps its paused flag and next tick unless its timing changed; moving it past a tick
is one write guarded on the next tick read (of two movers one wins), never on a paused
schedule; pause and resume are guarded on the flag; runs a tick started carry it."""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.store._schedules import NewSchedule
from pikku_celery.store.base import NewRun, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.conftest import pooled_database
from tests.contract.test_store import T0, atomic_store, store
from tests.support.threads import race

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

__all__ = ["atomic_store", "store"]  # the fixtures, parametrized over every store

EVERY = NewSchedule(name="tick-tock", workflow="report", cron=None, every_ms=60_000,
                    tz="UTC", data={"k": [1, 2]}, catch_up="latest")


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def test_a_schedule_is_kept_once_and_read_back_as_saved(store: WorkflowStore) -> None:
    saved, wrote = store.save_schedule(EVERY, T0 + 60_000, T0)
    assert wrote
    assert (saved.name, saved.workflow, saved.cron, saved.every, saved.tz, saved.data,
            saved.catch_up, saved.paused) == ("tick-tock", "report", None, 60.0, "UTC",
                                              {"k": [1, 2]}, "latest", False)
    assert (saved.next_at, saved.last_at, saved.last_run_id) == (at(T0 + 60_000), None, None)
    assert saved.created_at == saved.updated_at == at(T0)
    again, wrote_again = store.save_schedule(EVERY, T0 + 120_000, T0 + 5)
    assert not wrote_again and again == saved  # the same definition: nothing written
    assert store.get_schedule("tick-tock") == saved
    assert store.get_schedule("nobody") is None


def test_a_new_definition_keeps_the_paused_flag_and_the_next_tick_unless_timing_changed(
        store: WorkflowStore) -> None:
    store.save_schedule(EVERY, T0 + 60_000, T0)
    assert store.pause_schedule("tick-tock", T0 + 1)
    other_data = dataclasses.replace(EVERY, data={"k": 3}, catch_up="all", workflow="r2")
    saved, wrote = store.save_schedule(other_data, T0 + 999_000, T0 + 2)
    assert wrote and saved.paused and saved.next_at == at(T0 + 60_000)
    assert (saved.data, saved.catch_up, saved.workflow) == ({"k": 3}, "all", "r2")
    new_timing = dataclasses.replace(other_data, cron="*/5 * * * *", every_ms=None)
    saved, wrote = store.save_schedule(new_timing, T0 + 300_000, T0 + 3)
    assert wrote and saved.paused and saved.next_at == at(T0 + 300_000)
    assert (saved.cron, saved.every) == ("*/5 * * * *", None)
    assert store.get_schedule("tick-tock") == saved


def test_moving_past_a_tick_is_guarded_on_the_tick_read(store: WorkflowStore) -> None:
    store.save_schedule(EVERY, T0 + 60_000, T0)
    assert store.advance_schedule("tick-tock", T0 + 60_000, T0 + 120_000, T0 + 60_001,
                                  fired_ms=T0 + 60_000)
    # A second mover that read the same tick writes nothing.
    assert not store.advance_schedule("tick-tock", T0 + 60_000, T0 + 120_000, T0 + 60_002,
                                      fired_ms=T0 + 60_000)
    moved = store.get_schedule("tick-tock")
    assert moved is not None and moved.next_at == at(T0 + 120_000)
    assert moved.last_at == at(T0 + 60_000) and moved.updated_at == at(T0 + 60_001)
    assert moved.last_run_id == keys.scheduled_run_id("tick-tock", T0 + 60_000)
    assert store.started_tick("tick-tock", T0 + 60_000, T0 + 60_003)  # its run exists
    # Moving on without firing keeps the latest fired tick; it never goes back.
    assert store.advance_schedule("tick-tock", T0 + 120_000, T0 + 240_000, T0 + 3)
    assert store.advance_schedule("tick-tock", T0 + 240_000, T0 + 300_000, T0 + 4,
                                  fired_ms=T0 + 1)
    assert store.started_tick("tick-tock", T0 + 1, T0 + 5)
    moved = store.get_schedule("tick-tock")
    assert moved is not None and moved.last_at == at(T0 + 60_000)
    assert moved.next_at == at(T0 + 300_000)
    assert not store.advance_schedule("nobody", 0, 1, T0)


def test_a_fired_tick_blocks_every_move_until_its_run_is_said_to_exist(
        store: WorkflowStore) -> None:
    """Issue 31 (c): the advance that fires a tick records it as being started, and no
    advance (of any firer, firing or not) lands until ``started_tick``: whoever finds it
    set creates that tick's run first, so runs are created in the order of their ticks."""
    store.save_schedule(EVERY, T0 + 60_000, T0)
    assert store.schedules_firing(["tick-tock", "nobody"]) == [
        (store.get_schedule("tick-tock"), None)]
    assert store.advance_schedule("tick-tock", T0 + 60_000, T0 + 120_000, T0 + 60_001,
                                  fired_ms=T0 + 60_000)
    [(read, firing)] = store.schedules_firing(["tick-tock"])
    assert firing == T0 + 60_000 and read.next_at == at(T0 + 120_000)
    # A later decision (the latest tick after an outage, or none) waits for it.
    assert not store.advance_schedule("tick-tock", T0 + 120_000, T0 + 600_000, T0 + 7,
                                      fired_ms=T0 + 540_000)
    assert not store.advance_schedule("tick-tock", T0 + 120_000, T0 + 600_000, T0 + 7)
    assert not store.started_tick("tick-tock", T0 + 120_000, T0 + 8)  # not that tick
    assert not store.started_tick("nobody", T0 + 60_000, T0 + 8)
    assert store.started_tick("tick-tock", T0 + 60_000, T0 + 9)
    assert not store.started_tick("tick-tock", T0 + 60_000, T0 + 10)  # cleared once
    assert store.schedules_firing(["tick-tock"])[0][1] is None
    assert store.advance_schedule("tick-tock", T0 + 120_000, T0 + 600_000, T0 + 11,
                                  fired_ms=T0 + 540_000)
    # A pause keeps the tick being started (it was claimed before the pause).
    assert store.pause_schedule("tick-tock", T0 + 12)
    assert store.schedules_firing(["tick-tock"])[0][1] == T0 + 540_000
    assert store.started_tick("tick-tock", T0 + 540_000, T0 + 13)


def test_a_paused_schedule_is_not_moved_and_pause_and_resume_are_guarded(
        store: WorkflowStore) -> None:
    store.save_schedule(EVERY, T0 + 60_000, T0)
    assert store.pause_schedule("tick-tock", T0 + 1)
    assert not store.pause_schedule("tick-tock", T0 + 2)
    assert not store.advance_schedule("tick-tock", T0 + 60_000, T0 + 120_000, T0 + 3)
    paused = store.get_schedule("tick-tock")
    assert paused is not None and paused.paused and paused.next_at == at(T0 + 60_000)
    assert store.resume_schedule("tick-tock", T0 + 600_000, T0 + 4)
    assert not store.resume_schedule("tick-tock", T0 + 700_000, T0 + 5)
    resumed = store.get_schedule("tick-tock")
    assert resumed is not None and not resumed.paused
    assert resumed.next_at == at(T0 + 600_000)
    assert not store.pause_schedule("nobody", T0) and not store.resume_schedule("nobody", 1, T0)


def test_schedules_are_listed_by_name(store: WorkflowStore) -> None:
    for name in ("b-2", "a.1", "c_3"):
        store.save_schedule(dataclasses.replace(EVERY, name=name), T0 + 60_000, T0)
    assert [s.name for s in store.list_schedules()] == ["a.1", "b-2", "c_3"]
    assert [s.name for s in store.list_schedules(["c_3", "a.1", "zzz"])] == ["a.1", "c_3"]
    assert [s.name for s in store.list_schedules(limit=2)] == ["a.1", "b-2"]
    assert store.list_schedules([]) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"name": "no spaces"}, "schedule name"),
    ({"name": "@x"}, "schedule name"),
    ({"catch_up": "some"}, "catch_up"),
    ({"data": {"$where": 1}}, "data of schedule"),
    ({"data": float("nan")}, "data of schedule"),
])
def test_bad_schedules_are_refused_and_nothing_is_kept(store: WorkflowStore,
                                                       change: dict[str, object],
                                                       message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        store.save_schedule(dataclasses.replace(EVERY, **change), T0, T0)  # type: ignore[arg-type]
    assert store.list_schedules() == []
    with pytest.raises(InvalidInputError, match="limit"):
        store.list_schedules(limit=0)
    with pytest.raises(InvalidInputError, match="names"):
        store.list_schedules("a.1")


def test_a_run_a_tick_started_carries_its_schedule_and_tick(store: WorkflowStore) -> None:
    tick = T0 + 60_000
    run_id = keys.scheduled_run_id("tick-tock", tick)
    run, created = store.create_run(NewRun(run_id, "report", {"k": 1}, schedule="tick-tock",
                                           scheduled_ms=tick), T0 + 60_003)
    assert created and (run.schedule, run.scheduled_for) == ("tick-tock", at(tick))
    read = store.get_run(run_id)
    assert read is not None and (read.schedule, read.scheduled_for) == ("tick-tock", at(tick))
    plain, _ = store.create_run(NewRun("plain", "report", None), T0)
    assert (plain.schedule, plain.scheduled_for) == (None, None)


def test_of_many_workers_moving_one_tick_one_wins(atomic_store: WorkflowStore) -> None:
    store = atomic_store
    store.save_schedule(EVERY, T0 + 60_000, T0)
    won: list[bool] = []
    lock = threading.Lock()

    def move(_: int) -> None:
        result = store.advance_schedule("tick-tock", T0 + 60_000, T0 + 120_000, T0 + 60_001,
                                        fired_ms=T0 + 60_000)
        with lock:
            won.append(result)

    race(move, 8)
    assert sorted(won) == [False] * 7 + [True]


@pytest.fixture
def mongo_store(mongo_server: Any) -> Iterator[MongoWorkflowStore]:
    with pooled_database(mongo_server) as db:
        yield MongoWorkflowStore(db)


def test_a_timing_change_that_loses_its_race_reads_the_winner_s_and_stops_there(
        mongo_store: MongoWorkflowStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = mongo_store
    store.save_schedule(EVERY, T0 + 60_000, T0)
    collection = store._schedules
    original = collection.update_one
    new_timing = dataclasses.replace(EVERY, every_ms=120_000)
    raced: list[int] = []

    def another_writer_first(query: Any, update: Any, **kw: Any) -> Any:
        if not raced:  # the same new timing, saved by another worker between read and write
            raced.append(1)
            original({"_id": EVERY.name}, {"$set": {"every_ms": 120_000, "next_ms": T0 + 1}},
                     **kw)
        return original(query, update, **kw)

    monkeypatch.setattr(collection, "update_one", another_writer_first)
    saved, wrote = store.save_schedule(new_timing, T0 + 240_000, T0 + 5)
    # The guarded write matched nothing (the timing read had changed); the next read found
    # the definition already saved: nothing more written, the winner's next tick kept.
    assert not wrote and saved.every == 120.0 and saved.next_at == at(T0 + 1)


def test_a_save_that_keeps_losing_races_gives_up(mongo_store: MongoWorkflowStore,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = mongo_store
    store.save_schedule(EVERY, T0 + 60_000, T0)
    monkeypatch.setattr(store._schedules, "update_one",
                        lambda *a, **kw: types.SimpleNamespace(matched_count=0))
    with pytest.raises(RuntimeError, match="could not save it after 5 rounds"):
        store.save_schedule(dataclasses.replace(EVERY, every_ms=120_000), T0, T0 + 5)
