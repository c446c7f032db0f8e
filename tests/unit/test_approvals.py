"""Approval gates (``wf.approval`` / ``pikku.approve``) through inline runs: the decision is
the step's result, a refused decision leaves the run suspended, expiry wakes the run with
``{"expired": True}`` (timer or reaper), and a decision racing a suspending pass or the
expiry settles the gate exactly once. Upstream: §5.6 (approval), scenario 57."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    PikkuCelery,
    WorkflowApprovalError,
)
from pikku_celery.testing import VirtualClock
from pikku_celery.worker.inline import InlineDispatcher, run_inline
from tests.unit.test_engine import Recorder

SCHEMA = {"type": "object", "required": ["approved"],
          "properties": {"approved": {"type": "boolean"}, "note": {"type": "string"}}}


@pytest.fixture
def pikku() -> Iterator[PikkuCelery]:
    app = Celery(f"test-{id(object())}", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)

    @pikku.step()
    def record(data: Any) -> Any:
        return data

    @pikku.workflow()
    def onboarding(wf: Any, data: Any) -> Any:
        wf.do("prepare", record, 1)
        decision = wf.approval("manager", schema=SCHEMA, approvers=["ann", "bob"],
                               expiry=data.get("expiry") if data else None)
        if decision.get("expired"):
            return "expired"
        return wf.do("after", record, "yes" if decision["approved"] else "no")

    yield pikku


def gate(pikku: PikkuCelery, run_id: str) -> Any:
    return {s.step_name: s for s in pikku.get_steps(run_id)}["__approval:manager"]


def test_a_valid_decision_is_the_step_result_and_continues_the_run(pikku: PikkuCelery) -> None:
    run_id = pikku.start("onboarding", None, inline=True)
    assert pikku.get_run(run_id).status == "suspended"
    assert pikku.engine.advance(run_id) == "waiting"  # a pass on a suspended run waits
    pikku.engine.dispatcher = Recorder()
    with pytest.raises(InvalidInputError, match=r"approver \(by\) '\$ann' is not allowed"):
        pikku.approve(run_id, "manager", {"approved": True}, by="$ann")
    settled = pikku.approve(run_id, "manager", {"approved": True, "note": "ok"}, by="ann")
    assert settled.status == "succeeded" and settled.result == {"approved": True, "note": "ok"}
    assert pikku.get_run(run_id).status == "running"
    assert run_inline(pikku.engine, run_id).output == "yes"
    assert gate(pikku, run_id).result == {"approved": True, "note": "ok"}
    decided = [a for a in pikku.get_history(run_id) if a.step_name == "__approval:manager"]
    assert [(a.status, a.worker) for a in decided] == [("succeeded", "ann")]  # who decided


@pytest.mark.parametrize(("decision", "by", "reason"), [
    ({"approved": "sure"}, "ann", r"does not match its schema: approved: 'sure' is not of "
                                  r"type 'boolean'"),
    ({"note": "x"}, "ann", "'approved' is a required property"),
    ({"approved": True}, "eve", "'eve' is not one of its approvers"),
    ({"approved": True}, None, "no approver"),
])
def test_an_invalid_or_unauthorized_decision_is_refused_and_the_run_stays_suspended(
        pikku: PikkuCelery, decision: Any, by: str | None, reason: str) -> None:
    run_id = pikku.start("onboarding", None, inline=True)
    with pytest.raises(WorkflowApprovalError, match=reason):
        pikku.approve(run_id, "manager", decision, by=by)
    assert pikku.get_run(run_id).status == "suspended"
    assert gate(pikku, run_id).status == "scheduled"  # nothing recorded
    pikku.engine.dispatcher = Recorder()
    pikku.approve(run_id, "manager", {"approved": False}, by="bob")  # a correct one lands
    assert run_inline(pikku.engine, run_id).output == "no"


def test_a_second_decision_an_unknown_gate_and_an_ended_run_are_refused(
        pikku: PikkuCelery) -> None:
    run_id = pikku.start("onboarding", None, inline=True)
    with pytest.raises(WorkflowApprovalError, match="does not wait on this approval"):
        pikku.approve(run_id, "finance", {"approved": True}, by="ann")
    pikku.engine.dispatcher = Recorder()
    pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    with pytest.raises(WorkflowApprovalError, match="already decided"):
        pikku.approve(run_id, "manager", {"approved": False}, by="bob")
    assert run_inline(pikku.engine, run_id).output == "yes"
    with pytest.raises(WorkflowApprovalError, match="the run has ended"):
        pikku.approve(run_id, "manager", {"approved": False}, by="bob")
    assert gate(pikku, run_id).result == {"approved": True}


def test_expiry_elapsing_records_expired_and_wakes_the_run(pikku: PikkuCelery) -> None:
    clock = VirtualClock()
    pikku.engine.clock = clock
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("onboarding", {"expiry": "1h"})
    started_ms = clock.now_ms()
    assert run_inline(pikku.engine, run_id).status == "suspended"  # its timer not yet due
    step_name = "__approval:manager"
    expires_at_ms = gate(pikku, run_id).data["expires_at_ms"]
    assert started_ms + 3_600_000 <= expires_at_ms <= clock.now_ms() + 3_600_000
    assert round(gate(pikku, run_id).due_at.timestamp() * 1000) == expires_at_ms
    clock.advance("1h")
    with pytest.raises(WorkflowApprovalError, match="expiry has passed"):
        pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    assert pikku.engine.fire_timer(run_id, step_name) == "fired"
    assert recorder.woken_for == [None, step_name]  # start, then the timer
    assert run_inline(pikku.engine, run_id).output == "expired"
    assert gate(pikku, run_id).result == {"expired": True}


def test_the_reaper_wakes_a_run_whose_expiry_timer_was_lost(pikku: PikkuCelery) -> None:
    clock = VirtualClock()
    pikku.engine.clock = clock
    pikku.engine.leases._clock_ms = clock.now_ms  # the reaper reads the lease clock
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("onboarding", {"expiry": "10m"})
    assert run_inline(pikku.engine, run_id).status == "suspended"
    recorder.wakes.clear()
    clock.advance("11m")  # the timer message never came
    assert pikku.reap()["due"] == 1
    assert recorder.wakes == [(run_id, 0.0)]
    assert run_inline(pikku.engine, run_id).output == "expired"


def test_a_decision_before_the_expiry_wins_and_the_expiry_changes_nothing(
        pikku: PikkuCelery) -> None:
    clock = VirtualClock()
    pikku.engine.clock = clock
    pikku.engine.dispatcher = Recorder()
    run_id = pikku.start("onboarding", {"expiry": "1h"})
    assert run_inline(pikku.engine, run_id).status == "suspended"
    pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    clock.advance("2h")
    assert not pikku.engine.store.settle_waiting_step(  # the expiry's write is refused
        run_id, "__approval:manager", clock.now_ms(), result={"expired": True})
    assert run_inline(pikku.engine, run_id).output == "yes"


def test_a_decision_racing_a_suspending_pass_leaves_the_run_running(
        pikku: PikkuCelery) -> None:
    """The decision lands between the pass's read of the gate and its suspend write: the
    pass re-reads the gate after its write and takes the run back (as for resume)."""
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    run_id = pikku.start("onboarding", None)
    assert run_inline(pikku.engine, run_id).status == "suspended"
    store = pikku.engine.store
    real = store.transition_run
    # Next pass: the view still shows the gate waiting; the decision lands just before
    # the pass's suspend write.
    store.transition_run(run_id, ["suspended"], "running", pikku.engine.now_ms())

    def racing(run: str, frm: Any, to: str, now: int, **kw: Any) -> bool:
        if to == "suspended":
            store.transition_run = real  # type: ignore[method-assign]
            pikku.approve(run_id, "manager", {"approved": True}, by="ann")
        return real(run, frm, to, now, **kw)

    store.transition_run = racing  # type: ignore[method-assign]
    inline = InlineDispatcher(pikku.engine)
    pikku.engine.advance(run_id, inline, step_name="prepare")  # the view keeps the gate
    assert pikku.get_run(run_id).status == "running"
    while inline.do_next():
        pass
    assert pikku.get_run(run_id).output == "yes"


def test_a_bad_schema_or_approvers_fails_the_run_where_it_is_declared(
        pikku: PikkuCelery) -> None:
    @pikku.workflow()
    def bad_schema(wf: Any, data: Any) -> Any:
        return wf.approval("x", schema={"type": 12})

    @pikku.workflow()
    def bad_approvers(wf: Any, data: Any) -> Any:
        return wf.approval("x", approvers=[])

    run = pikku.get_run(pikku.start(bad_schema, None, inline=True))
    assert run.status == "failed" and "not a valid JSON Schema" in run.error["message"]
    run = pikku.get_run(pikku.start(bad_approvers, None, inline=True))
    assert run.status == "failed" and "approvers must be non-empty" in run.error["message"]


def test_an_approval_in_a_loop_waits_every_time(pikku: PikkuCelery) -> None:
    @pikku.workflow()
    def rounds(wf: Any, data: Any) -> list[Any]:
        return [wf.approval("review") for _ in range(2)]

    run_id = pikku.start(rounds, None, inline=True)
    pikku.engine.dispatcher = Recorder()
    pikku.approve(run_id, "review", "first")
    assert run_inline(pikku.engine, run_id).status == "suspended"
    pikku.approve(run_id, "review", "second")
    assert run_inline(pikku.engine, run_id).output == ["first", "second"]


def test_cancelling_a_run_waiting_on_an_approval_ends_it(pikku: PikkuCelery) -> None:
    run_id = pikku.start("onboarding", None, inline=True)
    assert pikku.cancel(run_id, "no longer needed")
    with pytest.raises(WorkflowApprovalError, match="ended"):
        pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    assert gate(pikku, run_id).status == "failed"


def _dies_before_the_run_moves(pikku: PikkuCelery) -> None:
    """The store fails the next move out of ``suspended`` (the opener's second write), as
    a process that dies, or loses MongoDB, between the two writes."""
    store = pikku.engine.store
    real = store.transition_run

    def blip(run_id: str, from_statuses: Any, to: str, now_ms: int, **kw: Any) -> bool:
        if to == "running":
            store.transition_run = real  # type: ignore[method-assign]
            raise ConnectionError("MongoDB went away")
        return real(run_id, from_statuses, to, now_ms, **kw)

    store.transition_run = blip  # type: ignore[method-assign]


def _virtual_time(pikku: PikkuCelery) -> VirtualClock:
    clock = VirtualClock()
    pikku.engine.clock = clock
    pikku.engine.leases._clock_ms = clock.now_ms  # type: ignore[attr-defined]
    return clock


def test_a_decision_whose_writer_dies_before_the_run_moves_is_finished_by_the_reaper(
        pikku: PikkuCelery) -> None:
    clock = _virtual_time(pikku)
    run_id = pikku.start("onboarding", None, inline=True)
    assert pikku.get_run(run_id).status == "suspended"
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    _dies_before_the_run_moves(pikku)
    with pytest.raises(ConnectionError):
        pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    assert gate(pikku, run_id).status == "succeeded"  # decided; the run did not move
    with pytest.raises(WorkflowApprovalError):  # decided: a retry is refused
        pikku.approve(run_id, "manager", {"approved": True}, by="ann")
    pikku.reap()
    assert recorder.wakes == [] and pikku.get_run(run_id).status == "suspended"
    clock.advance(pikku.engine.settings.stalled_after_ms / 1000 + 1)
    pikku.reap()
    assert [w[0] for w in recorder.wakes] == [run_id]
    assert pikku.get_run(run_id).status == "running"
    assert run_inline(pikku.engine, run_id).output == "yes"
    recorder.wakes.clear()
    clock.advance("1h")
    pikku.reap()
    assert recorder.wakes == []  # the check ended: one wake, not one per sweep


def test_an_expiry_whose_pass_dies_before_the_run_moves_is_finished_by_the_reaper(
        pikku: PikkuCelery) -> None:
    clock = _virtual_time(pikku)
    run_id = pikku.start("onboarding", {"expiry": "10m"}, inline=True)
    clock.advance("11m")
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    _dies_before_the_run_moves(pikku)
    with pytest.raises(ConnectionError):
        pikku.engine.advance(run_id, step_name="__approval:manager")
    assert gate(pikku, run_id).result == {"expired": True}
    assert pikku.get_run(run_id).status == "suspended"
    clock.advance(pikku.engine.settings.stalled_after_ms / 1000 + 1)
    pikku.reap()
    assert pikku.get_run(run_id).status == "running"
    assert run_id in [w[0] for w in recorder.wakes]
    assert run_inline(pikku.engine, run_id).output == "expired"


def test_a_resume_that_dies_before_the_run_moves_is_finished_by_the_reaper(
        pikku: PikkuCelery) -> None:
    @pikku.workflow()
    def held(wf: Any, data: Any) -> Any:
        wf.suspend("wait for ops")
        return "released"

    clock = _virtual_time(pikku)
    run_id = pikku.start("held", None, inline=True)
    assert pikku.get_run(run_id).status == "suspended"
    pikku.engine.dispatcher = Recorder()
    _dies_before_the_run_moves(pikku)
    with pytest.raises(ConnectionError):
        pikku.resume(run_id)
    clock.advance(pikku.engine.settings.stalled_after_ms / 1000 + 1)
    pikku.reap()
    assert pikku.get_run(run_id).status == "running"
    assert run_inline(pikku.engine, run_id).output == "released"


def test_a_standard_json_schema_with_dollar_keys_and_dotted_names_works(
        pikku: PikkuCelery) -> None:
    """``$schema``, ``$defs``, ``$ref`` and a property named with a dot are ordinary JSON
    Schema; the gate stores the schema as JSON text, since MongoDB refuses such keys."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$defs": {"verdict": {"type": "boolean"}},
              "type": "object", "required": ["approved"],
              "properties": {"approved": {"$ref": "#/$defs/verdict"},
                             "cost.centre": {"type": "string"}}}

    @pikku.workflow()
    def standard(wf: Any, data: Any) -> Any:
        return wf.approval("finance", schema=schema)

    run_id = pikku.start("standard", None, inline=True)
    assert pikku.get_run(run_id).status == "suspended", pikku.get_run(run_id).error
    with pytest.raises(WorkflowApprovalError, match="approved"):
        pikku.approve(run_id, "finance", {"approved": "yes"})
    with pytest.raises(InvalidInputError, match=r"cost\.centre"):  # as any step result
        pikku.approve(run_id, "finance", {"approved": True, "cost.centre": "R&D"})
    pikku.approve(run_id, "finance", {"approved": True})
    run = run_inline(pikku.engine, run_id)
    assert run.status == "completed" and run.output == {"approved": True}


def test_a_decision_cannot_pass_itself_off_as_the_expiry(pikku: PikkuCelery) -> None:
    run_id = pikku.start("onboarding", {"expiry": "1h"}, inline=True)
    with pytest.raises(WorkflowApprovalError, match="'expired' key: it is reserved"):
        pikku.approve(run_id, "manager", {"approved": False, "expired": True}, by="ann")
    assert gate(pikku, run_id).status == "scheduled"
    assert pikku.get_run(run_id).status == "suspended"


def test_steps_a_run_left_are_fenced_by_the_next_pass_if_its_finisher_stopped_early(
        pikku: PikkuCelery) -> None:
    """``finish`` ends the run, then fences what it left unsettled (two writes). A writer
    that stops in between left a step the reaper would dispatch and run after the run
    ended; the next pass, finding the run ended, fences it."""
    @pikku.step()
    def background(data: Any) -> Any:
        return data

    @pikku.workflow()
    def fire_and_forget(wf: Any, data: Any) -> Any:
        wf.call("bg", background, 1)
        return "done"

    clock = _virtual_time(pikku)
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    store = pikku.engine.store
    real = store.cancel_steps

    def stops(*args: Any, **kwargs: Any) -> int:
        store.cancel_steps = real  # type: ignore[method-assign]
        raise ConnectionError("the finisher stopped here")

    store.cancel_steps = stops  # type: ignore[method-assign]
    run_id = pikku.start("fire_and_forget", None)
    with pytest.raises(ConnectionError):
        pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "completed"
    assert step_named(pikku, run_id, "bg").status == "pending"
    pikku.engine.advance(run_id)  # the orchestrator message, redelivered
    leftover = step_named(pikku, run_id, "bg")
    assert leftover.status == "failed" and leftover.error is not None
    assert leftover.error["type"] == "WorkflowRunEnded"
    recorder.steps.clear()
    clock.advance(pikku.engine.settings.undispatched_after_ms / 1000 + 1)
    pikku.reap()
    assert recorder.steps == []  # nothing of the ended run is dispatched again


def step_named(pikku: PikkuCelery, run_id: str, name: str) -> Any:
    return {s.step_name: s for s in pikku.get_steps(run_id)}[name]


def test_a_wake_check_never_moves_a_run_suspended_behind_a_later_gate(
        pikku: PikkuCelery, caplog: pytest.LogCaptureFixture) -> None:
    """The opener moved and woke the run but stopped before it cleared its wake check; the
    run went on and now waits at a second gate. The reaper's check must leave it there."""
    @pikku.workflow()
    def two_gates(wf: Any, data: Any) -> Any:
        first = wf.approval("first")
        second = wf.approval("second")
        return [first, second]

    clock = _virtual_time(pikku)
    run_id = pikku.start("two_gates", None, inline=True)
    store = pikku.engine.store
    real = store.clear_wake_check

    def stops(*args: Any, **kwargs: Any) -> bool:
        store.clear_wake_check = real  # type: ignore[method-assign]
        raise ConnectionError("the opener stopped before it cleared its check")

    store.clear_wake_check = stops  # type: ignore[method-assign]
    pikku.engine.dispatcher = Recorder()
    with pytest.raises(ConnectionError):
        pikku.approve(run_id, "first", "yes")
    assert run_inline(pikku.engine, run_id).status == "suspended"  # at "second"
    recorder = Recorder()
    pikku.engine.dispatcher = recorder
    clock.advance(pikku.engine.settings.stalled_after_ms / 1000 + 1)
    pikku.reap()
    assert pikku.get_run(run_id).status == "suspended" and recorder.wakes == []
    assert "left suspended" not in caplog.text
    recorder.wakes.clear()
    clock.advance("1h")
    pikku.reap()
    assert recorder.wakes == []  # the check was cleared
    pikku.approve(run_id, "second", "also")
    assert run_inline(pikku.engine, run_id).output == ["yes", "also"]
