"""The fenced result backend, on the MongoDB wire stand-in and a real Redis broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from celery import Celery, signals
from celery.app.task import Context
from celery.backends.mongodb import MongoBackend
from celery.contrib.testing.worker import start_worker

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.backend import PikkuResultBackend, record_attempt
from tests.conftest import REDIS_URL
from tests.support.mongod import MongoTarget


@pytest.fixture
def backend_url(mongo_server: MongoTarget) -> Iterator[str]:
    database = f"pikku_results_{uuid.uuid4().hex[:10]}"
    yield mongo_server.url_for(database, "pikku+mongodb")
    with pymongo.MongoClient(mongo_server.url, serverSelectionTimeoutMS=5000) as client:
        client.drop_database(database)


def _app(backend_url: str, broker: str = "memory://") -> tuple[Celery, PikkuCelery]:
    app = Celery(f"results-{uuid.uuid4().hex[:6]}", broker=broker, backend=backend_url)
    # Every step a task of its own, with its task id and result: a step run in place has
    # neither (README, "Running in place").
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False, in_place_steps=0)
    return app, pikku


def _store(backend: Any, task_id: str, result: Any, attempt: int, name: str) -> None:
    request = Context(id=task_id, task=name, args=[], kwargs={})
    record_attempt(request, attempt)
    backend.store_result(task_id, result, "SUCCESS", request=request)


def test_the_backend_url_selects_the_fenced_backend(backend_url: str) -> None:
    app, _ = _app(backend_url)
    assert isinstance(app.backend, PikkuResultBackend)


def test_a_stale_attempt_cannot_replace_a_newer_outcome_but_celerys_backend_lets_it_win(
        backend_url: str) -> None:
    app, pikku = _app(backend_url)

    @pikku.step(name="results.charge")
    def charge(data: Any) -> Any:
        return data

    ours = app.backend
    # Order 1: the stale attempt (a paused copy of the same task id) finishes first.
    _store(ours, "t-1", "stale", 1, "results.charge")
    _store(ours, "t-1", "fresh", 2, "results.charge")
    assert ours.get_task_meta("t-1")["result"] == "fresh"
    # Order 2: the stale copy writes last.
    _store(ours, "t-2", "fresh", 2, "results.charge")
    _store(ours, "t-2", "stale", 1, "results.charge")
    assert ours.get_task_meta("t-2")["result"] == "fresh"
    # Celery's own MongoDB backend lets the stale attempt win in one of the two orders: it
    # keeps the first SUCCESS (Celery 5.7), or the last write wins (before 5.7).
    celerys = MongoBackend(app=app, url=backend_url.removeprefix("pikku+"))
    _store(celerys, "t-3", "stale", 1, "results.charge")
    _store(celerys, "t-3", "fresh", 2, "results.charge")
    _store(celerys, "t-4", "fresh", 2, "results.charge")
    _store(celerys, "t-4", "stale", 1, "results.charge")
    assert "stale" in {celerys.get_task_meta(t)["result"] for t in ("t-3", "t-4")}


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


def test_async_result_of_a_step_task_returns_the_recorded_outcome(backend_url: str,
                                                                  key_prefix: str) -> None:
    app, pikku = _app(backend_url, broker=REDIS_URL)
    app.conf.task_default_queue = f"{key_prefix}-q"

    @pikku.step(name="results.double")
    def double(n: int) -> int:
        return n * 2

    @app.task(name="results.plain", shared=False)
    def plain(n: int) -> int:
        return n + 1

    @pikku.workflow("results.flow")
    def flow(wf: Any, n: int) -> int:
        return int(wf.do("double", double, n))

    step_task_ids: list[str] = []

    def collect(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if getattr(sender, "name", "") == "results.double":
            step_task_ids.append(task_id)

    signals.task_postrun.connect(collect, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=10):
            run_id = pikku.start(flow, 21)
            assert pikku.wait(run_id, 30).output == 42
            # The attempt's own record of the delivery that ran it (the history keeps each
            # attempt's Celery task id).
            task_ids = [a.task_id for a in pikku.get_history(run_id)]
            assert len(task_ids) == 1 and task_ids[0], pikku.get_history(run_id)
            assert app.AsyncResult(task_ids[0]).get(timeout=10, interval=0.05) == 42
            assert plain.delay(1).get(timeout=10, interval=0.05) == 2
    finally:
        signals.task_postrun.disconnect(collect)


def test_a_forged_attempt_header_fences_nothing_out(backend_url: str) -> None:
    """Celery copies message headers onto the request: a header naming attempt 999 must not
    become the stored attempt, or no real outcome could ever replace it (issue 8 item 13)."""
    app, pikku = _app(backend_url)
    pikku.step(name="results.forged")(lambda data: data)
    forged = Context(id="t-f", task="results.forged", pikku_attempt=999, args=[], kwargs={})
    app.backend.store_result("t-f", "forged", "SUCCESS", request=forged)
    assert app.backend.collection.find_one({"_id": "t-f"})["pikku_attempt"] == 0
    _store(app.backend, "t-f", "real", 1, "results.forged")
    assert app.backend.get_task_meta("t-f")["result"] == "real"
