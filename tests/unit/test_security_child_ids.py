"""Issue 22, item 4: a caller cannot take the id a parent's child will need, and a
parent adopts no run it did not create; a parent in flight across the upgrade keeps the
child id its step recorded. Each test fails without the fix."""

from __future__ import annotations

import pytest

from pikku_celery import (
    InMemoryWorkflowStore,
    InvalidInputError,
)
from pikku_celery.model import keys
from pikku_celery.store.base import NewRun, NewStep
from pikku_celery.worker.inline import InlineDispatcher
from pikku_celery.workflow.replay import CHILD_PREFIX
from tests.support.family import make_family

# --- 4: child run ids cannot be squatted --------------------------------------------------------


def test_4_a_start_only_caller_cannot_take_a_future_childs_run_id() -> None:
    pikku = make_family()
    taken = keys.child_run_id("p-1", "kid")
    with pytest.raises(InvalidInputError, match="reserved"):
        pikku.start("sec.kid", {"n": 1}, run_id=taken)  # same workflow and input
    # The id earlier versions derived is an ordinary id now: nobody's child.
    legacy = keys.legacy_child_run_id("p-1", "kid")
    pikku.start("sec.kid", {"n": 1}, run_id=legacy, inline=True)
    run = pikku.get_run(pikku.start("sec.parent", None, run_id="p-1", inline=True))
    assert run.status == "completed" and run.output == {"kid": {"n": 1}}
    (step,) = pikku.get_steps("p-1")
    assert step.child_run_id == taken
    child = pikku.get_run(taken)
    assert (child.parent_run_id, child.parent_step_name) == ("p-1", "kid")
    assert pikku.get_run(legacy).parent_run_id is None  # the caller's run, untouched


def test_4_a_run_under_a_child_id_that_the_parent_did_not_create_is_never_adopted() -> None:
    store = InMemoryWorkflowStore()
    pikku = make_family(store)
    taken = keys.child_run_id("p-2", "kid")
    store.create_run(NewRun(taken, "sec.kid", {"n": 1}, None), 0)  # not through start
    run = pikku.get_run(pikku.start("sec.parent", None, run_id="p-2", inline=True))
    assert run.status == "failed" and "not the child" in run.error["message"]
    assert pikku.get_steps("p-2")[0].error["type"] == "WorkflowRunConflictError"
    assert pikku.get_run(taken).parent_run_id is None


def test_4_a_parent_in_flight_across_the_upgrade_keeps_its_recorded_child_id() -> None:
    """A parent whose child step recorded the id earlier versions derived finds its child
    there (here the child run was not created yet: the pass creates it, under that id)."""
    store = InMemoryWorkflowStore()
    pikku = make_family(store)
    legacy = keys.legacy_child_run_id("p-3", "kid")
    store.create_run(NewRun("p-3", "sec.parent", None, None), 0)
    store.insert_step(NewStep("p-3", "kid", CHILD_PREFIX + "sec.kid", data={"n": 1},
                              status="running", child_run_id=legacy), 0)
    dispatcher = InlineDispatcher(pikku.engine)  # driven a bounded number of times:
    dispatcher.wake_run("p-3")                    # a parent that lost its child hangs
    for _ in range(50):
        if not dispatcher.do_next():
            break
    run = pikku.get_run("p-3")
    assert run.status == "completed" and run.output == {"kid": {"n": 1}}
    assert pikku.get_run(legacy).parent_run_id == "p-3"
    with pytest.raises(Exception, match="no workflow run"):
        pikku.get_run(keys.child_run_id("p-3", "kid"))
