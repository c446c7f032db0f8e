"""Issue 12's workflow features on real ``celery -A tests.integration.workerapp worker``
processes (the helpers of ``test_celery_workers.py``): approval gates decided through
``pikku.approve`` and expired by the timer, and settled steps' Celery results."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowApprovalError,
)
from tests.conftest import REDIS_URL
from tests.integration.test_celery_workers import (  # noqa: F401 (a fixture)
    Cluster,
    make_cluster,
    wait_for,
)
from tests.support.mongod import MongoTarget


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


# --- Celery results of settled steps -------------------------------------------------------


def test_a_duplicate_of_a_settled_step_reports_its_recorded_outcome_under_its_task_id(
        mongo_server: MongoTarget, key_prefix: str) -> None:
    """A re-dispatch (new task id) of a step that already settled runs nothing and stores the
    recorded outcome under its own task id: the same SUCCESS value, the same FAILURE type
    and message. A duplicate of a step a live worker holds stores nothing at all."""
    database = f"pikku_results_{uuid.uuid4().hex[:10]}"
    app = Celery(f"dup-{uuid.uuid4().hex[:6]}", broker=REDIS_URL,
                 backend=mongo_server.url_for(database, "pikku+mongodb"))
    app.conf.task_default_queue = f"{key_prefix}-dup"
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    runs: list[str] = []
    release = threading.Event()

    @pikku.step(name="dup.double")
    def double(n: int) -> int:
        runs.append("double")
        return n * 2

    @pikku.step(name="dup.refuse", retries=0)
    def refuse(n: int) -> int:
        runs.append("refuse")
        raise ValueError(f"no {n}")

    @pikku.step(name="dup.hold")
    def hold(n: int) -> int:
        runs.append("hold")
        release.wait(30)
        return n

    @pikku.workflow("dup.flow")
    def flow(wf: Any, n: int) -> Any:
        return wf.do("double", double, n), wf.do("refuse", refuse, n)

    @pikku.workflow("dup.held")
    def held(wf: Any, n: int) -> Any:
        return wf.do("hold", hold, n)

    with start_worker(app, pool="threads", concurrency=3, perform_ping_check=False,
                      shutdown_timeout=10):
        run_id = pikku.start(flow, 21)
        assert pikku.wait(run_id, 30).status == "failed"
        assert runs == ["double", "refuse"]
        again = app.send_task("dup.double", args=[run_id, "double"])
        assert again.get(timeout=10, interval=0.05) == 42
        failed = app.send_task("dup.refuse", args=[run_id, "refuse"])
        with pytest.raises(ValueError, match="no 21"):
            failed.get(timeout=10, interval=0.05)
        assert failed.state == "FAILURE"
        assert runs == ["double", "refuse"]  # nothing ran again

        held_run = pikku.start(held, 5)
        wait_for(lambda: runs[-1:] == ["hold"], 30, "the held step to start", lambda: "")
        seen: list[str] = []
        done = threading.Event()
        # The id is chosen before the send: the duplicate can end before send_task returns.
        duplicate_id = str(uuid.uuid4())

        def postrun(sender: Any = None, task_id: str = "", **_: Any) -> None:
            if task_id == duplicate_id:
                seen.append(task_id)
                done.set()

        signals.task_postrun.connect(postrun, weak=False)
        try:
            duplicate = app.send_task("dup.hold", args=[held_run, "hold"],
                                      task_id=duplicate_id)
            assert done.wait(30)
        finally:
            signals.task_postrun.disconnect(postrun)
        assert duplicate.state == "PENDING"  # nothing stored for it: it ran nothing
        release.set()
        assert pikku.wait(held_run, 30).output == 5
        assert runs.count("hold") == 1
    app.close()


# --- graph workflows ------------------------------------------------------------------------


@pytest.mark.parametrize(("broker", "pool"), [("redis", "prefork"), ("rabbitmq", "threads")])
def test_a_graph_with_every_feature_runs_on_real_workers(
        make_cluster: Callable[..., Cluster], broker: str, pool: str) -> None:  # noqa: F811
    """Two worker processes: per-item fan-out (parallel and sequential), a join, a loop
    counted in the run state, and an error route that takes over when ``charge`` fails."""
    c = make_cluster(broker)
    workers = [c.start("graph-a", pool), c.start("graph-b", pool)]
    for worker in workers:
        c.wait_ready(worker)
    failing = c.pikku.start("graph_features", {"items": [1, 2, 3], "fail": True})
    passing = c.pikku.start("graph_features", {"items": [4, 5]})
    run = c.wait(failing, 60)
    assert run.status == "completed", (run.error, c.diagnostics())
    assert run.output == {"refund": {"refunded": "card declined", "visits": 3}}
    assert run.state == {"visits": 3, "total": 6}
    assert run.state_writers[:1] == ("items",)
    assert [w for w in run.state_writers if w.startswith("running")] == [
        "running[0]", "running[1]", "running[2]"]
    assert [w for w in run.state_writers if w.startswith("tick")] == [
        "tick", "tick#2", "tick#3"]
    steps = {s.step_name: s for s in c.pikku.get_steps(failing)}
    assert {"square[0]", "square[1]", "square[2]", "tick#3", "refund"} <= set(steps)
    assert steps["charge"].status == "failed" and steps["charge"].attempt == 2
    assert steps["join"].result == {"squares": [1, 4, 9], "totals": [1, 3, 6]}
    run = c.wait(passing, 60)
    assert run.status == "completed", (run.error, c.diagnostics())
    assert run.output == {"charge": "charged"}
    assert run.state == {"visits": 3, "total": 9}


def test_a_graph_loop_past_max_visits_fails_on_real_workers(
        make_cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    c = make_cluster("redis")
    c.wait_ready(c.start("endless", "threads"))
    run = c.wait(c.pikku.start("graph_endless", None), 60)
    assert run.status == "failed", c.diagnostics()
    assert run.error is not None and "max_visits of 4" in run.error["message"]
    names = {s.step_name for s in c.pikku.get_steps(run.run_id)}
    assert names == {"spin", "spin#2", "spin#3", "spin#4"}


def test_a_graph_node_whose_worker_is_killed_is_claimed_again(
        make_cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    """Upstream scenario 52: SIGKILL the worker running a graph node; once its lease lapses
    the node runs again as attempt 2 on the other worker, and the run completes."""
    c = make_cluster("redis")
    c.wait_ready(c.start("g1", "prefork"), c.start("g2", "prefork"))
    run_id = c.pikku.start("graph_slow", {"seconds": 2.0, "ledger": c.ledger_key})
    first = wait_for(lambda: c.starts(), 30, "the slow node to start", c.diagnostics)[0]
    assert first["attempt"] == 1
    c.holder_of(first["pid"]).kill()
    run = c.wait(run_id, 40)
    assert run.status == "completed", (run.error, c.diagnostics())
    assert run.output == {"slow": {"attempt": 2, "after": 1}}
    assert [(a.attempt, a.status) for a in c.history(run_id, "slow")] == [
        (1, "failed"), (2, "succeeded")]
    assert [(e["attempt"], e["event"]) for e in c.ledger()] == [(1, "start"), (2, "start"),
                                                                (2, "end")]


def test_runs_contending_for_their_run_leases_all_complete_each_step_once(
        make_cluster: Callable[..., Cluster]) -> None:  # noqa: F811
    """Upstream scenario 55: 20 runs of 10 parallel steps and 5 graph runs at once on two
    worker processes, whose settles race for each run's lease: every run completes with all
    its results, every step ran exactly once, and both workers advanced runs."""
    c = make_cluster("redis")
    c.wait_ready(c.start("contend-a", "threads"), c.start("contend-b", "threads"))
    wide = [c.pikku.start("wide", {"base": n * 100, "width": 10}) for n in range(20)]
    graphs = [c.pikku.start("graph_features", {"items": [n, n + 1]}) for n in range(5)]
    for n, run_id in enumerate(wide):
        run = c.wait(run_id, 90)
        assert run.status == "completed", (run.error, c.diagnostics())
        assert run.output == [n * 100 + i for i in range(10)]
    for n, run_id in enumerate(graphs):
        run = c.wait(run_id, 90)
        assert run.status == "completed", (run.error, c.diagnostics())
        assert run.output == {"charge": "charged"}
        assert run.state == {"visits": 3, "total": 2 * n + 1}
    history = [a for run_id in wide + graphs for a in c.pikku.get_history(run_id)]
    assert all(a.attempt == 1 and a.status == "succeeded" for a in history)
    pids = {int(a.worker.rpartition(":")[2]) for a in history if a.worker}
    assert all(any(w.owns(pid) for pid in pids) for w in c.workers), pids  # both ran steps
