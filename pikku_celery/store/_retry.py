"""What a retry of a failed or cancelled run does to each step its end left failed for good,
shared by every store (``WorkflowStore.retry_run``).

A step a body failed, or a run's end fenced, is given a fresh attempt budget, due now: the
claim of its message reclaims it as the next attempt, and every earlier attempt keeps its
history entry. A sleep cut short by a cancel is due at once; a gate waits again (until its
expiry, for an approval that has one); a step parked on a child run is parked again, as a new
attempt, for the child run (which the engine retries first). Steps that succeeded are kept:
the run replays them."""

from __future__ import annotations

from typing import Any

from pikku_celery.keys import StepField as S
from pikku_celery.records import STEP_RUNNING, STEP_SCHEDULED
from pikku_celery.store._docs import entry_path, open_entry

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
