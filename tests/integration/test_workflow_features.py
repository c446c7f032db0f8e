"""Issue 12's workflow features on real ``celery -A tests.integration.workerapp worker``
processes (the helpers of ``test_celery_workers.py``): approval gates decided through
``pikku.approve`` and expired by the timer, and settled steps' Celery results."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pikku_celery import WorkflowApprovalError
from tests.integration.test_celery_workers import (  # noqa: F401 (a fixture)
    Cluster,
    make_cluster,
    wait_for,
)


def test_an_approval_suspends_the_run_until_a_valid_decision(
        make_cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    c = make_cluster("redis")
    worker = c.start("approve", "threads")
    c.wait_ready(worker)
    run_id = c.pikku.start("approved_sum", {})
    wait_for(lambda: c.pikku.get_run(run_id).status == "suspended", 30,
             "the run to suspend at its approval", c.diagnostics)
    with pytest.raises(WorkflowApprovalError, match="required property"):
        c.pikku.approve(run_id, "manager", {"note": "no verdict"}, by="ann")
    with pytest.raises(WorkflowApprovalError, match="not one of its approvers"):
        c.pikku.approve(run_id, "manager", {"approved": True}, by="eve")
    assert c.pikku.get_run(run_id).status == "suspended"
    c.pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    run = c.wait(run_id, 30)
    assert run.status == "completed", c.diagnostics()
    assert run.output == {"decision": {"approved": True}, "sum": 3}


def test_an_approval_expiry_wakes_the_run_with_expired(
        make_cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    c = make_cluster("redis")
    worker = c.start("expire", "threads")
    c.wait_ready(worker)
    run_id = c.pikku.start("approved_sum", {"expiry": "1s"})
    run = c.wait(run_id, 30)  # woken by the expiry's timer (the reaper is the backstop)
    assert run.status == "completed" and run.output == {"expired": True}, c.diagnostics()
    with pytest.raises(WorkflowApprovalError, match="ended"):
        c.pikku.approve(run_id, "manager", {"approved": True}, by="ann")
