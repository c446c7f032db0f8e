"""What a retry of a failed or cancelled run does to each step its end left failed for good
(``WorkflowStore.retry_run``), and what a fork copies (``insert_replayed_steps``), shared by
every store.

A step a body failed, or a run's end fenced, is given a fresh attempt budget, due now: the
claim of its message reclaims it as the next attempt, and every earlier attempt keeps its
history entry. A sleep cut short by a cancel is due at once; a gate waits again (until its
expiry, for an approval that has one); a step parked on a child run is parked again, as a new
attempt, for the child run (which the engine retries first). Steps that succeeded are kept:
the run replays them."""

from __future__ import annotations

from typing import Any

from pikku_celery.keys import HistoryField as H
from pikku_celery.keys import StepField as S
from pikku_celery.records import STEP_RUNNING, STEP_SCHEDULED, STEP_SUCCEEDED, StepState
from pikku_celery.store._docs import entry_path, new_step_doc, open_entry
from pikku_celery.store.base import NewStep

Doc = dict[str, Any]
BUDGET = "retry_budget"  # the attempts a retry gives: the step's first max_attempts
SUSPEND_PREFIX = "__suspend:"
APPROVAL_PREFIX = "__approval:"


def reopened(doc: Doc, now_ms: int) -> Doc:
    """The update that reopens ``doc`` (a step failed for good) for a retry at ``now_ms``.
    Guard it on the attempt and status read, and on ``due`` being ``None``."""
    fields: Doc = {S.ERROR: None, S.RESULT: None, S.UPDATED: now_ms}
    name = doc[S.NAME]
    if doc.get(S.CHILD_RUN) is not None:
        attempt = doc[S.ATTEMPT] + 1
        fields.update({S.STATUS: STEP_RUNNING, S.LEASE: None, S.DUE: None, S.STARTED: now_ms,
                       S.ATTEMPT: attempt, S.MAX_ATTEMPTS: max(doc[S.MAX_ATTEMPTS], attempt),
                       entry_path(attempt): open_entry(now_ms, None, None)})
    elif doc.get(S.FUNCTION) is not None:
        budget = doc.get(BUDGET) or doc[S.MAX_ATTEMPTS]
        fields.update({S.DUE: now_ms, S.MAX_ATTEMPTS: doc[S.ATTEMPT] + budget, BUDGET: budget})
    elif name.startswith(APPROVAL_PREFIX):
        data = doc.get(S.DATA) or {}
        fields.update({S.STATUS: STEP_SCHEDULED, S.DUE: data.get("expires_at_ms")})
    elif name.startswith(SUSPEND_PREFIX):
        fields.update({S.STATUS: STEP_SCHEDULED, S.DUE: None})
    else:  # a sleep
        fields.update({S.STATUS: STEP_SCHEDULED, S.DUE: now_ms})
    return {"$set": fields}


FORKED_FROM = "forked_from"  # the run a replayed step was copied from


def forked_doc(run_id: str, state: StepState, now_ms: int, source_run_id: str) -> Doc:
    """``state``, a succeeded step of run ``source_run_id``, as a step of ``run_id`` that a
    fork replays: succeeded with the same result, one attempt, its history entry closed."""
    doc = new_step_doc(NewStep(
        run_id=run_id, step_name=state.step_name, function=state.function, data=state.data,
        max_attempts=state.max_attempts, retry_delay_ms=state.retry_delay_ms,
        on_error=state.on_error), now_ms)
    doc.update({S.STATUS: STEP_SUCCEEDED, S.RESULT: state.result, S.DUE: None,
                S.STARTED: now_ms, S.CHILD_RUN: state.child_run_id, FORKED_FROM: source_run_id,
                S.ATTEMPTS: {"1": {**open_entry(now_ms, None, None), H.STATUS: STEP_SUCCEEDED,
                                   H.ENDED: now_ms}}})
    return doc
