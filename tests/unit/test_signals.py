"""``pikku_celery.signals``: run started/finished and step attempt started/finished/superseded,
sent in order with their fields, filtered by sender, and never broken by a receiver."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowStepSupersededError,
    signals,
)

ALL = ("run_started", "run_finished", "step_attempt_started", "step_attempt_finished",
       "step_attempt_superseded")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, dict[str, Any]]] = []
        self._receivers: list[tuple[Any, Any]] = []

    def connect(self, name: str, sender: Any = None) -> None:
        def receive(sender: Any = None, signal: Any = None, **fields: Any) -> None:
            self.events.append((name, sender, fields))

        signal = getattr(signals, name)
        signal.connect(receive, sender=sender, weak=False)
        self._receivers.append((signal, receive))

    def disconnect(self) -> None:
        for signal, receive in self._receivers:
            signal.disconnect(receive)

    def names(self) -> list[tuple[str, Any]]:
        return [(name, (f.get("step_name"), f.get("attempt"), f.get("status")))
                for name, _, f in self.events]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    found = Recorder()
    for name in ALL:
        found.connect(name)
    yield found
    found.disconnect()


def _pikku() -> PikkuCelery:
    return PikkuCelery(Celery(f"signals-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False)


def test_a_run_with_a_retried_step_sends_every_signal_in_order(recorder: Recorder) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"sig{tag}.flaky", retries=2, retry_delay="1ms", bind=True)
    def flaky(ctx: Any, data: Any) -> str:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return "ok"

    @pikku.workflow(f"sig-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("flaky", flaky, data))

    run_id = pikku.start(flow, {"n": 1}, inline=True)

    assert recorder.names() == [
        ("run_started", (None, None, None)),
        ("step_attempt_started", ("flaky", 1, None)),
        ("step_attempt_finished", ("flaky", 1, "failed")),
        ("step_attempt_started", ("flaky", 2, None)),
        ("step_attempt_finished", ("flaky", 2, "succeeded")),
        ("run_finished", (None, None, "completed")),
    ]
    started, first_start, failed, _, succeeded, finished = (e for e in recorder.events)
    assert started[1] == f"sig-{tag}"  # run signals: sent by the workflow's name
    assert started[2] == {"pikku": pikku, "run_id": run_id, "workflow": f"sig-{tag}",
                          "parent_run_id": None}
    assert first_start[1] == f"sig{tag}.flaky"  # attempt signals: by the step's task name
    fields = first_start[2]
    assert (fields["run_id"], fields["max_attempts"], fields["function"],
            fields["task_id"]) == (run_id, 3, f"sig{tag}.flaky", None)  # inline: no task
    assert fields["worker"].endswith(f":{os.getpid()}")
    assert failed[2]["error"]["type"] == "RuntimeError" and failed[2]["retry_at"] is not None
    assert failed[2]["duration"] >= 0
    assert succeeded[2]["result"] == "ok" and succeeded[2]["retry_at"] is None
    assert finished[2]["status"] == "completed" and finished[2]["output"] == "ok"
    assert finished[2]["duration"] >= 0 and finished[2]["error"] is None


def test_a_final_failure_a_child_and_a_sender_filter(recorder: Recorder) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"sig{tag}.boom", retries=0)
    def boom(data: Any) -> None:
        raise ValueError("no")

    @pikku.workflow(f"sig-child-{tag}")
    def child(wf: Any, data: Any) -> None:
        wf.do("boom", boom, data)

    @pikku.workflow(f"sig-parent-{tag}")
    def parent(wf: Any, data: Any) -> Any:
        return wf.child("kid", child, data)

    only_child = Recorder()
    only_child.connect("run_finished", sender=f"sig-child-{tag}")
    try:
        run_id = pikku.start(parent, None, inline=True)
    finally:
        only_child.disconnect()

    starts = [f for name, _, f in recorder.events if name == "run_started"]
    assert [s["parent_run_id"] for s in starts] == [None, run_id]
    attempt_end = next(f for name, _, f in recorder.events if name == "step_attempt_finished")
    assert attempt_end["status"] == "failed" and attempt_end["retry_at"] is None
    ends = [(s, f["status"]) for name, s, f in recorder.events if name == "run_finished"]
    assert ends == [(f"sig-child-{tag}", "failed"), (f"sig-parent-{tag}", "failed")]
    assert [(s, f["status"]) for _, s, f in only_child.events] == [
        (f"sig-child-{tag}", "failed")]


def test_a_superseded_attempt_and_a_cancel(recorder: Recorder) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"sig{tag}.cancels", bind=True)
    def cancels(ctx: Any, data: Any) -> str:
        pikku.cancel(ctx.run_id, "changed my mind")  # fences this very attempt
        return "too late"

    @pikku.workflow(f"sig-cancel-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("s", cancels, data))

    run, _ = pikku.engine.create_run(flow, None)
    pikku.engine.advance(run.run_id, dispatcher=_Ignore())
    with pytest.raises(WorkflowStepSupersededError):
        pikku.engine.execute_step(pikku.registry.steps[f"sig{tag}.cancels"], run.run_id,
                                  "s", dispatcher=_Ignore(), task_id="task-123")

    names = recorder.names()
    assert names[-3:] == [("step_attempt_started", ("s", 1, None)),
                          ("run_finished", (None, None, "cancelled")),
                          ("step_attempt_superseded", ("s", 1, "superseded"))]
    superseded = recorder.events[-1][2]
    # A cancel fences the attempt without a newer one: the current attempt is still 1.
    assert superseded["task_id"] == "task-123" and superseded["current_attempt"] == 1
    cancelled = recorder.events[-2][2]
    assert "changed my mind" in cancelled["error"]["message"]


def test_a_receiver_that_raises_breaks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"sig{tag}.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow(f"sig-raise-{tag}")
    def flow(wf: Any, data: Any) -> int:
        return int(wf.do("one", one, data))

    def broken(**_: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.step_attempt_finished.connect(broken, weak=False)
    try:
        run_id = pikku.start(flow, None, inline=True)
    finally:
        signals.step_attempt_finished.disconnect(broken)
    assert pikku.get_run(run_id).status == "completed"
    assert any("receiver bug" in r.getMessage() for r in caplog.records)


class _Ignore:
    def dispatch_step(self, *args: Any) -> None: ...

    def wake_run(self, *args: Any, **kwargs: Any) -> None: ...

    def arm_timer(self, *args: Any) -> None: ...


def test_the_task_id_is_recorded_unless_it_could_not_be_a_task_id() -> None:
    """A message chooses its task id: a normal one is recorded with the attempt, one too
    large to be an id (forged) is not stored, and the attempt still runs."""
    pikku = _pikku()
    pikku.engine.dispatcher = _Ignore()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"sig{tag}.flaky", bind=True, retries=1, retry_delay="1ms")
    def flaky(ctx: Any, data: Any) -> str:
        if ctx.attempt == 1:
            raise RuntimeError("once")
        return "ok"

    @pikku.workflow(f"sig-ids-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("s", flaky, data))

    run, _ = pikku.engine.create_run(flow, None)
    pikku.engine.advance(run.run_id)
    task = pikku.app.tasks[f"sig{tag}.flaky"]
    first = task.apply(args=(run.run_id, "s"), task_id="celery-task-1")
    assert first.state == "RETRY"  # attempts left: Celery's word for it, not FAILURE
    second = task.apply(args=(run.run_id, "s"), task_id="x" * 300)
    assert second.state == "SUCCESS"
    assert [(a.attempt, a.status, a.task_id) for a in pikku.get_history(run.run_id)] == [
        (1, "failed", "celery-task-1"), (2, "succeeded", None)]
