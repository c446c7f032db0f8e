"""Running in place (docs/internals/how-it-works.md, "Running in place"): what one
``advance`` call may still run in place, and the settle of the last step it ran, which
waits to travel with the next step's claim. The pass (``passes._PassHost.run_in_place``)
decides when; this keeps the budget, the context the steps run in, and the settle still to
write."""

from __future__ import annotations

import contextvars
import logging
import time

from pikku_celery.engine.protocols import ContinuationRefused, Dispatcher, PendingSettle, StepRunner
from pikku_celery.leases.hold import HeldLease
from pikku_celery.model.records import STEP_PENDING, StepState
from pikku_celery.store._concerns import restart_deadline
from pikku_celery.store.base import NewClaim, NewStep
from pikku_celery.workflow.definitions import Registry, StepDefinition

log = logging.getLogger("pikku_celery")


class InPlace:
    """The steps one ``advance`` call may still run in place, and until when.

    A step runs in the context the call began in, not under the pass's deadline (every
    MongoDB call of a pass ends within the run lease; a step's body and its claim and
    settle have their own bounds, the step lease's), and the pass's deadline starts again
    when it returns."""

    def __init__(self, runner: StepRunner, steps: int, ms: int, pass_ms: int) -> None:
        self._runner = runner
        self._left = steps
        self._until = time.monotonic() + ms / 1000
        self._pass_s = pass_ms / 1000
        self._context = contextvars.copy_context()
        # The last step run in place, when it succeeded: its settle goes with the next
        # step's claim, or alone before any other write (``settle``).
        self.pending: PendingSettle | None = None
        # The run lease the passes hold (set once it is held): a streak stops at the next
        # step once it is known lost (``lease_lost``).
        self.lease: HeldLease | None = None

    @property
    def lease_lost(self) -> bool:
        """Whether the run lease is known lost: a renewal was refused, or none was
        confirmed before its local deadline. Another pass may hold the run then, so no
        further step runs here (its body would run beside that pass's); without this
        check a streak went on until it handed the lease back."""
        return self.lease is not None and self.lease.is_lost

    def allows(self) -> bool:
        return self._left > 0 and time.monotonic() < self._until

    def done(self) -> None:
        self._left -= 1

    def run(self, definition: StepDefinition, step: NewStep, seq: int,
            dispatcher: Dispatcher, *, workflow: str | None = None
            ) -> StepState | NewClaim | None:
        after, self.pending = self.pending, None
        try:
            ran, self.pending = self._context.run(
                self._runner.run_new_step, definition, step, seq, dispatcher, after=after,
                workflow=workflow)
            return ran
        finally:
            restart_deadline(self._pass_s)

    def settle(self) -> None:
        """Write the pending settle alone (``ContinuationRefused`` if it was refused)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._runner.finish_settle(pending)

    def settle_with(self, steps: list[NewStep], now_ms: int, seq: int, *,
                    end_mark: bool = False) -> list[tuple[StepState, bool]] | None:
        """Write the pending settle and insert ``steps`` in one command (with the run's end
        mark when ``end_mark``): what ``insert_steps`` returns, or ``None`` when nothing
        was pending or the settle had to be written alone (the steps are still to insert,
        the mark to write). ``ContinuationRefused`` if the settle was refused."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        return self._runner.settle_with_inserts(pending, steps, now_ms, seq,
                                                end_mark=end_mark)

    def close(self) -> bool:
        """The call ends with a settle still pending (its pass was interrupted, or wrote
        nothing): the body succeeded, so its result is written if it can be; if not, the
        step's lease lapses and the reaper runs it again. A refused settle
        (``ContinuationRefused``: the attempt was superseded, the usual end of a streak
        that lost its run lease while stalled; or its result was refused and the step
        failed for good) is no error here: it was logged or recorded where it was refused.
        Whether every settle was written (``False``: the view went on from a result the
        store does not hold)."""
        try:
            self.settle()
        except ContinuationRefused:
            return False
        except Exception:
            log.warning("pikku: the settle of a step run in place could not be written; "
                        "the step runs again once its lease lapses", exc_info=True)
            return False
        return True

    def runnable(self, recorded: list[NewStep], step_name: str, registry: Registry,
                 dispatcher: Dispatcher) -> tuple[NewStep, StepDefinition] | None:
        """The step to run in place, when the pass that ``recorded`` these steps may run
        ``step_name`` in place now: the budget allows, it is the one step recorded, a
        function's pending step, not transactional (its settle belongs to its own
        transaction, not to the next step's claim), and the dispatcher says this task may
        run it."""
        if not self.allows() or len(recorded) != 1 or recorded[0].step_name != step_name:
            return None
        step = recorded[0]
        definition = None if step.function is None else registry.steps.get(step.function)
        runs_here = getattr(dispatcher, "runs_here", None)
        if (definition is None or definition.transactional or step.status != STEP_PENDING
                or step.child_run_id is not None or runs_here is None
                or not runs_here(step.function, step.run_id, step_name)):
            return None
        return step, definition

