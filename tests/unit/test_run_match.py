"""``list_runs``/``count_runs``' ``match``: the store query a web caller's "my runs" filter
becomes (issue 22 item 2), on the real MongoDB and the in-memory store alike."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery import InMemoryWorkflowStore, InvalidInputError, MongoWorkflowStore
from pikku_celery.store.base import NewRun
from tests.conftest import pooled_database

INPUTS = {
    "a1": {"owner": "ann", "n": 1},
    "a2": {"owner": "ann", "n": 2, "tags": ["x", "y"]},
    "b1": {"owner": "bob", "n": 1},
    "t1": {"owner": True},
    "o1": {"owner": 1},
    "l1": {"owners": [{"name": "ann"}, {"name": "cy"}]},
    "s1": "just a string",
}


@pytest.fixture(params=["memory", "mongod"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        made: Any = InMemoryWorkflowStore()
        yield _filled(made)
        return
    with pooled_database(request.getfixturevalue("mongo_server")) as db:
        yield _filled(MongoWorkflowStore(db))


def _filled(store: Any) -> Any:
    for i, (run_id, data) in enumerate(INPUTS.items()):
        store.create_run(NewRun(run_id=run_id, workflow="w", input=data), 1_000 + i)
    return store


def ids(store: Any, **match: Any) -> set[str]:
    return {r.run_id for r in store.list_runs(match=match, limit=100)}


def test_a_match_keeps_only_the_runs_whose_input_has_the_values(store: Any) -> None:
    assert ids(store, **{"input.owner": "ann"}) == {"a1", "a2"}
    assert ids(store, **{"input.owner": "ann", "input.n": 2}) == {"a2"}
    assert ids(store, **{"input.n": 1.0}) == {"a1", "b1"}   # 1 is 1.0, as in MongoDB
    assert ids(store, **{"input.owner": True}) == {"t1"}    # True is not 1
    assert ids(store, **{"input.owner": 1}) == {"o1"}
    assert ids(store, **{"input.tags": "y"}) == {"a2"}      # an item of a list
    assert ids(store, **{"input.owners.name": "cy"}) == {"l1"}
    assert ids(store, **{"input.owner": "nobody"}) == set()
    assert {r.run_id for r in store.list_runs(limit=100)} == set(INPUTS)


def test_counts_and_pages_follow_the_match(store: Any) -> None:
    mine = {"input.owner": "ann"}
    assert store.count_runs(status="running", match=mine) == 2
    assert store.count_runs(status="running", workflow="w", match=mine) == 2
    assert store.count_runs(status="running") == len(INPUTS)
    first = store.list_runs(match=mine, limit=1)
    assert [r.run_id for r in first] == ["a2"]  # newest first, and a full page of matches
    after = first[-1]
    rest = store.list_runs(match=mine, limit=1,
                           created_before_ms=round(after.created_at.timestamp() * 1000),
                           before_run_id=after.run_id)
    assert [r.run_id for r in rest] == ["a1"]


@pytest.mark.parametrize("match", [
    {"owner": "ann"},                 # not a field of the input
    {"input": "ann"},                 # the whole input
    {"input.$where": "1"},            # an operator as a field
    {"input.owner": {"$ne": None}},   # an operator as a value
    {"input.owner": ["ann"]},
    {f"input.f{i}": i for i in range(9)},
])
def test_a_match_that_is_not_plain_values_on_input_fields_is_refused(
        store: Any, match: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        store.list_runs(match=match)
    with pytest.raises(InvalidInputError):
        store.count_runs(status="running", match=match)
