"""A transactional step on real ``celery -A`` workers and the real replica set (issue 26,
item 4): its first attempt is stalled past its lease (SIGSTOP) after writing its order in
its transaction, a second attempt on the other worker writes its own and commits, then the
first is woken: its settle is refused, its transaction aborted, and the app's collection
holds the second attempt's order only."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from tests.integration.test_celery_workers import (
    REAPER_S,
    TASK_PER_STEP,
    Cluster,
    make_cluster,
    wait_for,
)

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
LEASE_S = 3.0  # the step's own lease (tests/integration/workerapp.py: it.place)


def test_a_stalled_attempts_writes_roll_back_and_the_winners_stay(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis", **TASK_PER_STEP)
    w1, w2 = c.start("a"), c.start("b")
    c.wait_ready(w1, w2)
    run_id = c.pikku.start("txn_order", {"order": "o-1", "seconds": 1.0,
                                         "ledger": c.ledger_key})
    start1 = wait_for(lambda: c.starts(), 20, "the first attempt to write its order",
                      c.diagnostics)[0]
    paused = c.holder_of(start1["pid"])
    other = w2 if paused is w1 else w1
    paused.signal_group(signal.SIGSTOP)
    try:
        wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                 LEASE_S + REAPER_S + 10, "the other worker to reclaim the step",
                 c.diagnostics)
        run = c.wait(run_id, 20)
        assert run.status == "completed", (run, c.diagnostics())
    finally:
        paused.signal_group(signal.SIGCONT)
    # The woken attempt finishes its body, and its settle is refused.
    wait_for(lambda: next((ln for ln in paused.log().splitlines()
                           if "WorkflowStepSupersededError" in ln and run_id in ln), None),
             20, "the woken attempt to be refused", c.diagnostics)
    orders = c.pikku.engine.store.db["orders"]  # type: ignore[attr-defined]
    written = [(d["order"], d["attempt"]) for d in orders.find({})]
    assert written == [("o-1", 2)], (written, c.diagnostics())
    assert other.owns(next(d for d in orders.find({}))["pid"])
    step = c.step(run_id, "place")
    assert (step.status, step.attempt, step.result["attempt"]) == ("succeeded", 2, 2)
    assert run.output == {"placed": step.result}
