"""The state machine's shrunk cases (tests/property/test_store_stateful.py), as example tests
on the in-memory store and the real ``mongod``. Each names the sequence Hypothesis shrank
to and what it found, on which code."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery.model.records import RUN_CANCELLED
from pikku_celery.store.base import WorkflowStore
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.store.mongo import MongoWorkflowStore
from tests.conftest import mongo_database
from tests.property.store_world import CHILD_RUN, LEASE_MS, World


@pytest.fixture(params=["memory", "mongod"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    store: WorkflowStore
    if request.param == "memory":
        store = InMemoryWorkflowStore()
        yield World(store)
        return
    server: Any = request.getfixturevalue("mongo_server")
    db, client = mongo_database("mongod", server)
    store = MongoWorkflowStore(db)
    made = World(store)
    yield made
    for worker in made.workers:
        for held in worker.claimer.heartbeat.held():
            worker.claimer.heartbeat.remove(held)
    client.drop_database(db.name)  # type: ignore[attr-defined]
    client.close()  # type: ignore[attr-defined]


def test_a_claim_between_the_cancels_read_and_its_writes_runs_no_body(world: World) -> None:
    """Shrunk on bc6f539 (mongod): ``cancel_begin; claim(w0, 'a')``: the claim won a step
    the cancel had read as pending, and the cancel's write then matched nothing (issue 21,
    defect 1). Now the claim fences itself; the step is failed for good."""
    world.cancel_begin()
    world.claim(0, "a")
    assert world.workers[0].held is None
    world.cancel_finish()
    world.check()
    step = world.step("a")
    assert step.status == "failed" and step.due_at is None
    assert step.error is not None and step.error["type"] == "WorkflowCancelledError"


def test_a_claim_between_a_finished_runs_fence_read_and_writes_runs_no_body(
        world: World) -> None:
    """Shrunk on bc6f539 by the CI profile (mongod): ``record_child_step;
    finish(completed); claim(w0, 'a')``: the same window for the leftovers a completed run
    fences (``Engine.fence_leftovers``)."""
    world.record_child_step()
    world.finish("completed")
    world.claim(0, "a")
    assert world.workers[0].held is None
    world.cancel_finish()
    world.check()
    step = world.step("a")
    assert step.status == "failed" and step.error is not None
    assert step.error["type"] == "WorkflowRunEnded"


def test_a_child_started_across_its_parents_cancel_is_cancelled(world: World) -> None:
    """Shrunk on bc6f539 (memory): ``record_child_step; cancel_begin; create_child``: the
    cancel found the parked step but no child run yet, and the child created after it ran
    under a cancelled parent (issue 21, defect 2)."""
    world.record_child_step()
    world.cancel_begin()
    world.cancel_finish()
    world.create_child()
    world.check()
    assert world.run_status() == RUN_CANCELLED
    assert world.run_status(CHILD_RUN) == RUN_CANCELLED


def test_a_reclaim_does_not_rob_an_owner_whose_renewal_landed_in_its_window(
        world: World) -> None:
    """Shrunk with issue 21's surviving mutant applied (the reclaim's write without "the
    lease has lapsed" in its filter, ``store/_decide.guard_for``), on mongod: ``claim(w0,
    'a'); tick(lease + 1); redeliver_lapsed(w1, between='beat')``. The re-delivery reads the
    step lapsed; w0's heartbeat renews it before the reclaim writes; the write must then
    match nothing. With the mutant, w1 superseded a live w0 and both bodies ran."""
    world.claim(0, "a")
    world.tick(LEASE_MS + 1)
    world.claim(1, "a", between="beat")
    assert world.workers[1].held is None
    held = world.workers[0].held
    assert held is not None and not held.held.lost.is_set()
    step = world.step("a")
    assert (step.attempt, step.status) == (1, "running")
    world.settle(0, True)
    assert world.step("a").status == "succeeded"
    world.check()


def test_a_retry_due_from_inside_a_cancels_window_never_runs(world: World) -> None:
    """Found while building the machine (mongod): ``claim(w0, 'a'); cancel_begin; settle(w0,
    failure); cancel_finish``: the failure landed between the fence's read (step running)
    and its write, so the step is left failed with its retry due on a cancelled run. Its
    next claim must fence itself and run nothing."""
    world.claim(0, "a")
    world.cancel_begin()
    world.settle(0, False)
    world.cancel_finish()
    world.check()
    world.claim(1, "a")
    assert world.workers[1].held is None
    step = world.step("a")
    assert step.status == "failed" and step.due_at is None
    world.check()
