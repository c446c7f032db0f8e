"""The fenced result backend without a worker (issue 21): the checks of
tests/integration/test_result_backend.py that need no Celery worker, in the fast set that
``./dev mutate`` runs, on the session's real ``mongod``. The integration file keeps them too,
with the end-to-end ``AsyncResult`` test that needs a worker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from celery import Celery
from celery.app.task import Context
from celery.backends.mongodb import MongoBackend

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.backend import ATTEMPT_FIELD, PikkuResultBackend, record_attempt
from tests.support.mongod import MongoTarget


@pytest.fixture
def backend_url(mongo_server: MongoTarget) -> Iterator[str]:
    database = f"pikku_results_{uuid.uuid4().hex[:10]}"
    yield mongo_server.url_for(database, "pikku+mongodb")
    with pymongo.MongoClient(mongo_server.url, serverSelectionTimeoutMS=5000) as client:
        client.drop_database(database)


def _app(backend_url: str) -> tuple[Celery, PikkuCelery]:
    app = Celery(f"results-{uuid.uuid4().hex[:6]}", broker="memory://", backend=backend_url)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    pikku.step(name="results.charge")(lambda data: data)
    return app, pikku


def _store(backend: Any, task_id: str, result: Any, attempt: int,
           name: str = "results.charge", state: str = "SUCCESS") -> None:
    request = Context(id=task_id, task=name, args=[], kwargs={})
    record_attempt(request, attempt)
    backend.store_result(task_id, result, state, request=request)


def test_the_pikku_url_selects_the_fenced_backend(backend_url: str) -> None:
    app, _ = _app(backend_url)
    assert isinstance(app.backend, PikkuResultBackend)


def test_a_stale_attempt_never_replaces_a_newer_outcome_in_either_order(
        backend_url: str) -> None:
    app, _ = _app(backend_url)
    ours = app.backend
    _store(ours, "t-1", "stale", 1)  # the stale copy finishes first
    _store(ours, "t-1", "fresh", 2)
    assert ours.get_task_meta("t-1")["result"] == "fresh"
    _store(ours, "t-2", "fresh", 2)  # the stale copy writes last
    _store(ours, "t-2", "stale", 1)
    assert ours.get_task_meta("t-2")["result"] == "fresh"
    stored = ours.collection.find_one({"_id": "t-2"})
    assert stored is not None and stored[ATTEMPT_FIELD] == 2
    # Celery's own MongoDB backend lets the stale attempt win in one of the two orders: it
    # keeps the first SUCCESS (Celery 5.7), or the last write wins (before 5.7).
    celerys = MongoBackend(app=app, url=backend_url.removeprefix("pikku+"))
    _store(celerys, "t-3", "stale", 1)
    _store(celerys, "t-3", "fresh", 2)
    _store(celerys, "t-4", "fresh", 2)
    _store(celerys, "t-4", "stale", 1)
    assert "stale" in {celerys.get_task_meta(t)["result"] for t in ("t-3", "t-4")}


def test_the_same_attempt_replaces_its_own_earlier_state(backend_url: str) -> None:
    """An attempt's later state (STARTED, then SUCCESS) replaces its earlier one: the
    filter refuses only a document written by a *higher* attempt."""
    app, _ = _app(backend_url)
    _store(app.backend, "t-s", None, 3, state="STARTED")
    _store(app.backend, "t-s", "done", 3)
    meta = app.backend.get_task_meta("t-s")
    assert (meta["status"], meta["result"]) == ("SUCCESS", "done")


def test_plain_tasks_are_stored_as_celerys_backend_stores_them(backend_url: str) -> None:
    app, _ = _app(backend_url)
    celerys = MongoBackend(app=app, url=backend_url.removeprefix("pikku+"))
    for backend, task_id in ((app.backend, "plain-1"), (celerys, "plain-2")):
        request = Context(id=task_id, task="some.plain.task", args=[], kwargs={})
        backend.store_result(task_id, {"n": 1}, "SUCCESS", request=request)
        backend.store_result(task_id, {"n": 2}, "SUCCESS", request=request)
    # As Celery's own backend keeps it: the first SUCCESS (Celery 5.7), the last before 5.7
    assert (app.backend.get_task_meta("plain-1")["result"]
            == celerys.get_task_meta("plain-2")["result"])
    assert ATTEMPT_FIELD not in (app.backend.collection.find_one({"_id": "plain-1"}) or {})


def test_a_forged_attempt_header_fences_nothing_out(backend_url: str) -> None:
    """Celery copies message headers onto the request: a header naming attempt 999 must not
    become the stored attempt, or no real outcome could ever replace it."""
    app, _ = _app(backend_url)
    forged = Context(id="t-f", task="results.charge", pikku_attempt=999, args=[], kwargs={})
    app.backend.store_result("t-f", "forged", "SUCCESS", request=forged)
    stored = app.backend.collection.find_one({"_id": "t-f"})
    assert stored is not None and stored[ATTEMPT_FIELD] == 0
    _store(app.backend, "t-f", "real", 1)
    assert app.backend.get_task_meta("t-f")["result"] == "real"
