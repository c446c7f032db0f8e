"""What a pass reads and writes, on every store (issue 11): ``read_run`` and ``insert_steps``.

* ``read_run`` returns the run (without its input when asked) and exactly the steps asked
  for: all of them, the ones named, or the ones recorded by passes holding a later
  run-lease token (``seq``), in one round trip, and none when it asks for nothing.
* ``insert_steps`` records a pass's new steps in one round trip; a step that already exists
  (recorded by a pass whose view this one lacks) is returned as stored, never overwritten;
  bad input is refused before anything is written.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.store.base import NewStep, WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import FN, KINDS, LEASE, T0, _make_store, new_run
from tests.support.counting import counting_mongo


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


def steps(run_id: str, *names: str, **kw: Any) -> list[NewStep]:
    return [NewStep(run_id=run_id, step_name=name, function=FN, max_attempts=2, **kw)
            for name in names]


def names(read: Any) -> list[str]:
    return sorted(s.step_name for s in read.steps)


def test_insert_steps_records_a_batch_and_returns_each_as_stored(store: WorkflowStore) -> None:
    run_id = new_run(store)
    recorded = store.insert_steps(steps(run_id, "a", "b"), T0, seq=3)
    assert [(s.step_name, s.status, s.attempt, created) for s, created in recorded] == [
        ("a", "pending", 1, True), ("b", "pending", 1, True)]
    assert {s.step_name for s in store.list_steps(run_id)} == {"a", "b"}
    assert store.insert_steps([], T0) == []


def test_a_step_that_exists_is_returned_as_stored_not_overwritten(store: WorkflowStore) -> None:
    run_id = new_run(store)
    store.insert_steps(steps(run_id, "a"), T0, seq=1)
    store.claim_step(run_id, "a", FN, T0, LEASE)
    store.set_result(run_id, "a", 1, "done", T0 + 1)
    again = store.insert_steps(steps(run_id, "a", "c"), T0 + 2, seq=2)
    assert [(s.step_name, s.status, s.result, created) for s, created in again] == [
        ("a", "succeeded", "done", False), ("c", "pending", None, True)]


def test_bad_step_data_is_refused_before_any_step_is_written(store: WorkflowStore) -> None:
    run_id = new_run(store)
    batch = [*steps(run_id, "good"), NewStep(run_id, "bad", FN, data={"$where": 1})]
    with pytest.raises(InvalidInputError):
        store.insert_steps(batch, T0)
    assert store.list_steps(run_id) == []


def test_read_run_returns_the_run_and_every_step(store: WorkflowStore) -> None:
    run_id = new_run(store)
    other = new_run(store)
    store.insert_steps(steps(run_id, "a", "b"), T0, seq=1)
    store.insert_steps(steps(other, "a"), T0, seq=1)
    read = store.read_run(run_id, all_steps=True)
    assert read.run is not None and read.run.run_id == run_id and read.run.input == {"n": 1}
    assert names(read) == ["a", "b"] and {s.run_id for s in read.steps} == {run_id}


def test_read_run_returns_the_named_steps_and_those_recorded_after_a_token(
        store: WorkflowStore) -> None:
    run_id = new_run(store)
    store.insert_steps(steps(run_id, "old1", "old2"), T0, seq=4)
    store.insert_steps(steps(run_id, "new1", "new2"), T0 + 1, seq=5)
    read = store.read_run(run_id, input=False, step_names=["old1", "missing"],
                          recorded_after=4)
    assert read.run is not None and read.run.status == "running" and read.run.input is None
    assert names(read) == ["new1", "new2", "old1"]
    assert names(store.read_run(run_id, run=False, step_names=["old2"])) == ["old2"]
    assert names(store.read_run(run_id, run=False, recorded_after=5)) == []


def test_read_run_of_an_unknown_run_finds_nothing(store: WorkflowStore) -> None:
    # With no run recorded, and with another run recorded.
    read = store.read_run("no-such-run", step_names=["a"])
    assert read.run is None and read.steps == []
    new_run(store)
    read = store.read_run("no-such-run", step_names=["a"])
    assert read.run is None and read.steps == []


def test_read_run_is_one_command_and_asking_for_nothing_is_none(mongo_server: Any) -> None:
    client, mongo = counting_mongo(mongo_server.url)
    db = client[f"pikku_test_read_run_{uuid.uuid4().hex[:8]}"]
    try:
        store = MongoWorkflowStore(db)
        run_id = new_run(store)
        store.insert_steps(steps(run_id, "a", "b"), T0, seq=1)
        mongo.commands.clear()
        store.read_run(run_id, input=False, step_names=["a"], recorded_after=0)
        store.read_run(run_id, run=False, step_names=["b"])
        store.read_run(run_id, run=False)
        assert sum(mongo.commands.values()) == 2
        mongo.commands.clear()
        store.insert_steps(steps(run_id, "c", "d", "e"), T0, seq=2)
        assert dict(mongo.commands) == {"insert": 1}
    finally:
        client.drop_database(db.name)
