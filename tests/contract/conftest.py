"""The stores every contract module runs on, as fixtures: ``store`` (every kind of
``KINDS``) and ``mongo_store`` (the MongoDB kinds, for what only they do: marks, replies).
A module that needs them built another way defines its own, which takes precedence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.contract.test_store import KINDS, _make_store


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    yield from _make_store(request)


@pytest.fixture(params=[k for k in KINDS if k != "memory"])
def mongo_store(request: pytest.FixtureRequest) -> Iterator[MongoWorkflowStore]:
    for made in _make_store(request):
        assert isinstance(made, MongoWorkflowStore)
        yield made
