"""A parent cancelled while its pass creates a child run (issue 21, defect 2).

A pass records the child's step (parked on the child run), then creates the child run. A
cancel landing between the two found the step but no child run to cancel, fenced the step,
and the child, created right after, ran every step of its own for a parent that would
never hear its outcome. Now ``ensure_child`` reads the parent after creating the child and
cancels the child when the parent was cancelled (a Dekker pair with ``cancel``).

The cancel is made to land in that gap deterministically: ``create_run`` of the child
cancels the parent first. On both stores.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    MongoWorkflowStore,
    PikkuCelery,
)
from tests.conftest import mongo_database
from tests.unit.test_engine import Recorder


@pytest.fixture(params=["memory", "mongod"])
def pikku(request: pytest.FixtureRequest) -> Iterator[PikkuCelery]:
    def made(store: Any) -> PikkuCelery:
        made = PikkuCelery(Celery(f"child-{uuid.uuid4().hex[:6]}", broker="memory://"),
                           store=store, leases=InMemoryLeaseService(), worker_reaper=False)
        made.engine.dispatcher = Recorder()
        return made

    if request.param == "memory":
        yield made(InMemoryWorkflowStore())
        return
    db, client = mongo_database("mongod", request.getfixturevalue("mongo_server"))
    yield made(MongoWorkflowStore(db))
    client.drop_database(db.name)  # type: ignore[attr-defined]


def test_a_child_created_after_its_parent_was_cancelled_is_cancelled(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Any] = []

    def body(data: Any) -> str:
        ran.append(data)
        return "side effect"

    work = pikku.step(name="child.work")(body)

    @pikku.workflow("child.inner")
    def inner(wf: Any, data: Any) -> Any:
        return wf.do("work", work, data)

    @pikku.workflow("child.outer")
    def outer(wf: Any, data: Any) -> Any:
        return wf.child("sub", "child.inner", data)

    engine = pikku.engine
    create_run = engine.runs.create_run
    cancelled: list[str] = []

    def parent_cancelled_first(workflow: Any, data: Any, **kwargs: Any) -> Any:
        parent = kwargs.get("parent")
        if parent is not None and not cancelled:
            cancelled.append(parent[0])
            assert pikku.cancel(parent[0], "cancelled while its child was being created")
        return create_run(workflow, data, **kwargs)

    monkeypatch.setattr(engine.runs, "create_run", parent_cancelled_first)
    run_id = pikku.start("child.outer", {"n": 1})
    engine.advance(run_id)
    assert cancelled == [run_id], "the cancel did not land in the child's creation"
    assert pikku.get_run(run_id).status == "cancelled"
    children = [r for r in pikku.list_runs(workflow="child.inner")]
    assert len(children) == 1
    child = children[0]
    assert child.status == "cancelled", "the child of a cancelled run was left running"
    # Whatever message reaches the child now, none of its steps runs.
    assert engine.advance(child.run_id) == "cancelled"
    recorder = engine.dispatcher
    assert isinstance(recorder, Recorder)
    for function, rid, step_name in list(recorder.steps):
        if rid == child.run_id:
            engine.execute_step(pikku.registry.steps[function], rid, step_name)
    assert ran == [], "a step of the orphaned child ran"
    assert child.run_id not in [rid for rid, _ in recorder.wakes], "the child was woken"


def test_a_child_of_a_live_parent_is_created_and_woken(pikku: PikkuCelery) -> None:
    work = pikku.step(name="child.work2")(lambda data: "done")

    @pikku.workflow("child.inner2")
    def inner(wf: Any, data: Any) -> Any:
        return wf.do("work", work, data)

    @pikku.workflow("child.outer2")
    def outer(wf: Any, data: Any) -> Any:
        return wf.child("sub", "child.inner2", data)

    run_id = pikku.start("child.outer2", None)
    pikku.engine.advance(run_id)
    child = pikku.list_runs(workflow="child.inner2")[0]
    assert child.status == "running"
    recorder = pikku.engine.dispatcher
    assert isinstance(recorder, Recorder)
    assert child.run_id in [rid for rid, _ in recorder.wakes]


def test_a_child_whose_creator_stopped_before_reading_its_parent_checks_on_its_first_pass(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    """The creating pass inserted the child, then stopped before its read of the parent (a
    deadline on a slow network, a worker killed: seen in the chaos harness's full profile
    with partitions), and the parent's cancel had looked for the child before it existed.
    Nothing woke the child but the stalled-run sweep; its first pass ran a step. The
    child's first pass now reads the parent itself."""
    ran: list[Any] = []
    work = pikku.step(name="child.work3")(lambda data: ran.append(data) or "side effect")

    @pikku.workflow("child.inner3")
    def inner(wf: Any, data: Any) -> Any:
        return wf.do("work", work, data)

    @pikku.workflow("child.outer3")
    def outer(wf: Any, data: Any) -> Any:
        return wf.child("sub", "child.inner3", data)

    engine = pikku.engine
    runs = engine.runs
    create_run = runs.create_run
    check = runs.cancel_if_parent_cancelled

    def cancelled_then_stopped(workflow: Any, data: Any, **kwargs: Any) -> Any:
        parent = kwargs.get("parent")
        if parent is not None:  # the cancel's read of the child finds none yet
            assert pikku.cancel(parent[0], "cancelled while its child was being created")
        return create_run(workflow, data, **kwargs)

    def creator_stops(child_run_id: str, parent_run_id: str) -> bool:
        raise TimeoutError("the creating pass's deadline, between the insert and the read")

    monkeypatch.setattr(runs, "create_run", cancelled_then_stopped)
    monkeypatch.setattr(runs, "cancel_if_parent_cancelled", creator_stops)
    run_id = pikku.start("child.outer3", {"n": 3})
    with pytest.raises(TimeoutError):
        engine.advance(run_id)
    (child,) = pikku.list_runs(workflow="child.inner3")
    assert child.status == "running", "the creator was meant to stop before its check"
    monkeypatch.setattr(runs, "cancel_if_parent_cancelled", check)

    # The stalled-run sweep's wake: the child's first pass.
    assert engine.advance(child.run_id) == "cancelled"
    assert pikku.get_run(child.run_id).status == "cancelled"
    recorder = engine.dispatcher
    assert isinstance(recorder, Recorder)
    for function, rid, step_name in list(recorder.steps):
        if rid == child.run_id:
            engine.execute_step(pikku.registry.steps[function], rid, step_name)
    assert ran == [], "a step of the cancelled parent's child ran"
