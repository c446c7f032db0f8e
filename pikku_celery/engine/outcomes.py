"""What one delivery of a step message did (``StepOutcome``), and what a delivery that
claimed nothing reports: the step's recorded outcome when it settled for good under
another delivery, so ``AsyncResult`` of every task id of the step sees how it ended."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pikku_celery.engine.protocols import Advancer, Dispatcher, Settings
from pikku_celery.model.errors import LeaseLostError, LeaseTakenError
from pikku_celery.model.records import STEP_FAILED, STEP_SUCCEEDED
from pikku_celery.store.base import WorkflowStore

log = logging.getLogger("pikku_celery")


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
    for a delivery that reports an outcome it did not produce (see ``settled_outcome``)."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error
        super().__init__(error)


def _recheck(passes: Advancer, run_id: str, step_name: str, dispatcher: Dispatcher) -> None:
    """The redelivery of the delivery that settled a step may follow a worker that
    died in the pass after the step (in place, that pass runs inside the step's task,
    before its message is acknowledged): make sure the run heard of the step, with a
    pass here or a mark for the pass holding the run. Without it, such a run would wait
    for the stalled-run sweep. Other deliveries that claim nothing stay cheap (a storm
    of redeliveries must not become a storm of passes)."""
    try:
        passes.advance(run_id, dispatcher, mark=step_name)
    except (LeaseTakenError, LeaseLostError):
        pass  # marked, or another pass has the run: it will see the step
    except Exception:
        log.exception("pikku: the pass after a duplicate of step %r of run %s failed",
                      step_name, run_id)

def settled_outcome(store: WorkflowStore, passes: Advancer, settings: Settings, run_id: str,
                    step_name: str, task_id: str | None, dispatcher: Dispatcher
                    ) -> StepOutcome:
    """A delivery that claimed nothing. When the step has settled for good and this
    delivery is not the one whose attempt settled it (a re-dispatch by replay or the
    reaper carries a new task id), its task reports the recorded outcome (``settled``:
    ``result`` or the stored ``error`` dict, and the attempt that recorded it), so
    ``AsyncResult`` of every task id of the step sees how it ended. Anything else (a
    live worker holds the step, it waits for a retry, or this is the settling
    delivery itself, whose task already reported) is ``not_claimed``: nothing runs and
    nothing is reported. One read, on this rare path only."""
    state = store.get_step(run_id, step_name)
    if state is not None and state.status == STEP_FAILED and state.due_at is not None:
        # A retry not due yet on the lease service's clock, which the claim reads
        # exactly: its timer fired on this process's estimate of that clock, which a
        # stalled round trip can put ahead. Arm it again, or only a reaper sweep would
        # send the retry (an inline run has none: it waited forever).
        dispatcher.arm_timer(run_id, step_name, round(state.due_at.timestamp() * 1000))
        return StepOutcome("not_claimed")
    settled = state is not None and (state.status == STEP_SUCCEEDED or (
        state.status == STEP_FAILED and state.due_at is None))
    if (settled and state is not None and task_id is not None
            and state.task_id == task_id and settings.continue_in_place):
        _recheck(passes, run_id, step_name, dispatcher)  # the settling delivery, again
    if state is None or task_id is None or state.task_id == task_id or not settled:
        return StepOutcome("not_claimed")
    return StepOutcome("settled", result=state.result, attempt=state.attempt,
                       max_attempts=state.max_attempts,
                       error=None if state.status == STEP_SUCCEEDED
                       else RecordedStepError(state.error or {}))
