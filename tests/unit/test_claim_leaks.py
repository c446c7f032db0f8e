"""Whatever escapes a step delivery between its claim and its settle, the process stops
renewing that attempt: its lease lapses and the reaper takes the step back (a hold left in
the heartbeat kept the step ``running`` for as long as the worker process lived)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from tests.unit.test_engine import Recorder
from tests.unit.test_hardening import FakeClock


def _pikku(clock: FakeClock) -> PikkuCelery:
    pikku = PikkuCelery(Celery("claim-leaks", broker="memory://"),
                        store=InMemoryWorkflowStore(),
                        leases=InMemoryLeaseService(clock_ms=clock), step_lease=1.0,
                        undispatched_after=30, stalled_after=30, worker_reaper=False)
    pikku.engine.clock._resync_s = 0  # type: ignore[attr-defined]
    pikku.engine.dispatcher = Recorder()
    return pikku


class Unprintable(Exception):
    def __init__(self, code: int) -> None:  # no super().__init__: __str__ fails
        self.code = code

    def __str__(self) -> str:
        return f"{self.msg} ({self.code})"  # type: ignore[attr-defined]


def test_an_error_whose_message_cannot_be_read_still_fails_its_attempt() -> None:
    clock = FakeClock()
    pikku = _pikku(clock)

    @pikku.step(name="leaks.unprintable", retries=1, retry_delay=0)
    def body(data: Any) -> Any:
        raise Unprintable(42)

    @pikku.workflow("leaks.one")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", body)

    run_id = pikku.start("leaks.one", None)
    pikku.engine.advance(run_id)
    outcome = pikku.engine.execute_step(pikku.registry.steps["leaks.unprintable"], run_id, "s")
    assert outcome.kind == "failed"
    step = pikku.get_steps(run_id)[0]
    assert step.status == "failed" and step.error is not None
    assert step.error["type"] == "Unprintable"
    assert step.error["message"] == "<unprintable Unprintable>"
    assert pikku.engine.heartbeat.held() == []


def test_an_exception_escaping_before_the_settle_lets_the_lease_lapse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As a soft time limit raised while the result is checked would: the step is
    taken back once its lease lapses, not held for the life of the process."""
    clock = FakeClock()
    pikku = _pikku(clock)

    @pikku.step(name="leaks.ok", retries=1)  # taken back once: attempt 2
    def body(data: Any) -> int:
        return 1

    @pikku.workflow("leaks.two")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", body)

    run_id = pikku.start("leaks.two", None)
    pikku.engine.advance(run_id)
    definition = pikku.registry.steps["leaks.ok"]
    claimer = pikku.engine.claimer
    # The settle alone, or with the end's mark (the pass after it ends the run): either way.
    writes = {name: getattr(claimer, name) for name in ("succeed", "settle_then_insert")}

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("time limit while the result was checked")

    for name in writes:
        monkeypatch.setattr(claimer, name, interrupted)
    with pytest.raises(RuntimeError):
        pikku.engine.execute_step(definition, run_id, "s")
    assert pikku.engine.heartbeat.held() == []  # nothing renews it any more
    for name, real in writes.items():
        monkeypatch.setattr(claimer, name, real)
    clock.ms += 1_500  # past the 1 s lease
    assert pikku.reap()["lapsed"] == 1
    outcome = pikku.engine.execute_step(definition, run_id, "s")
    assert outcome.kind == "succeeded" and outcome.attempt == 2


def test_an_unstorable_result_keeps_its_lease_until_its_failure_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37 (the 8 MiB step of the chaos profile on the delay switch): checking a large
    result and writing the failure take time, and the attempt used to stop renewing its
    lease before either, so another worker could claim the step meanwhile and the failure
    was refused. The attempt stays held until the failure is written, then lets go."""
    clock = FakeClock()
    pikku = _pikku(clock)
    held_at_write: list[bool] = []

    @pikku.step(name="leaks.huge", retries=3, retry_delay=0)
    def body(data: Any) -> Any:
        return "x" * (17 * 1024 * 1024)  # past MongoDB's 16 MiB document limit

    @pikku.workflow("leaks.big")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", body)

    store = pikku.engine.store
    set_error = store.set_error

    def watched(*args: Any, **kwargs: Any) -> Any:
        held_at_write.append(bool(pikku.engine.heartbeat.held()))
        return set_error(*args, **kwargs)

    monkeypatch.setattr(store, "set_error", watched)
    run_id = pikku.start("leaks.big", None)
    pikku.engine.advance(run_id)
    outcome = pikku.engine.execute_step(pikku.registry.steps["leaks.huge"], run_id, "s")
    assert outcome.kind == "failed"
    step = pikku.get_steps(run_id)[0]
    assert step.status == "failed" and step.due_at is None  # for good, retries or not
    assert held_at_write == [True]  # renewed while the failure was written
    assert pikku.engine.heartbeat.held() == []  # and let go after
