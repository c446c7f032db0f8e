"""The workflow engine: starts runs, advances them by replay under the run lease (the passes
live in ``passes.py``), executes steps through the claim layer, sweeps for lost work. No
Celery import: the Celery tasks in ``tasks.py`` are thin shells over these methods, and
inline runs use them directly."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from pikku_celery import keys
from pikku_celery.claims import Claimed, Claimer, NotClaimed, StepContext, serialize_error
from pikku_celery.clock import Clock, ServerClock
from pikku_celery.definitions import Registry, StepDefinition
from pikku_celery.errors import (
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    WorkflowApprovalError,
    WorkflowCancelledError,
    WorkflowRunConflictError,
    WorkflowRunNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.heartbeat import Heartbeat, HeldStep
from pikku_celery.leases.base import LeaseService
from pikku_celery.passes import Passes
from pikku_celery.reaper import Reaper
from pikku_celery.records import (
    RUN_CANCELLED,
    RUN_COMPLETED,
    RUN_RUNNING,
    RUN_SUSPENDED,
    STEP_FAILED,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.redaction import Redactor, redact_error
from pikku_celery.replay import APPROVAL_PREFIX, SUSPEND_PREFIX
from pikku_celery.store.base import NewRun, WorkflowStore
from pikku_celery.validate import as_stored, check_name, check_run_id
from pikku_celery.views import ALL

log = logging.getLogger("pikku_celery")
_LIVE = (RUN_RUNNING, RUN_SUSPENDED)


class Emit(Protocol):
    """Where the engine reports what it did (``pikku_celery.signals`` sends them as Celery
    signals): ``event`` names the signal, ``sender`` is the workflow name for run events
    and the step's task name for attempt events."""

    def __call__(self, event: str, sender: str, **fields: Any) -> None: ...


def _no_emit(event: str, sender: str, **fields: Any) -> None:
    return None


class Dispatcher(Protocol):
    """How the engine sends work: Celery messages, or the inline driver's queue."""

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None: ...

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        """Ask for a pass of ``run_id``; ``step_name``: the step whose change it is for (the
        pass reads that step; ``None``: it reads the run and every unsettled step)."""
        ...

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None: ...


@dataclass(frozen=True)
class Settings:
    step_lease_ms: int = 60_000
    run_lease_ms: int = 30_000
    undispatched_after_ms: int = 30_000
    stalled_after_ms: int = 30_000
    sweep_limit: int = 100
    continue_in_place: bool = True
    # The user's redaction of recorded errors, after the built-in masking (redaction.py).
    redact_error: Redactor | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What one delivery of a step message did."""

    kind: str  # "succeeded" | "failed" | "not_claimed" | "settled"
    result: Any = None
    error: BaseException | None = None
    attempt: int = 0  # the attempt that ran (0 when not claimed)
    max_attempts: int = 0
    retry_at: datetime | None = None  # failed with attempts left: when the next may start


class RecordedStepError(Exception):
    """A step's failure as its store recorded it (``error``: type, message, traceback),
    for a delivery that reports an outcome it did not produce (see ``_settled_outcome``)."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error
        super().__init__(error)


class Engine:
    def __init__(self, store: WorkflowStore, leases: LeaseService, registry: Registry,
                 dispatcher: Dispatcher, settings: Settings, *, worker: str | None = None,
                 clock: Clock | None = None, emit: Emit | None = None) -> None:
        self.store = store
        self.leases = leases
        self.registry = registry
        self.dispatcher = dispatcher
        self.settings = settings
        self.clock: Clock = clock if clock is not None else ServerClock(leases)
        self.emit: Emit = emit if emit is not None else _no_emit
        self.heartbeat = Heartbeat(store, leases, self.clock)
        self.claimer = Claimer(store, leases, self.clock, self.heartbeat, host=worker)
        self._reaper = Reaper(self)
        self.passes = Passes(self)

    def now_ms(self) -> int:
        return self.clock.now_ms()

    # --- runs -----------------------------------------------------------------------------

    def create_run(self, workflow: Any, data: Any, *, run_id: str | None = None,
                   parent: tuple[str, str] | None = None) -> tuple[WorkflowRun, bool]:
        definition = self.registry.workflow(workflow)
        if parent is None and run_id is not None:
            # A caller's id: servable in a URL, and never of the form pikku derives for a
            # child run (a caller could otherwise take a future child's id first).
            check_run_id(run_id)
        run_id = run_id if run_id is not None else str(uuid.uuid4())
        now = self.now_ms()
        run, created = self.store.create_run(NewRun(
            run_id=run_id, workflow=definition.name, input=data, version=definition.version,
            parent_run_id=parent[0] if parent else None,
            parent_step_name=parent[1] if parent else None), now)
        if created:
            self.store.record_version(definition.name, definition.version, definition.source,
                                      now)
            self.emit("run_started", run.workflow, run_id=run.run_id, workflow=run.workflow,
                      parent_run_id=run.parent_run_id)
        elif run.workflow != definition.name:
            raise WorkflowRunConflictError(
                run_id, f"it is a run of {run.workflow!r}, not {definition.name!r}")
        elif run.input != as_stored(data):
            raise WorkflowRunConflictError(
                run_id, f"it is a run of {run.workflow!r} with another input")
        return run, created

    def advance(self, run_id: str, dispatcher: Dispatcher | None = None, *,
                step_name: str | None = None, settled: StepState | None = None) -> str:
        """Orchestration passes under the run lease, until nothing is left to do (see
        ``pikku_celery.passes``). ``step_name`` is the step whose change asked for it (the
        pass reads that step; ``None``: anything may have changed), ``settled`` that step as
        its settle wrote it. Raises ``LeaseTakenError`` when another orchestrator holds the
        run (it will pass again: this call left it a mark), ``LeaseLostError`` when the
        lease was lost during a pass (whatever the pass wrote stands). Returns the run's
        status, or ``paused`` when the run waits on something."""
        return self.passes.advance(run_id, dispatcher or self.dispatcher,
                                   mark=ALL if step_name is None else step_name,
                                   settled=settled)

    def finish(self, run: WorkflowRun, status: str, *, output: Any = None,
               error: dict[str, Any] | None = None, dispatcher: Dispatcher | None = None,
               reason: str | None = None, leftovers: bool = True) -> str:
        """Settle the run (guarded: only a live run moves) and tell a parent run.
        ``leftovers=False``: the caller knows every step of the run settled for good, so
        there is nothing to fence and the query for unsettled steps is skipped."""
        if error is not None:
            error = self.recorded_error(error)
        wrote = self.store.transition_run(run.run_id, _LIVE, status, self.now_ms(),
                                          output=output, error=error, cancel_reason=reason)
        if wrote:
            self._emit_finished(run, status, output=output, error=error)
            # Steps the body left behind (a sleep the run did not wait for, a step of a
            # failed branch) would otherwise stay due forever and wake a finished run.
            if leftovers:
                self.fence_leftovers(run.run_id, status)
            if run.parent_run_id is not None:
                self.notify_parent(run.run_id, dispatcher or self.dispatcher)
            return status
        # Another writer ended the run while this pass ran. A cancel that landed after the
        # pass read the steps fenced only what existed then: fence what the pass created
        # since (as the pause path does), or a step it just dispatched would still run.
        current = self.store.get_run(run.run_id)
        if current is not None and current.status == RUN_CANCELLED:
            self.cancel(run.run_id, None)
        return status if current is None else current.status

    def fence_leftovers(self, run_id: str, status: str) -> None:
        """Fence the steps an ended run left unsettled (guarded and idempotent: a pass that
        finds the run ended does it again, in case the writer that ended it stopped
        before it got here)."""
        self.store.cancel_steps(run_id, {
            "type": "WorkflowRunEnded",
            "message": f"run {run_id} ended {status} before this step settled"},
            self.now_ms())

    def _emit_finished(self, run: WorkflowRun, status: str, *, output: Any = None,
                       error: dict[str, Any] | None = None) -> None:
        duration_ms = self.now_ms() - run.created_at.timestamp() * 1000
        self.emit("run_finished", run.workflow, run_id=run.run_id, workflow=run.workflow,
                  status=status, output=output, error=error,
                  duration=max(0.0, duration_ms / 1000))

    def notify_parent(self, child_run_id: str, dispatcher: Dispatcher) -> None:
        """Settle the parent's step with a finished child's outcome, and wake the parent."""
        child = self.store.get_run(child_run_id)
        if child is None or child.parent_run_id is None or not child.is_terminal:
            return
        error = None
        if child.status != RUN_COMPLETED:
            error = {"type": "WorkflowRunFailedError", "child_run_id": child.run_id,
                     "message": f"child run {child.run_id} of {child.workflow} ended "
                                f"{child.status}: {(child.error or {}).get('message', '')}"}
        assert child.parent_step_name is not None
        if self.store.settle_waiting_step(child.parent_run_id, child.parent_step_name,
                                          self.now_ms(), result=child.output, error=error,
                                          child_run_id=child.run_id):
            dispatcher.wake_run(child.parent_run_id, step_name=child.parent_step_name)

    def ensure_child(self, parent_run_id: str, step_name: str, workflow: str, data: Any,
                     child_run_id: str, dispatcher: Dispatcher) -> None:
        try:
            child, created = self.create_run(workflow, data, run_id=child_run_id,
                                             parent=(parent_run_id, step_name))
        except WorkflowRunConflictError as exc:
            self._fail_child_step(parent_run_id, step_name, child_run_id, str(exc), dispatcher)
            return
        if (child.parent_run_id, child.parent_step_name) != (parent_run_id, step_name):
            # A run under the child's id that this parent did not create: never adopted,
            # its outcome never taken for the child's. Callers cannot start a run under a
            # child id derived now (``keys.DERIVED_RUN_ID_PREFIX``); one derived before
            # (recorded in a step in flight across the upgrade) could have been taken.
            self._fail_child_step(
                parent_run_id, step_name, child_run_id,
                f"run id {child_run_id!r} is already taken by a run that is not the child "
                f"of step {step_name!r} of run {parent_run_id}", dispatcher)
            return
        if created:
            if self._parent_cancelled(parent_run_id, child.run_id):
                return
            dispatcher.wake_run(child.run_id)
        elif child.is_terminal:  # the parent missed the news (a crash in between)
            self.notify_parent(child.run_id, dispatcher)

    def _parent_cancelled(self, parent_run_id: str, child_run_id: str) -> bool:
        """Read the parent *after* creating its child, and cancel the child when the parent
        was cancelled: the other half of a Dekker pair with ``cancel``, which writes the
        parent's status before it reads the parent's steps and their children. A cancel
        landing while a pass sat between recording the child's step and creating the child
        run found no child to cancel (it did not exist yet); this read sees that cancel,
        or else the cancel's own read of the child sees the child. Either way the child is
        cancelled and never runs a step. One read per child run created."""
        parent = self.store.get_run(parent_run_id)
        if parent is None or parent.status != RUN_CANCELLED:
            return False
        self.cancel(child_run_id, f"parent run {parent_run_id} was cancelled")
        return True

    def _fail_child_step(self, parent_run_id: str, step_name: str, child_run_id: str,
                         message: str, dispatcher: Dispatcher) -> None:
        log.warning("pikku: %s", message)
        error = {"type": WorkflowRunConflictError.__name__, "child_run_id": child_run_id,
                 "message": message}
        if self.store.settle_waiting_step(parent_run_id, step_name, self.now_ms(),
                                          error=error, child_run_id=child_run_id):
            dispatcher.wake_run(parent_run_id, step_name=step_name)

    def wake_check_ms(self, now_ms: int) -> int:
        """When the reaper makes sure that a gate opened now has its run moving: the
        opener moves the run itself right after (a second write), so the check only acts
        when the opener died in between (see ``store.settle_waiting_step``)."""
        return now_ms + self.settings.stalled_after_ms

    def resume(self, run_id: str) -> bool:
        """Release a suspended run: open its suspension gates, then move it to ``running``
        and wake it. ``False`` when there was nothing to resume.

        Gates open *before* the run moves, so a pass that was suspending the run meanwhile
        sees the open gate when it re-reads it after its own write (``suspend_run``) and
        takes the run back: no order of the two leaves a run ``suspended`` behind an open
        gate."""
        if self.get_run(run_id).status not in _LIVE:
            return False
        now = self.now_ms()
        check = self.wake_check_ms(now)
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
        so of a decision, a second decision and the expiry exactly one settles the gate.
        As in ``resume``, the gate is settled before the run moves: a pass that was
        suspending the run meanwhile re-reads the gate after its own write and takes the
        run back (``_PassHost.suspend_run``)."""
        check_name("approval name", name)
        if by is not None:
            check_name("approver (by)", by)
        if isinstance(decision, dict) and "expired" in decision:
            # The expiry's own result: a decision that looked like it would read as one.
            raise WorkflowApprovalError(
                run_id, name, "a decision may not have an 'expired' key: it is reserved for "
                              "the result of the gate's expiry ({'expired': True})")
        run = self.get_run(run_id)
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
        schema = json.loads(text) if isinstance(text, str) else data.get("schema")
        if schema is not None:
            import jsonschema

            validator = jsonschema.validators.validator_for(schema)(schema)
            error = jsonschema.exceptions.best_match(validator.iter_errors(decision))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "the decision"
                raise WorkflowApprovalError(
                    run_id, name, f"the decision does not match its schema: {where}: "
                                  f"{error.message}")
        now = self.now_ms()
        check = self.wake_check_ms(now)
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

    def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel durably: the run first, then every unsettled step is fenced (in-flight
        bodies learn it at their next heartbeat), then child runs, then the parent.

        Between the two, a mark on the run lease: a pass holding the run (it read the run
        before the cancel) passes again before it lets go, finds the run cancelled and
        fences what it recorded after this fence; a pass that lets go before the mark
        recorded its steps before the fence. Should Redis not take the mark, a message asks
        for that pass instead."""
        run = self.get_run(run_id)
        if reason is not None and not isinstance(reason, str):
            raise InvalidInputError(f"cancel reason must be a string, got {reason!r}")
        exc = WorkflowCancelledError(run_id, reason)
        error = {"type": type(exc).__name__, "message": str(exc)}
        wrote = self.store.transition_run(run_id, _LIVE, RUN_CANCELLED, self.now_ms(),
                                          error=error, cancel_reason=reason)
        try:
            self.leases.mark(keys.run_lease_key(run_id), ALL)
        except Exception:
            log.warning("pikku: could not mark run %s cancelled in Redis; waking it instead",
                        run_id, exc_info=True)
            self.dispatcher.wake_run(run_id)
        children = [s.child_run_id for s in self.store.list_steps(run_id)
                    if s.child_run_id and s.status == STEP_RUNNING]
        self.store.cancel_steps(run_id, error, self.now_ms())
        for child_run_id in children:
            child = self.store.get_run(child_run_id)
            if child is not None and not child.is_terminal:
                self.cancel(child_run_id, reason or f"parent run {run_id} was cancelled")
        if wrote:
            self._emit_finished(run, RUN_CANCELLED, error=error)
            self.notify_parent(run_id, self.dispatcher)
        return wrote

    # --- steps ----------------------------------------------------------------------------

    def execute_step(self, definition: StepDefinition, run_id: str, step_name: str,
                     dispatcher: Dispatcher | None = None, *, task_id: str | None = None
                     ) -> StepOutcome:
        """Claim, run and settle one attempt. Raises ``WorkflowStepSupersededError`` when
        the attempt lost the step before it could record its outcome. ``task_id`` (the
        Celery task id of this delivery) is recorded with the attempt."""
        dispatcher = dispatcher or self.dispatcher
        lease_ms = definition.lease_ms or self.settings.step_lease_ms
        # The claim hands its attempt to ``holding`` before the heartbeat starts renewing
        # it, so the ``finally`` covers everything from ``heartbeat.add`` on: an exception
        # landing after it (a heartbeat thread that cannot start, Celery's soft time limit
        # between the claim and the body) must not leave an attempt renewed forever.
        holding: list[HeldStep] = []
        try:
            claim = self.claimer.claim(run_id, step_name, definition.name, lease_ms,
                                       task_id=task_id, holding=holding)
            if isinstance(claim, NotClaimed):
                if claim.wake_run:  # it failed the step for good: its lease had lapsed
                    dispatcher.wake_run(run_id, step_name=step_name)
                return self._settled_outcome(run_id, step_name, task_id, dispatcher)
            return self._run_claimed(definition, claim, task_id, dispatcher)
        finally:
            # Whatever escaped (a settle that raised, an error whose message cannot be
            # read, a time limit while the result was checked), the heartbeat must not keep
            # renewing an attempt nothing runs: its lease lapses and the reaper takes the
            # step back. After a settle this changes nothing (the settle let go already).
            for held in holding:
                self.claimer.heartbeat.remove(held)

    def _run_claimed(self, definition: StepDefinition, claim: Claimed, task_id: str | None,
                     dispatcher: Dispatcher) -> StepOutcome:
        attempt = _AttemptReport(self, definition.name, claim, task_id)
        try:
            result = self._call_body(definition, claim)
        except Exception as exc:
            return self._record_failure(definition, claim, exc, dispatcher, attempt)
        try:
            settled = self.claimer.succeed(claim, result)
        except InvalidInputError as exc:
            # The body returned something that can never be stored (a datetime, a result
            # too large beside the step's data): another attempt would return the same, so
            # the step fails at once, whatever attempts are left.
            return self._record_failure(definition, claim, exc, dispatcher, attempt,
                                        final=True)
        except WorkflowStepSupersededError as exc:
            attempt.superseded(exc)
            raise
        attempt.finished("succeeded", result=result)
        self._continue(settled, dispatcher)
        return StepOutcome("succeeded", result=result, attempt=claim.state.attempt,
                           max_attempts=claim.state.max_attempts)

    def _recheck(self, run_id: str, step_name: str, dispatcher: Dispatcher) -> None:
        """The redelivery of the delivery that settled a step may follow a worker that
        died in the pass after the step (in place, that pass runs inside the step's task,
        before its message is acknowledged): make sure the run heard of the step, with a
        pass here or a mark for the pass holding the run. Without it, such a run would wait
        for the stalled-run sweep. Other deliveries that claim nothing stay cheap (a storm
        of redeliveries must not become a storm of passes)."""
        try:
            self.advance(run_id, dispatcher, step_name=step_name)
        except (LeaseTakenError, LeaseLostError):
            pass  # marked, or another pass has the run: it will see the step
        except Exception:
            log.exception("pikku: the pass after a duplicate of step %r of run %s failed",
                          step_name, run_id)

    def _settled_outcome(self, run_id: str, step_name: str, task_id: str | None,
                         dispatcher: Dispatcher) -> StepOutcome:
        """A delivery that claimed nothing. When the step has settled for good and this
        delivery is not the one whose attempt settled it (a re-dispatch by replay or the
        reaper carries a new task id), its task reports the recorded outcome (``settled``:
        ``result`` or the stored ``error`` dict, and the attempt that recorded it), so
        ``AsyncResult`` of every task id of the step sees how it ended. Anything else (a
        live worker holds the step, it waits for a retry, or this is the settling
        delivery itself, whose task already reported) is ``not_claimed``: nothing runs and
        nothing is reported. One read, on this rare path only."""
        state = self.store.get_step(run_id, step_name)
        settled = state is not None and (state.status == STEP_SUCCEEDED or (
            state.status == STEP_FAILED and state.due_at is None))
        if (settled and state is not None and task_id is not None
                and state.task_id == task_id and self.settings.continue_in_place):
            self._recheck(run_id, step_name, dispatcher)  # the settling delivery, again
        if state is None or task_id is None or state.task_id == task_id or not settled:
            return StepOutcome("not_claimed")
        return StepOutcome("settled", result=state.result, attempt=state.attempt,
                           max_attempts=state.max_attempts,
                           error=None if state.status == STEP_SUCCEEDED
                           else RecordedStepError(state.error or {}))

    def _continue(self, settled: StepState, dispatcher: Dispatcher) -> None:
        """Tell the run a step settled: in place (replay here, under the run lease) when
        configured, else with a message to the orchestrator. In place, a run being advanced
        elsewhere gets a mark instead (the holder passes again before it lets go): no
        message either way."""
        run_id, step_name = settled.run_id, settled.step_name
        if self.settings.continue_in_place:
            try:
                self.advance(run_id, dispatcher, step_name=step_name, settled=settled)
                return
            except LeaseTakenError:
                return  # marked: the pass holding the run sees this step before it lets go
            except LeaseLostError:
                pass  # our pass lost the run: whoever has it now may not know, so wake
            except Exception:
                log.exception("pikku: in-place continuation of run %s failed", run_id)
        dispatcher.wake_run(run_id, step_name=step_name)

    def _call_body(self, definition: StepDefinition, claim: Claimed) -> Any:
        try:
            if definition.bind:
                return definition.fn(StepContext(claim.state, claim.held), claim.state.data)
            return definition.fn(claim.state.data)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # SystemExit & co: let the lease lapse
                self.claimer.heartbeat.remove(claim.held)
            raise

    def _record_failure(self, definition: StepDefinition, claim: Claimed, exc: Exception,
                        dispatcher: Dispatcher, attempt: _AttemptReport, *,
                        final: bool = False) -> StepOutcome:
        state = claim.state
        override = state.retry_delay_ms if state.retry_delay_ms >= 0 else None
        delay_ms = definition.delay_before(state.attempt + 1, override)
        final = final or isinstance(exc, definition.no_retry_for)
        error = self.recorded_error(serialize_error(exc))
        try:
            try:
                settled = self.claimer.fail(claim, error, delay_ms, final=final)
            except InvalidInputError as unstorable:
                # Even the error does not fit beside the step's data: record its type alone.
                error = self.recorded_error({
                    "type": type(exc).__name__,
                    "message": f"the error could not be stored: {unstorable}"[:2000]})
                settled = self.claimer.fail(claim, error, delay_ms, final=final)
        except WorkflowStepSupersededError as superseded:
            attempt.superseded(superseded)
            raise
        attempt.finished("failed", error=error, retry_at=settled.due_at)
        if settled.due_at is not None:
            dispatcher.arm_timer(state.run_id, state.step_name,
                                 int(settled.due_at.timestamp() * 1000))
        else:
            self._continue(settled, dispatcher)
        return StepOutcome("failed", error=exc, attempt=state.attempt,
                           max_attempts=state.max_attempts, retry_at=settled.due_at)

    def recorded_error(self, error: dict[str, Any]) -> dict[str, Any]:
        """``error`` as it is stored: credentials masked, then the user's ``redact_error``
        (see ``pikku_celery.redaction``). Every error the engine records from an
        exception passes here; a child's failure reaches its parent already masked."""
        return redact_error(error, self.settings.redact_error)

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

    # --- reads ----------------------------------------------------------------------------

    def get_run(self, run_id: str) -> WorkflowRun:
        check_name("run id", run_id)
        run = self.store.get_run(run_id)
        if run is None:
            raise WorkflowRunNotFoundError(run_id)
        return run

    def get_steps(self, run_id: str) -> list[StepState]:
        self.get_run(run_id)
        return self.store.list_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        self.get_run(run_id)
        return self.store.get_history(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        deadline = time.monotonic() + timeout
        interval = 0.01
        while True:
            run = self.get_run(run_id)
            if run.is_terminal:
                return run
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"run {run_id} is still {run.status} after {timeout}s")
            time.sleep(min(interval, remaining))
            interval = min(interval * 1.6, 0.5)

    # --- the reaper -----------------------------------------------------------------------

    def reap(self, dispatcher: Dispatcher | None = None) -> dict[str, int]:
        """One sweep for lost work (see ``pikku_celery.reaper``); returns what it resumed."""
        return self._reaper.sweep(dispatcher or self.dispatcher)


class _AttemptReport:
    """The signals of one claimed attempt: started now, then finished or superseded."""

    def __init__(self, engine: Engine, function: str, claim: Claimed,
                 task_id: str | None) -> None:
        self._engine = engine
        self._function = function
        self._state = claim.state
        self._task_id = task_id
        self._started_ms = engine.now_ms()
        self._emit("step_attempt_started", worker=engine.claimer.worker)

    def _emit(self, event: str, **fields: Any) -> None:
        state = self._state
        self._engine.emit(event, self._function, run_id=state.run_id,
                          step_name=state.step_name, attempt=state.attempt,
                          max_attempts=state.max_attempts, function=self._function,
                          task_id=self._task_id, **fields)

    def _duration(self) -> float:
        return max(0.0, (self._engine.now_ms() - self._started_ms) / 1000)

    def finished(self, status: str, *, result: Any = None, error: dict[str, Any] | None = None,
                 retry_at: datetime | None = None) -> None:
        self._emit("step_attempt_finished", status=status, result=result, error=error,
                   retry_at=retry_at, duration=self._duration())

    def superseded(self, exc: WorkflowStepSupersededError) -> None:
        self._emit("step_attempt_superseded", status="superseded",
                   current_attempt=exc.current_attempt, duration=self._duration())
