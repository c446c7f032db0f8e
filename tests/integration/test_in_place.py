"""Steps run in place (issue 24) on real ``celery -A`` workers: a pass in a worker runs the
step it records itself, with no message, inserted already claimed, and every fence holds.

* a sequential run sends one message in all (the start's), each attempt has a task id of
  its own that no message carries, and ``in_place_steps`` bounds a streak (the next step
  is sent, and its task starts a new streak);
* a step routed to a queue of its own is always sent;
* a worker killed in the middle of a step run in place: its lease lapses, the reaper sends
  the step, another worker runs it as attempt 2;
* a worker stalled (SIGSTOP) in the middle of one: superseded; once it wakes, its late
  write is refused, logged as a superseded step task's is, and changes nothing;
* a cancel during one: the body is told, the run ends cancelled, the step after it never
  starts.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from pikku_celery.worker.tasks import internal_task
from tests.integration import workerapp as wa
from tests.integration.test_celery_workers import (
    LEASE_EXPIRED,
    REAPER_S,
    STEP_LEASE_S,
    Cluster,
    Worker,
    attempts,
    error_type,
    make_cluster,
    wait_for,
)
from tests.support.raw import entries

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def received(worker: Worker, task: str) -> int:
    return sum(1 for ln in worker.log().splitlines()
               if f"Task {task}[" in ln and " received" in ln)


@pytest.mark.parametrize(("broker", "pool"), [("redis", "prefork"), ("rabbitmq", "threads")])
def test_a_sequential_run_sends_no_message_per_step(make_cluster: Callable[..., Cluster],
                                                    broker: str, pool: str) -> None:
    c = make_cluster(broker)
    worker = c.start("chain", pool)
    c.wait_ready(worker)
    run_id = c.pikku.start("chain", {"n": 12})
    run = c.wait(run_id, 30)
    assert run.status == "completed" and run.output == 12, (run, c.diagnostics())
    history = c.pikku.get_history(run_id)
    assert [(h.step_name, h.attempt, h.status) for h in history] == [
        (f"s{i}", 1, "succeeded") for i in range(12)]
    # Run in place: each attempt a task id of its own (issue 33: Flower, the worker log), no
    # message of its own, each by this worker's process.
    assert all(h.task_id for h in history) and len({h.task_id for h in history}) == 12
    assert not any(f"[{h.task_id}] received" in worker.log() for h in history), worker.log()
    assert all(worker.owns(int((h.worker or "").rpartition(":")[2])) for h in history)
    # One message for the whole run: the start's; not one step task.
    assert received(worker, internal_task(c.pikku.app, "orchestrate").name) == 1, worker.log()
    assert received(worker, wa.ADD) == 0, worker.log()


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_an_app_wide_time_limit_keeps_steps_in_place(
        make_cluster: Callable[..., Cluster], pool: str) -> None:
    """``task_time_limit=300`` (issue 34): the threads pool enforces no time limit, so the
    steps run in place as without it; prefork does, and the limit is a budget: pikku's
    messages carry 310 s, and the steps of a short run all fit in the first 10 s. The
    worker says which when it starts."""
    c = make_cluster("redis", **{wa.ENV_TIME_LIMIT: "300"})
    worker = c.start("limited", pool)
    c.wait_ready(worker)
    run_id = c.pikku.start("chain", {"n": 6})
    assert c.wait(run_id, 30).output == 6, c.diagnostics()
    assert received(worker, wa.ADD) == 0, worker.log()
    said = ("enforces no time limit, so task_time_limit=300.0 sends no step"
            if pool == "threads" else
            "the app sets task_time_limit=300.0: steps run in place for the first 10 s")
    assert said in worker.log(), worker.log()


def test_a_step_the_remaining_limit_cannot_cover_is_sent(
        make_cluster: Callable[..., Cluster]) -> None:
    """On prefork with ``task_time_limit=5`` the margin is 0.5 s: the slow step (1 s) starts
    in place at once; the step after it would have less than 5 s left, so it is sent, and
    its task (whose message carries 5.5 s) runs it."""
    c = make_cluster("redis", **{wa.ENV_TIME_LIMIT: "5"})
    worker = c.start("budget", "prefork")
    c.wait_ready(worker)
    run_id = c.pikku.start("one_slow", {"seconds": 1.0, "ledger": c.ledger_key})
    run = c.wait(run_id, 30)
    assert run.status == "completed", c.diagnostics()
    assert received(worker, wa.SLOW) == 0, worker.log()
    assert received(worker, wa.ADD) == 1, worker.log()
    assert [(h.step_name, h.attempt) for h in c.pikku.get_history(run_id)] == [
        ("slow", 1), ("after", 1)]


def test_a_streak_ends_after_in_place_steps_and_the_next_step_is_sent(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis", **{wa.ENV_IN_PLACE: "5"})
    worker = c.start("streaks")
    c.wait_ready(worker)
    run_id = c.pikku.start("chain", {"n": 13})
    assert c.wait(run_id, 30).output == 13, c.diagnostics()
    log = worker.log()
    sent = {h.step_name for h in c.pikku.get_history(run_id) if f"[{h.task_id}] received" in log}
    # Steps 0-4 in the start's pass, s5 sent; its task runs it and s6-s10 in place, s11
    # sent; its task runs it and s12.
    assert sent == {"s5", "s11"}, c.pikku.get_history(run_id)
    assert received(worker, wa.ADD) == 2


def test_a_step_routed_to_another_queue_is_sent(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    worker = c.start("routes")
    c.wait_ready(worker)
    run_id = c.pikku.start("forge_target", {})
    parked = wait_for(lambda: (s := c.step(run_id, "parked")) and s, 20,
                      "the parked step to be recorded", c.diagnostics)
    assert parked.status == "pending"  # sent to <queue>.parked, which nobody consumes
    first = c.pikku.get_history(run_id)[0]
    assert (first.step_name, first.status) == ("first", "succeeded") and first.task_id
    assert f"[{first.task_id}] received" not in worker.log()  # run in place
    c.pikku.cancel(run_id)


@pytest.mark.parametrize("default_retries", [False, True])
def test_a_worker_killed_in_a_step_run_in_place_loses_it_to_another(
        make_cluster: Callable[..., Cluster], default_retries: bool) -> None:
    """``default_retries``: the step says nothing of retries (issue 36: its body tries
    once, as a Celery task's does), yet its attempt lost with its worker runs again, as an
    ``acks_late`` task is redelivered."""
    c = make_cluster("redis")
    c.wait_ready(c.start("w1", "prefork"), c.start("w2", "prefork"))
    run_id = c.pikku.start("one_slow", {"seconds": 2.0, "ledger": c.ledger_key,
                                        "default_retries": default_retries})
    start1 = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
    running = c.history(run_id, "slow")
    assert attempts(running) == [(1, "running")] and running[0].task_id
    assert not any(f"[{running[0].task_id}] received" in w.log() for w in c.workers)
    doomed = c.holder_of(start1["pid"])
    doomed.kill()
    start2 = wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                      STEP_LEASE_S + REAPER_S + 5, "attempt 2 of the killed step",
                      c.diagnostics)[0]
    assert not doomed.owns(start2["pid"])
    run = c.wait(run_id, 20)
    assert run.status == "completed", (run, c.diagnostics())
    assert run.output == {"slow": {"attempt": 2, "pid": start2["pid"]}, "after": 102}
    history = c.history(run_id, "slow")
    assert attempts(history) == [(1, "failed"), (2, "succeeded")]
    assert error_type(history[0]) == LEASE_EXPIRED
    assert entries(c.pikku.engine.store, run_id, "slow") == [(1, "failed"), (2, "succeeded")]


def test_a_stalled_step_run_in_place_is_superseded_and_its_late_write_refused(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    w1, w2 = c.start("a"), c.start("b")
    c.wait_ready(w1, w2)
    run_id = c.pikku.start("one_slow", {"seconds": 2.5, "ledger": c.ledger_key})
    start1 = wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)[0]
    paused = c.holder_of(start1["pid"])
    paused.signal_group(signal.SIGSTOP)
    try:
        wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                 STEP_LEASE_S + REAPER_S + 5, "the other worker to reclaim the step",
                 c.diagnostics)
        run = c.wait(run_id, 15)
        assert run.status == "completed", (run, c.diagnostics())
        steps_before = c.pikku.get_steps(run_id)
        history_before = c.pikku.get_history(run_id)
    finally:
        paused.signal_group(signal.SIGCONT)

    def refused_line() -> str | None:
        return next((ln for ln in paused.log().splitlines()
                     if "WorkflowStepSupersededError" in ln and run_id in ln
                     and "'slow'" in ln), None)
    line = wait_for(refused_line, 15, "the late write to be refused", c.diagnostics)
    assert "attempt 1" in line and "attempt 2" in line and "in place" in line, line
    assert "Traceback" not in paused.log(), paused.log()
    wait_for(lambda: len(c.ledger()) == 4, 5, "both bodies to end", c.diagnostics)
    # The refused write, and the pass that read what happened, changed nothing.
    assert c.pikku.get_steps(run_id) == steps_before
    assert c.pikku.get_history(run_id) == history_before
    assert c.pikku.get_run(run_id).status == "completed"
    late = [e for e in c.ledger() if e["attempt"] == 1 and e["event"] == "end"]
    assert late and late[0]["lease_lost"] is True, "the late body was not told"


def test_a_cancel_during_a_step_run_in_place_tells_its_body(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis")
    worker = c.start("fenced")
    c.wait_ready(worker)
    run_id = c.pikku.start("one_slow", {"seconds": 10.0, "ledger": c.ledger_key})
    wait_for(lambda: c.starts(), 20, "the slow step to start", c.diagnostics)
    assert c.pikku.cancel(run_id, "fence the running attempt")
    wait_for(lambda: len(c.ledger()) == 2, 10, "the body to stop", c.diagnostics)
    start, end = c.ledger()
    assert end["lease_lost"] is True and end["t"] - start["t"] < 5
    assert c.pikku.get_run(run_id).status == "cancelled"
    state = c.step(run_id, "slow")
    assert (state.status, state.attempt) == ("failed", 1)
    assert error_type(state) == "WorkflowCancelledError"
    assert c.step(run_id, "after") is None  # the step after it never started
    assert "Traceback" not in worker.log(), worker.log()
