"""The run lifecycle: create a run, finish it (and fence what it left unsettled), cancel
it, and its children (create one for a parent's step, tell the parent how it ended).

Every status change is a guarded write on the run (only a live run moves); what follows a
write that won (signals, fences, the parent's step) is repeated by whoever finds the run
ended later, so a writer that stops in between leaves nothing undone for good."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pikku_celery.engine import protocols
from pikku_celery.engine.concurrency import Admission, slot_of
from pikku_celery.engine.protocols import Dispatcher, Emit, Settings
from pikku_celery.engine.reads import get_run
from pikku_celery.engine.reopen import send_reopened
from pikku_celery.leases.base import LeaseService
from pikku_celery.model import keys
from pikku_celery.model.clock import Clock
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowCancelledError,
    WorkflowRunConflictError,
)
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_COMPLETED,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_SUSPENDED,
    STEP_FAILED,
    STEP_RUNNING,
    StepState,
    WorkflowRun,
)
from pikku_celery.model.redaction import redact_error
from pikku_celery.model.trace_context import check_trace
from pikku_celery.model.validate import as_stored, check_run_id
from pikku_celery.model.views import ALL
from pikku_celery.store.base import NewRun, WorkflowStore
from pikku_celery.workflow.definitions import Registry

log = logging.getLogger("pikku_celery")
LIVE = (RUN_RUNNING, RUN_SUSPENDED)


class Runs:
    """Creates, ends and cancels runs; ``dispatcher`` and ``clock`` are the engine's (it
    sets them again when they are replaced)."""

    def __init__(self, store: WorkflowStore, leases: LeaseService, registry: Registry,
                 settings: Settings, clock: Clock, dispatcher: Dispatcher,
                 emit: Emit) -> None:
        self.store = store
        self.leases = leases
        self.registry = registry
        self.settings = settings
        self.clock = clock
        self.dispatcher = dispatcher
        self.emit = emit
        # The (workflow, version) pairs this engine has recorded: a definition's source is
        # written once per process, not again on every start (where it failed on its
        # duplicate key: a second write per start).
        self._versions_recorded: set[tuple[str, str]] = set()

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def recorded_error(self, error: dict[str, Any]) -> dict[str, Any]:
        """``error`` as it is stored: credentials masked, then the user's ``redact_error``
        (see ``pikku_celery.model.redaction``). Every error the engine records from an
        exception passes here; a child's failure reaches its parent already masked."""
        return redact_error(error, self.settings.redact_error)

    # --- create, finish -------------------------------------------------------------------

    def create_run(self, workflow: Any, data: Any, *, run_id: str | None = None,
                   parent: tuple[str, str] | None = None,
                   scheduled: tuple[str, int] | None = None,
                   forked: tuple[str, Mapping[str, Any]] | None = None,
                   on_created: Callable[[WorkflowRun], None] | None = None,
                   ) -> tuple[WorkflowRun, bool]:
        """Create the run (idempotent by ``run_id``). ``parent``: the parent run and step
        of a child run; ``scheduled``: the schedule and tick (epoch ms) that start it,
        whose run id is derived from them (``keys.scheduled_run_id``), not chosen;
        ``forked``: a fork's source run and lineage entry (``forks``), written with the
        run; ``on_created``: called with the run this call inserted, before anything can
        wake it (a fork copies its steps there)."""
        definition = self.registry.workflow(workflow)
        slot = slot_of(definition, data)
        if scheduled is not None:
            run_id = keys.scheduled_run_id(*scheduled)
        elif parent is None and run_id is not None:
            # A caller's id: servable in a URL, and never of the form pikku derives for a
            # child run (a caller could otherwise take a future child's id first).
            check_run_id(run_id)
        run_id = run_id if run_id is not None else str(uuid.uuid4())
        now = self.now_ms()
        run, created = self.store.create_run(NewRun(
            run_id=run_id, workflow=definition.name, input=data, version=definition.version,
            parent_run_id=parent[0] if parent else None,
            parent_step_name=parent[1] if parent else None,
            schedule=scheduled[0] if scheduled else None,
            scheduled_ms=scheduled[1] if scheduled else None, slot=slot,
            forked_from=forked[0] if forked else None,
            lineage=(forked[1],) if forked else (),
            trace=self._trace_context(run_id, definition.name)), now)
        if created and on_created is not None:
            on_created(run)
        if created:
            self._record_version(definition.name, definition.version, definition.source, now)
            self.emit("run_started", run.workflow, run_id=run.run_id, workflow=run.workflow,
                      parent_run_id=run.parent_run_id)
            if slot is not None:  # queued: admitted now if its group has a free slot
                self.admission.admit(slot, self.dispatcher)
        elif run.workflow != definition.name:
            raise WorkflowRunConflictError(
                run_id, f"it is a run of {run.workflow!r}, not {definition.name!r}")
        elif run.input != as_stored(data):
            raise WorkflowRunConflictError(
                run_id, f"it is a run of {run.workflow!r} with another input")
        return run, created

    def _record_version(self, workflow: str, version: str, source: str, now: int) -> None:
        """Keep the definition's source under its version, once per process."""
        if (workflow, version) not in self._versions_recorded:
            self.store.record_version(workflow, version, source, now)
            self._versions_recorded.add((workflow, version))

    @staticmethod
    def _trace_context(run_id: str, workflow: str) -> dict[str, str] | None:
        """The caller's trace context, saved with the run (``protocols.trace_context``).
        Tracing never stops a start: a hook that fails, or hands a context no propagator
        would take back, is logged and the run is created without one."""
        try:
            return check_trace(protocols.trace_context(run_id, workflow))
        except Exception:
            log.warning("pikku: no trace context saved with run %s", run_id, exc_info=True)
            return None

    def finish(self, run: WorkflowRun, status: str, *, output: Any = None,
               error: dict[str, Any] | None = None, dispatcher: Dispatcher | None = None,
               reason: str | None = None, leftovers: bool = True, marked: bool = False
               ) -> str:
        """Settle the run (guarded: only a live run moves) and tell a parent run.
        ``leftovers=False``: the caller knows every step of the run settled for good, so
        there is nothing to fence and the query for unsettled steps is skipped.
        ``marked``: the caller's last settle wrote the end's mark (``transition_run``)."""
        if error is not None:
            error = self.recorded_error(error)
        wrote = self.store.transition_run(run.run_id, LIVE, status, self.now_ms(),
                                          output=output, error=error, cancel_reason=reason,
                                          marked=marked)
        if wrote:
            self._emit_finished(run, status, output=output, error=error)
            self.admission.release(run, dispatcher or self.dispatcher)
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
            self.now_ms(), while_ended=True)

    def _emit_finished(self, run: WorkflowRun, status: str, *, output: Any = None,
                       error: dict[str, Any] | None = None) -> None:
        duration_ms = self.now_ms() - run.created_at.timestamp() * 1000
        self.emit("run_finished", run.workflow, run_id=run.run_id, workflow=run.workflow,
                  status=status, output=output, error=error,
                  duration=max(0.0, duration_ms / 1000))

    # --- cancel ---------------------------------------------------------------------------

    def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel durably: the run first, then every unsettled step is fenced (in-flight
        bodies learn it at their next heartbeat), then child runs, then the parent.

        Between the two, a mark on the run lease: a pass holding the run (it read the run
        before the cancel) passes again before it lets go, finds the run cancelled and
        fences what it recorded after this fence; a pass that lets go before the mark
        recorded its steps before the fence. Should Redis not take the mark, a message asks
        for that pass instead. Raises ``WorkflowRunNotFoundError`` for an unknown run."""
        run = get_run(self.store, run_id)
        if reason is not None and not isinstance(reason, str):
            raise InvalidInputError(f"cancel reason must be a string, got {reason!r}")
        exc = WorkflowCancelledError(run_id, reason)
        error = {"type": type(exc).__name__, "message": str(exc)}
        wrote = self.store.transition_run(run_id, (RUN_QUEUED, *LIVE), RUN_CANCELLED,
                                          self.now_ms(), error=error, cancel_reason=reason)
        try:
            self.leases.mark(keys.run_lease_key(run_id), ALL)
        except Exception:
            log.warning("pikku: could not mark run %s cancelled in Redis; waking it instead",
                        run_id, exc_info=True)
            self.dispatcher.wake_run(run_id)
        children = [s.child_run_id for s in self.store.list_steps(run_id)
                    if s.child_run_id and s.status == STEP_RUNNING]
        self.store.cancel_steps(run_id, error, self.now_ms(), while_ended=True)
        for child_run_id in children:
            child = self.store.get_run(child_run_id)
            if child is not None and not child.is_terminal:
                self.cancel(child_run_id, reason or f"parent run {run_id} was cancelled")
        if wrote:
            self._emit_finished(run, RUN_CANCELLED, error=error)
            announce_end(self.leases, run_id)
            self.admission.release(run, self.dispatcher)
            self.notify_parent(run_id, self.dispatcher)
        return wrote


    # --- children -------------------------------------------------------------------------

    def retry(self, run_id: str, *, by: str | None = None) -> bool:
        """Run a failed or cancelled run again from where it stopped: ``False`` (nothing
        done) for a run in any other status. Its child runs that failed or were cancelled
        are retried first, so each is live again before its parent's step waits on it (a
        child that ends meanwhile is heard by the parent's next pass, ``ensure_child``);
        then the run itself (``store.retry_run``, which records the retry and ``by`` in its
        lineage), the message of every reopened step of a function, and a pass.

        A run of a limited workflow goes back to ``queued`` and is admitted like a start:
        at once when its group has a free slot, else first in, first out (it is older
        than the runs queued since). Its slot is taken only once it is queued, never while
        it is still ended: a reaper's sweep between the two would give back a slot held by
        an ended run, and the run would then run holding none beside another (issue 31,
        defect 3). Its admission reopens its steps (``store.admit_run``)."""
        run = get_run(self.store, run_id)
        if run.status == RUN_RUNNING:  # a retry cut short after its first write: finish it
            owed = self.store.resume_retry(run_id, self.now_ms())
            if owed is None:
                return False
            return self._reopened(run, owed)
        if run.status not in (RUN_FAILED, RUN_CANCELLED):
            return False
        for state in self.store.list_steps(run_id):
            if (state.child_run_id is not None and state.status == STEP_FAILED
                    and state.due_at is None):
                self.retry(state.child_run_id, by=by)
        if run.slot is not None:
            if self.store.retry_run(run_id, self.now_ms(), queued=True, by=by) is None:
                return False  # it changed meanwhile (retried, or resumed, by someone else)
            admitted = run_id in self.admission.admit(run.slot, self.dispatcher)
            log.info("pikku: run %s of %s retried: %s", run_id, run.workflow,
                     "admitted" if admitted else "queued for a slot of its group")
            return True
        reopened = self.store.retry_run(run_id, self.now_ms(), by=by)
        if reopened is None:
            return False  # it changed meanwhile (retried, or resumed, by someone else)
        return self._reopened(run, reopened)

    def _reopened(self, run: WorkflowRun, reopened: list[StepState]) -> bool:
        send_reopened(self.leases, self.dispatcher, run.run_id, reopened)
        self.dispatcher.wake_run(run.run_id)
        log.info("pikku: run %s of %s retried: %d step(s) reopened", run.run_id, run.workflow,
                 len(reopened))
        return True

    @property
    def admission(self) -> Admission:
        """Slots of limited workflows on this store (``pikku_celery.engine.concurrency``)."""
        return Admission(self.store, self.registry.concurrency_of, self.now_ms,
                         leases=self.leases)

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
            if self.cancel_if_parent_cancelled(child.run_id, parent_run_id):
                return
            dispatcher.wake_run(child.run_id)
        elif child.is_terminal:  # the parent missed the news (a crash in between)
            self.notify_parent(child.run_id, dispatcher)

    def cancel_if_parent_cancelled(self, child_run_id: str, parent_run_id: str) -> bool:
        """Read the parent *after* creating its child, and cancel the child when the parent
        was cancelled: the other half of a Dekker pair with ``cancel``, which writes the
        parent's status before it reads the parent's steps and their children. A cancel
        landing while a pass sat between recording the child's step and creating the child
        run found no child to cancel (it did not exist yet); this read sees that cancel,
        or else the cancel's own read of the child sees the child. Either way the child is
        cancelled and never runs a step. Read by the creating pass, and again by the
        child's first pass (``first_pass``): the creator may stop between its insert and
        this read."""
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


def announce_end(leases: LeaseService, run_id: str) -> None:
    """Wake those waiting for the run's end (``Reads.wait``); a pass that ends a run does it
    as it hands the run back. A lost announcement costs them a poll, no more."""
    try:
        leases.announce(keys.run_lease_key(run_id))
    except Exception:
        log.debug("pikku: the end of run %s was not announced", run_id, exc_info=True)
