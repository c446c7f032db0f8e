"""Step execution, the check-run-record core: claim one attempt through the claim layer
(``claims.py``: one guarded write), run the body, settle its outcome once (a write the
attempt no longer owns is refused with ``WorkflowStepSupersededError``), then tell the run
(in place under the run lease, or with a message).

One delivery of a step message, in order: ``claim`` (or, claiming nothing, report how the
step settled) -> the body, renewed by the heartbeat -> ``succeed`` or ``fail`` (a retry
delay arms a timer) -> ``_continue`` (a pass of the run). No Celery: ``tasks.py`` maps the
``StepOutcome`` to the task's result.

A pass that records a step it may run at once (``passes``: running in place) calls
``run_new_step`` instead: the same attempt from an insert that is already its claim, and no
continuation, since the pass itself goes on from the settled step."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from pikku_celery.engine.claims import (
    Claimed,
    Claimer,
    NotClaimed,
    Succeeded,
    call_body,
    serialize_error,
)
from pikku_celery.engine.heartbeat import HeldStep
from pikku_celery.engine.outcomes import StepOutcome, settled_outcome
from pikku_celery.engine.protocols import (
    Advancer,
    ContinuationRefused,
    Dispatcher,
    Emit,
    PendingSettle,
    Settings,
)
from pikku_celery.engine.transactional import BodyFailed, TransactionalAttempt
from pikku_celery.model.clock import Clock
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import StepState
from pikku_celery.model.redaction import redact_error
from pikku_celery.store.base import NewClaim, NewStep, WorkflowStore
from pikku_celery.workflow.definitions import StepDefinition

log = logging.getLogger("pikku_celery")
T = TypeVar("T")


class StepExecution:
    """Executes step deliveries; ``dispatcher`` and ``clock`` are the engine's (it sets
    them again when they are replaced)."""

    def __init__(self, store: WorkflowStore, claimer: Claimer, passes: Advancer,
                 settings: Settings, clock: Clock, dispatcher: Dispatcher,
                 emit: Emit) -> None:
        self.store = store
        self.claimer = claimer
        self.passes = passes
        self.settings = settings
        self.clock = clock
        self.dispatcher = dispatcher
        self.emit = emit

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def recorded_error(self, error: dict[str, Any]) -> dict[str, Any]:
        """``error`` masked as ``runs.Runs.recorded_error`` masks it."""
        return redact_error(error, self.settings.redact_error)

    # --- steps ----------------------------------------------------------------------------

    def execute_step(self, definition: StepDefinition, run_id: str, step_name: str,
                     dispatcher: Dispatcher | None = None, *, task_id: str | None = None,
                     expected: object = None) -> StepOutcome:
        """Claim, run and settle one attempt. Raises ``WorkflowStepSupersededError`` when
        the attempt lost the step before it could record its outcome. ``task_id`` (the
        Celery task id of this delivery) is recorded with the attempt; ``expected`` is what
        the message says the step was when recorded (``store.claim_step``)."""
        dispatcher = dispatcher or self.dispatcher
        lease_ms = definition.lease_ms or self.settings.step_lease_ms
        # The claim hands its attempt to ``holding`` before the heartbeat starts renewing
        # it, so the ``finally`` covers everything from ``heartbeat.add`` on: an exception
        # landing after it (a heartbeat thread that cannot start, Celery's soft time limit
        # between the claim and the body) must not leave an attempt renewed forever.
        holding: list[HeldStep] = []
        try:
            claim = self.claimer.claim(run_id, step_name, definition.name, lease_ms,
                                       task_id=task_id, holding=holding, expected=expected)
            if isinstance(claim, NotClaimed):
                if claim.wake_run:  # it failed the step for good: its lease had lapsed
                    dispatcher.wake_run(run_id, step_name=step_name)
                return settled_outcome(self.store, self.passes, self.settings, run_id,
                                       step_name, task_id, dispatcher)
            return self._run_claimed(definition, claim, task_id, dispatcher, holding)
        finally:
            # Whatever escaped (a settle that raised, an unreadable error, a time limit),
            # an attempt nothing runs is not renewed: its lease lapses for the reaper.
            for held in holding:
                self.claimer.heartbeat.remove(held)

    def _run_claimed(self, definition: StepDefinition, claim: Claimed, task_id: str | None,
                     dispatcher: Dispatcher, holding: list[HeldStep]) -> StepOutcome:
        """The body of a claimed attempt and its settle (a retry to come gets its timer),
        then the run goes on. With ``continue_in_place`` a success is not settled here but
        handed to the pass after it, whose first write carries it (the next steps' insert,
        or the next step's claim in place), as a step run in place hands its settle on: a
        command per step saved. Failures and transactional steps settle here."""
        report = _AttemptReport(self, definition.name, claim, task_id)
        if definition.transactional and TransactionalAttempt.possible(self.store):
            outcome, settled = self._transactional(definition, claim, dispatcher, report)
        else:
            try:
                result = call_body(self.claimer, definition, claim)
                succeeded = self.claimer.checked(claim, result)
            except InvalidInputError as exc:  # unstorable: every attempt's would be too
                outcome, settled = self._record_failure(definition, claim, exc, dispatcher,
                                                        report, final=True)
            except Exception as exc:
                outcome, settled = self._record_failure(definition, claim, exc, dispatcher,
                                                        report)
            else:
                pending = InPlaceSettle(definition, succeeded, report, holding,
                                        in_place=False)
                if self.settings.continue_in_place:
                    self._continue(succeeded.settled(self.now_ms()), dispatcher,
                                   pending=pending)
                else:
                    with contextlib.suppress(ContinuationRefused):
                        settled = self.finish_settle(pending)
                        self._continue(settled, dispatcher)
                return self._handed_on(pending, dispatcher)
        if settled.due_at is None:  # settled for good: the run goes on
            self._continue(settled, dispatcher)
        return outcome

    def _handed_on(self, pending: InPlaceSettle, dispatcher: Dispatcher) -> StepOutcome:
        """The outcome of a delivered step whose success was handed on (``_run_claimed``):
        its settle was written, or refused. Should the pass have ended without either (an
        outage past its deadlines), it is written here, or the error propagates and the
        step's lease lapses for the reaper."""
        if not pending.written and pending.refused is None:
            with contextlib.suppress(ContinuationRefused):
                self.finish_settle(pending)
        claim = pending.succeeded.claimed
        refused = pending.refused
        if isinstance(refused, WorkflowStepSupersededError):
            raise refused
        if refused is not None:  # the result refused after all: the step failed for good
            dispatcher.wake_run(claim.state.run_id, step_name=claim.state.step_name)
            return StepOutcome("failed", error=refused, attempt=claim.state.attempt,
                               max_attempts=claim.state.max_attempts)
        return StepOutcome("succeeded", result=pending.succeeded.result,
                           attempt=claim.state.attempt, max_attempts=claim.state.max_attempts)

    def run_new_step(self, definition: StepDefinition, step: NewStep, seq: int,
                     dispatcher: Dispatcher, *, after: PendingSettle | None = None,
                     workflow: str | None = None
                     ) -> tuple[StepState | NewClaim | None, PendingSettle | None]:
        """Run ``step``, which the pass holding its run (token ``seq``) records just now,
        here and at once: inserted claimed (``Claimer.claim_new``; with ``after``, the
        settle of the step run before it travels in the same command), then its body.
        Returns the step as settled and, when it succeeded, its settle still to write
        (``InPlaceSettle``: with the next step's claim, or ``finish_settle``); a failure
        is settled here (a retry to come has its timer armed). Else what ``claim_new``
        returned instead of a claim. ``ContinuationRefused`` when ``after``'s result was
        not recorded; ``WorkflowStepSupersededError`` when this step's failure was not.
        The pass goes on from the step: nothing continues the run from here."""
        lease_ms = definition.lease_ms or self.settings.step_lease_ms
        holding: list[HeldStep] = []
        pending: InPlaceSettle | None = None
        # A task id of its own, as Celery would give the step's message: recorded with the
        # attempt, so Flower, the worker log and the dashboard can name the attempt.
        task_id = str(uuid.uuid4())
        try:
            if after is None:
                claim = self.claimer.claim_new(step, lease_ms, seq=seq, holding=holding,
                                               task_id=task_id)
            else:
                claim = self._settle_then_claim(_pending(after), step, lease_ms, seq, holding,
                                                task_id)
            if not isinstance(claim, Claimed):
                return claim, None
            report = _AttemptReport(self, definition.name, claim, task_id, in_place=True,
                                    workflow=workflow)
            try:
                result = call_body(self.claimer, definition, claim)
                succeeded = self.claimer.checked(claim, result)
            except InvalidInputError as exc:  # a result that can never be stored
                return self._record_failure(definition, claim, exc, dispatcher, report,
                                            final=True)[1], None
            except Exception as exc:
                return self._record_failure(definition, claim, exc, dispatcher, report)[1], None
            pending = InPlaceSettle(definition, succeeded, report, holding)
            return succeeded.settled(self.now_ms()), pending
        except WorkflowStepSupersededError as exc:  # its failure's settle was refused
            _log_superseded(exc)
            raise
        finally:
            if pending is None:
                for held in holding:  # as in ``execute_step``
                    self.claimer.heartbeat.remove(held)

    def _settle_then_claim(self, after: InPlaceSettle, step: NewStep, lease_ms: int,
                           seq: int, holding: list[HeldStep], task_id: str
                           ) -> Claimed | NewClaim | None:
        try:
            claim = self.claimer.settle_then_claim(after.succeeded, step, lease_ms, seq=seq,
                                                   holding=holding, task_id=task_id)
        except BaseException as exc:
            self._refused(after, exc)
            raise
        after.written = True
        after.report.finished("succeeded", result=after.succeeded.result)
        return claim

    def settle_with_inserts(self, pending: PendingSettle, steps: list[NewStep], now_ms: int,
                            seq: int, *, end_mark: bool = False
                            ) -> list[tuple[StepState, bool]] | None:
        """Write the settle of a step whose pass went on from its result together with the
        insert of the steps that pass recorded, and the run's end mark when ``end_mark``
        (``Claimer.settle_then_insert``): what ``insert_steps`` returns, or ``None`` when
        the settle was written alone (the steps are still to insert, the mark to write).
        ``ContinuationRefused`` when it could not record the result the workflow went on
        with."""
        after = _pending(pending)
        return self._write_handed(after, lambda: self.claimer.settle_then_insert(
            after.succeeded, steps, now_ms, seq=seq, end_mark=end_mark))

    def finish_settle(self, pending: PendingSettle) -> StepState:
        """Write the settle of a step run in place alone (the pass is about to make another
        write, or to end). ``ContinuationRefused`` when it could not record the result the
        workflow went on with."""
        after = _pending(pending)
        return self._write_handed(after, lambda: self.claimer.succeed(
            after.succeeded.claimed, after.succeeded.result))

    def _write_handed(self, after: InPlaceSettle, write: Callable[[], T]) -> T:
        """A handed-on settle's write: refused, ``ContinuationRefused`` (``_refused``);
        written or not, the attempt is no longer renewed."""
        try:
            done = write()
        except BaseException as exc:
            self._refused(after, exc)
            raise
        finally:
            for held in after.holding:
                self.claimer.heartbeat.remove(held)
        after.written = True
        after.report.finished("succeeded", result=after.succeeded.result)
        return done

    def _refused(self, after: InPlaceSettle, exc: BaseException) -> None:
        """A settle that did not record the result the pass went on with: superseded (its
        attempt lost the step), or a result MongoDB refused after all (failed for good,
        as a delivery records it). Raises ``ContinuationRefused``; anything else is left
        to propagate (the step's lease lapses for the reaper)."""
        claim = after.succeeded.claimed
        if isinstance(exc, WorkflowStepSupersededError | InvalidInputError):
            after.refused = exc
        if isinstance(exc, WorkflowStepSupersededError):
            after.report.superseded(exc)
            if after.in_place:  # a delivery's task logs it as it raises it (``tasks``)
                _log_superseded(exc)
            raise ContinuationRefused(str(exc)) from exc
        if isinstance(exc, InvalidInputError):
            self._record_failure(after.definition, claim, exc, self.dispatcher, after.report,
                                 final=True)
            raise ContinuationRefused(str(exc)) from exc

    def _transactional(self, definition: StepDefinition, claim: Claimed,
                       dispatcher: Dispatcher, attempt: _AttemptReport
                       ) -> tuple[StepOutcome, StepState]:
        """The attempt of a transactional step (``pikku_celery.engine.transactional``)."""
        lease_ms = definition.lease_ms or self.settings.step_lease_ms
        try:
            done = TransactionalAttempt(self.store, self.claimer, lease_ms,
                                        self.now_ms).run(definition, claim)
        except WorkflowStepSupersededError as exc:
            attempt.superseded(exc)
            raise
        if isinstance(done, BodyFailed):
            return self._record_failure(definition, claim, done.error, dispatcher, attempt,
                                        final=done.final)
        attempt.finished("succeeded", result=done.result)
        return StepOutcome("succeeded", result=done.result, attempt=claim.state.attempt,
                           max_attempts=claim.state.max_attempts), done.settled

    def _continue(self, settled: StepState, dispatcher: Dispatcher, *,
                  pending: InPlaceSettle | None = None) -> None:
        """Tell the run a step settled: in place (replay here, under the run lease) when
        configured, else with a message to the orchestrator. In place, a run being advanced
        elsewhere gets a mark instead (the holder passes again before it lets go): no
        message either way. ``pending``: the step's settle, still to write, which the pass
        writes with its first write (``settled`` is the step as it will write it)."""
        run_id, step_name = settled.run_id, settled.step_name
        if self.settings.continue_in_place:
            try:
                self.passes.advance(run_id, dispatcher, mark=step_name, settled=settled,
                                    pending=pending)
                return
            except LeaseTakenError:
                return  # marked: the pass holding the run sees this step before it lets go
            except ContinuationRefused:
                return  # the settle was refused (``pending.refused``): nothing to tell
            except LeaseLostError:
                pass  # our pass lost the run: whoever has it now may not know, so wake
            except Exception:
                log.exception("pikku: in-place continuation of run %s failed", run_id)
        if pending is not None and not pending.written:
            if pending.refused is not None:
                return
            try:  # the pass ended before its first write: the settle goes alone, first
                self.finish_settle(pending)
            except ContinuationRefused:
                return
        dispatcher.wake_run(run_id, step_name=step_name)

    def _record_failure(self, definition: StepDefinition, claim: Claimed, exc: Exception,
                        dispatcher: Dispatcher, attempt: _AttemptReport, *,
                        final: bool = False) -> tuple[StepOutcome, StepState]:
        state = claim.state
        override = state.retry_delay_ms if state.retry_delay_ms >= 0 else None
        defaults = self.settings.step_defaults  # the app's, for what the step left out
        delay_ms = definition.delay_before(state.attempt + 1, override, defaults)
        final = (final or not state.errors_retried
                 or not definition.retry.retries_on(exc, defaults))
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
        attempt.finished("failed", error=error, retry_at=settled.due_at, exception=exc)
        if settled.due_at is not None:
            dispatcher.arm_timer(state.run_id, state.step_name,
                                 int(settled.due_at.timestamp() * 1000))
        return StepOutcome("failed", error=exc, attempt=state.attempt,
                           max_attempts=state.max_attempts, retry_at=settled.due_at), settled


@dataclass
class InPlaceSettle:
    """A step run in place whose body succeeded, its settle not written yet (see
    ``protocols.PendingSettle``); its lease is held and renewed until it is."""

    definition: StepDefinition
    succeeded: Succeeded
    report: _AttemptReport
    holding: list[HeldStep]
    # What became of the settle: written, or refused with this error (superseded, or a
    # result MongoDB refused after all: then the step failed for good).
    written: bool = False
    refused: BaseException | None = None
    in_place: bool = True  # else a delivered step's, handed to the pass after it

    @property
    def running(self) -> StepState:
        return self.succeeded.claimed.state


def _log_superseded(exc: WorkflowStepSupersededError) -> None:
    """What a step task logs when its attempt was superseded (``tasks.py``)."""
    log.warning("WorkflowStepSupersededError: %s (the step ran in place)", exc)


def _pending(pending: PendingSettle) -> InPlaceSettle:
    assert isinstance(pending, InPlaceSettle)  # the only kind this runner hands out
    return pending


class _AttemptReport:
    """The signals of one claimed attempt: started now, then finished or superseded."""

    def __init__(self, execution: StepExecution, function: str, claim: Claimed,
                 task_id: str | None, *, in_place: bool = False,
                 workflow: str | None = None) -> None:
        self._execution = execution
        self._workflow = workflow  # known to the pass that runs it in place
        self._function = function
        self._state = claim.state
        self._task_id = task_id
        self._in_place = in_place  # run by a pass, not by its own delivery
        self._started_ms = execution.now_ms()
        self._emit("step_attempt_started", worker=execution.claimer.worker)

    def _emit(self, event: str, **fields: Any) -> None:
        state = self._state
        self._execution.emit(event, self._function, run_id=state.run_id,
                          step_name=state.step_name, attempt=state.attempt,
                          max_attempts=state.max_attempts, function=self._function,
                          task_id=self._task_id, in_place=self._in_place,
                          workflow=self._workflow, **fields)

    def _duration(self) -> float:
        return max(0.0, (self._execution.now_ms() - self._started_ms) / 1000)

    def finished(self, status: str, *, result: Any = None, error: dict[str, Any] | None = None,
                 retry_at: datetime | None = None, exception: BaseException | None = None
                 ) -> None:
        """``exception``: the body's (or the refusal's) exception object of a failure, for
        the observers that report it as such (error trackers); ``error`` is its stored
        form."""
        self._emit("step_attempt_finished", status=status, result=result, error=error,
                   retry_at=retry_at, duration=self._duration(), exception=exception)

    def superseded(self, exc: WorkflowStepSupersededError) -> None:
        self._emit("step_attempt_superseded", status="superseded",
                   current_attempt=exc.current_attempt, duration=self._duration())
