"""An exception right after the claim must not leave its attempt renewed forever (issue 21,
defect 3).

``Claimer.claim`` hands the attempt to the heartbeat, then returns; ``execute_step``'s
``try/finally`` (which stops the renewals) used to begin only after that return. A
heartbeat thread that cannot start, or Celery's soft time limit landing in between, left
the step ``running`` under a lease renewed for the life of the process: never reclaimed,
the run stuck. Now the ``finally`` covers everything from ``heartbeat.add`` on.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine.heartbeat import Heartbeat, HeldStep
from tests.unit.test_engine import Recorder


def _pikku() -> tuple[PikkuCelery, str, list[Any]]:
    pikku = PikkuCelery(Celery(f"orphan-{uuid.uuid4().hex[:6]}", broker="memory://"),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()
    ran: list[Any] = []
    step = pikku.step(name="orphan.work")(lambda data: ran.append(data))

    @pikku.workflow("orphan.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("work", step, data)

    run_id = pikku.start("orphan.flow", None)
    pikku.engine.advance(run_id)
    return pikku, run_id, ran


def test_a_heartbeat_thread_that_cannot_start_leaves_nothing_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pikku, run_id, ran = _pikku()

    def cannot_start(self: Heartbeat) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Heartbeat, "_ensure_thread", cannot_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pikku.engine.execute_step(pikku.registry.steps["orphan.work"], run_id, "work")
    assert pikku.engine.heartbeat.held() == [], "the attempt is still renewed"
    assert ran == []


def test_a_time_limit_landing_after_the_claim_leaves_nothing_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The soft time limit is raised by a signal handler, wherever the task is: here just
    after the heartbeat took the attempt, before the claim returned."""
    pikku, run_id, ran = _pikku()
    add = Heartbeat.add

    def limit_lands(self: Heartbeat, held: HeldStep) -> None:
        add(self, held)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(Heartbeat, "add", limit_lands)
    with pytest.raises(SoftTimeLimitExceeded):
        pikku.engine.execute_step(pikku.registry.steps["orphan.work"], run_id, "work")
    assert pikku.engine.heartbeat.held() == [], "the attempt is still renewed"
    assert ran == []
    step = pikku.get_steps(run_id)[0]
    assert step.status == "running"  # left to lapse: the reaper takes it back


def test_a_time_limit_landing_as_the_claim_returns_leaves_nothing_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same limit landing once the claim is done, before the caller has its result:
    only a ``try`` begun before the claim covers it."""
    pikku, run_id, ran = _pikku()
    claimer = pikku.engine.claimer
    claim = claimer.claim

    def limit_lands(*args: Any, **kwargs: Any) -> Any:
        claim(*args, **kwargs)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(claimer, "claim", limit_lands)
    with pytest.raises(SoftTimeLimitExceeded):
        pikku.engine.execute_step(pikku.registry.steps["orphan.work"], run_id, "work")
    assert pikku.engine.heartbeat.held() == [], "the attempt is still renewed"
    assert ran == []
