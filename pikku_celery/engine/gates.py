"""Gates: what a run waits on that is opened from outside a pass. ``resume`` opens a
suspension (``wf.suspend``), ``approve`` decides an approval (``wf.approval``),
``fire_timer`` sends the work a due sleep or retry delay was holding back.

A gate is opened *before* the run moves from ``suspended`` to ``running``: a pass that was
suspending the run meanwhile re-reads the gate after its own write and takes the run back
(``passes._PassHost.suspend_run``), so no order of the two leaves a run suspended behind an
open gate. Each opening leaves a wake check on the gate that the reaper acts on only if
the opener stopped before it moved the run (``Settings.wake_check_ms``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from pikku_celery.engine.protocols import Dispatcher, Settings
from pikku_celery.engine.reads import get_run
from pikku_celery.model.clock import Clock
from pikku_celery.model.errors import WorkflowApprovalError
from pikku_celery.model.records import RUN_RUNNING, RUN_SUSPENDED, STEP_SCHEDULED, StepState
from pikku_celery.model.validate import check_name
from pikku_celery.model.views import RunView, timer_due_ms
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.replay import APPROVAL_PREFIX, SUSPEND_PREFIX

log = logging.getLogger("pikku_celery")
_LIVE = (RUN_RUNNING, RUN_SUSPENDED)


class Gates:
    """Opens gates; ``dispatcher`` and ``clock`` are the engine's (it sets them again when
    they are replaced)."""

    def __init__(self, store: WorkflowStore, settings: Settings, clock: Clock,
                 dispatcher: Dispatcher) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.dispatcher = dispatcher

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def resume(self, run_id: str) -> bool:
        """Release a suspended run: open its suspension gates, then move it to ``running``
        and wake it. ``False`` when there was nothing to resume."""
        if get_run(self.store, run_id).status not in _LIVE:
            return False
        now = self.now_ms()
        check = self.settings.wake_check_ms(now)
        opened: list[str] = []
        for step in self.store.list_steps(run_id):
            if step.step_name.startswith(SUSPEND_PREFIX) and step.status == STEP_SCHEDULED \
                    and self.store.settle_waiting_step(run_id, step.step_name, now, gate=True,
                                                       result={"resumed_at_ms": now},
                                                       wake_check_ms=check):
                opened.append(step.step_name)
        moved = self.store.transition_run(run_id, [RUN_SUSPENDED], RUN_RUNNING, now)
        if not (opened or moved):
            return False
        self.dispatcher.wake_run(run_id)
        for gate in opened:  # moved and woken: the reaper has nothing to finish
            self.store.clear_wake_check(run_id, gate, check)
        return True

    def approve(self, run_id: str, name: str, decision: Any, *, by: str | None = None
                ) -> StepState:
        """Record ``decision`` for the approval gate ``name`` the run waits on
        (``wf.approval``), then move the run to ``running`` and wake it; returns the
        settled gate. Raises ``WorkflowApprovalError`` (and records nothing: the run stays
        suspended) when the run does not wait on that gate, ``by`` is not an approver, or
        the decision does not match the gate's schema.

        The decision is one guarded write on the gate (still waiting, expiry not passed),
        so of a decision, a second decision and the expiry exactly one settles the gate."""
        check_name("approval name", name)
        if by is not None:
            check_name("approver (by)", by)
        if isinstance(decision, dict) and "expired" in decision:
            # The expiry's own result: a decision that looked like it would read as one.
            raise WorkflowApprovalError(
                run_id, name, "a decision may not have an 'expired' key: it is reserved for "
                              "the result of the gate's expiry ({'expired': True})")
        run = get_run(self.store, run_id)
        if run.status not in _LIVE:
            raise WorkflowApprovalError(run_id, name, f"the run has ended ({run.status})")
        gate = self._waiting_gate(run_id, name)
        data = gate.data if isinstance(gate.data, dict) else {}
        approvers = data.get("approvers")
        if approvers is not None and by not in approvers:
            raise WorkflowApprovalError(
                run_id, name, f"{by!r} is not one of its approvers" if by is not None
                else "it has approvers, and no approver (by=) was given")
        text = data.get("schema_json")  # "schema": a gate an earlier version recorded
        _check_schema(run_id, name, json.loads(text) if isinstance(text, str)
                      else data.get("schema"), decision)
        now = self.now_ms()
        check = self.settings.wake_check_ms(now)
        if not self.store.settle_waiting_step(run_id, gate.step_name, now, gate=True,
                                              result=decision, by=by, wake_check_ms=check):
            raise WorkflowApprovalError(
                run_id, name, "it was decided or expired meanwhile")
        log.info("pikku: approval %r of run %s decided%s", name, run_id,
                 f" by {by}" if by is not None else "")
        self.store.transition_run(run_id, [RUN_SUSPENDED], RUN_RUNNING, self.now_ms())
        self.dispatcher.wake_run(run_id, step_name=gate.step_name)
        self.store.clear_wake_check(run_id, gate.step_name, check)  # nothing left to finish
        settled = self.store.get_step(run_id, gate.step_name)
        assert settled is not None
        return settled

    def _waiting_gate(self, run_id: str, name: str) -> StepState:
        """The approval gate ``name`` that waits now (in a loop, the latest reach)."""
        waiting = [s for s in self.store.list_steps(run_id)
                   if s.step_name.startswith(APPROVAL_PREFIX) and s.function is None
                   and isinstance(s.data, dict) and s.data.get("approval") == name]
        open_gates = [s for s in waiting if s.status == STEP_SCHEDULED
                      and (s.due_at is None or s.due_at.timestamp() * 1000 > self.now_ms())]
        if open_gates:
            return open_gates[-1]
        if any(s.status == STEP_SCHEDULED for s in waiting):
            raise WorkflowApprovalError(run_id, name, "its expiry has passed")
        if waiting:
            raise WorkflowApprovalError(run_id, name, "it was already decided")
        raise WorkflowApprovalError(run_id, name, "the run does not wait on this approval "
                                                  "(it has not reached it)")

    def fire_timer(self, run_id: str, step_name: str, dispatcher: Dispatcher | None = None
                   ) -> str:
        """A timer for a sleep or a retry delay came due (or a chunk of a long one did)."""
        dispatcher = dispatcher or self.dispatcher
        state = self.store.get_step(run_id, step_name)
        if state is None or state.due_at is None:
            return "settled"
        due_ms = int(state.due_at.timestamp() * 1000)
        if due_ms > self.now_ms():
            dispatcher.arm_timer(run_id, step_name, due_ms)
            return "rearmed"
        if state.function is None:
            dispatcher.wake_run(run_id, step_name=step_name)
        else:
            dispatcher.dispatch_step(state.function, run_id, step_name)
        return "fired"


def _check_schema(run_id: str, name: str, schema: Any, decision: Any) -> None:
    """Raise ``WorkflowApprovalError`` when ``decision`` does not match the gate's JSON
    ``schema`` (``None``: any decision)."""
    if schema is None:
        return
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(decision))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the decision"
        raise WorkflowApprovalError(
            run_id, name, f"the decision does not match its schema: {where}: "
                          f"{error.message}")


def rearm_early_wakes(view: RunView, marks: Iterable[str], dispatcher: Dispatcher,
                      now_ms: int) -> None:
    """A timer fires on its process's estimate of the lease service's clock
    (``clock.ServerClock``), and the pass it wakes may run in another process whose
    estimate is a few milliseconds behind: that pass finds the sleep, or the gate's expiry,
    not due yet and pauses. Nothing else would wake the run before a reaper sweep (none at
    all for an inline run), as for a retry's early timer (``outcomes``). So a pass woken for
    such a step (its timer's mark) that finds it not due arms its timer again, on this
    pass's clock: one timer per early wake, and only a timer that found the step due wakes
    a pass with its mark."""
    for name in marks:
        state = view.steps.get(name)
        due_ms = None if state is None else timer_due_ms(state)
        if due_ms is not None and due_ms > now_ms:
            dispatcher.arm_timer(view.run.run_id, name, due_ms)
