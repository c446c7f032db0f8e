"""Hardening of issue 8, infrastructure side: state that survives a fork (10), counters and
names bounded before they reach Redis (14), nesting depth refused before it recurses (16),
an unreachable store named clearly (20), what the distribution ships (21), and indexes that
serve every store query (22)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import tests.unit.test_contrib as contrib_tests
from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    MongoWorkflowStore,
    PikkuCelery,
    WorkflowStore,
)
from pikku_celery.clock import ServerClock
from pikku_celery.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import Lease
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.validate import MAX_DOCUMENT_DEPTH, check_value
from tests.conftest import mongo_database

T0 = 1_700_000_000_000
FN = "hardening.fn"

# --- 10: locks created before a fork ------------------------------------------------------

CHILD_HANG_LIMIT_S = 30.0  # a guard against a hung child, never a timing assertion


class _FixedSource:
    def now_ms(self) -> int:
        return 1_700_000_000_000


@contextmanager
def _held_by_another_thread(lock: threading.Lock) -> Iterator[None]:
    """Hold ``lock`` in a second thread for the duration of the block, as the worker's
    reaper or heartbeat thread holds it at the moment the prefork pool forks."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join()


def _in_forked_child(body: Callable[[], None]) -> None:
    """Run ``body`` in a forked child; fail if it raises or does not finish."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_HANG_LIMIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung: it inherited a lock held by a parent thread")
        time.sleep(0.01)


def test_a_child_forked_while_a_thread_holds_the_clock_lock_can_read_the_clock() -> None:
    clock = ServerClock(_FixedSource())
    assert clock.now_ms() >= 1_700_000_000_000

    def child() -> None:
        assert clock.now_ms() >= 1_700_000_000_000
        clock.observe(1_700_000_001_000, time.monotonic())
        assert clock.now_ms() >= 1_700_000_001_000

    with _held_by_another_thread(clock._lock):
        _in_forked_child(child)


def test_a_forked_child_gets_a_usable_heartbeat_without_the_parents_steps() -> None:
    leases = InMemoryLeaseService()
    heartbeat = Heartbeat(InMemoryWorkflowStore(), leases, ServerClock(leases))
    lease = Lease("workflow-step:r:s", "parent", 1, 0, 0)
    parents = HeldStep("r", "s", 1, 600_000, lease, held_until=time.monotonic() + 600)
    heartbeat.add(parents)

    def child() -> None:
        # The parent's step is renewed by the parent; a child renewing it too would keep
        # a dead parent's lease alive.
        assert heartbeat.held() == []
        mine = HeldStep("r", "t", 1, 600_000, lease, held_until=time.monotonic() + 600)
        heartbeat.add(mine)
        assert heartbeat.held() == [mine]
        heartbeat.remove(mine)

    try:
        with _held_by_another_thread(heartbeat._lock):
            _in_forked_child(child)
    finally:
        heartbeat.remove(parents)
    assert heartbeat.held() == []


# --- 16: nesting depth --------------------------------------------------------------------


def nested(levels: int, leaf: Any = 1) -> Any:
    """A value of ``levels`` nested containers (objects and arrays alternating)."""
    value = leaf
    for level in range(levels):
        value = {"k": value} if level % 2 else [value]
    return value


@pytest.fixture(params=["memory", "mongomock"])
def any_store(request: pytest.FixtureRequest) -> Iterator[WorkflowStore]:
    if request.param == "memory":
        yield InMemoryWorkflowStore()
        return
    db, client = mongo_database("mongomock", None)
    yield MongoWorkflowStore(db)
    client.drop_database(db.name)  # type: ignore[attr-defined]


def test_the_deepest_value_a_document_can_hold_is_stored_one_more_level_is_refused(
        any_store: WorkflowStore) -> None:
    # The run document is level 1: its input may nest 99 levels, so the document has 100.
    deepest = nested(MAX_DOCUMENT_DEPTH - 1)
    run, _ = any_store.create_run(NewRun("deep-ok", "order", deepest), T0)
    assert run.input == deepest
    with pytest.raises(InvalidInputError, match=r"nested too deeply.*level 101"):
        any_store.create_run(NewRun("deep-no", "order", nested(MAX_DOCUMENT_DEPTH)), T0)
    assert any_store.get_run("deep-no") is None


@pytest.mark.parametrize("levels", [150, 5_000, 200_000])
def test_deep_values_are_refused_without_recursion_on_every_write(
        any_store: WorkflowStore, levels: int) -> None:
    deep = nested(levels)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.create_run(NewRun("deep", "order", deep), T0)
    any_store.create_run(NewRun("r", "order", None), T0)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.insert_step(NewStep("r", "s", FN, deep, max_attempts=2), T0)
    any_store.insert_step(NewStep("r", "s", FN, None, max_attempts=2), T0)
    claimed = any_store.claim_step("r", "s", FN, T0, 60_000).state
    assert claimed is not None
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.set_result("r", "s", claimed.attempt, deep, T0 + 1)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        any_store.transition_run("r", ["running"], "completed", T0 + 1, output=deep)
    step = any_store.get_step("r", "s")
    assert step is not None and step.status == "running" and step.result is None
    run = any_store.get_run("r")
    assert run is not None and run.status == "running"


def test_a_list_that_contains_itself_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        check_value("workflow input", loop)


@pytest.mark.parametrize("framework", ["flask", "django"])
@pytest.mark.parametrize("levels", [150, 100_000])
def test_the_web_api_answers_a_deep_body_with_400(framework: str, levels: int) -> None:
    pikku, post = _raw_poster(framework)
    body = '{"input": ' + "[" * levels + "]" * levels + "}"
    status, payload = post("/workflows/sum/runs", body)
    assert (status, payload["error"]) == (400, "InvalidInputError")
    assert "nested too deeply" in payload["message"]
    assert pikku.list_runs() == []


def _raw_poster(framework: str) -> tuple[PikkuCelery, Callable[[str, str], tuple[int, Any]]]:
    """POST a raw body (the test clients' own JSON encoders would recurse on it)."""
    if framework == "flask":
        from flask import Flask

        from pikku_celery.contrib.flask import init_app

        pikku = contrib_tests._pikku()
        app = Flask("hardening-infra")
        init_app(app, pikku, url_prefix="/workflows")
        flask_client = app.test_client()

        def post_flask(url: str, body: str) -> tuple[int, Any]:
            response = flask_client.post(url, data=body, content_type="application/json")
            return response.status_code, response.get_json()

        return pikku, post_flask
    pikku, _ = contrib_tests._django()
    from django.test import Client

    django_client = Client()

    def post_django(url: str, body: str) -> tuple[int, Any]:
        response = django_client.generic("POST", url, body, content_type="application/json")
        return response.status_code, json.loads(response.content)

    return pikku, post_django
