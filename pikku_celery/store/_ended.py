"""What a run's end does to the steps it left unsettled, shared by every store.

A run ends (completed, failed or cancelled) with one write on the run; its unsettled steps
are fenced after it, one guarded write each (``cancel_steps``). A claim can land between
those writes: the step it claims was read as ``pending`` by the fence, whose guard then
matches nothing. So the two sides form a Dekker pair: the ender writes the run, then reads
the steps; a claim writes the step, then reads the run (``claim_step``). Whatever the
interleaving, one of them sees the other: the fence reads the step as running and fences
it, or the claim reads the run as ended and fences its own attempt, with the same error and
fields, before any body runs.

A step a pass runs in place is inserted already claimed (``claim_new_step``), and a
separate read of the run after that insert would cost a command per step. So a run's end
first leaves a mark among the steps (``keys.run_end_mark_id``, written by ``transition_run``
before the run's own write, or by the settle of the step the ending pass last ran:
``settle_and_insert_steps``'s ``end_mark``), and the insert's command checks for the mark
in a second statement the server runs after the insert. No mark: the run's end, and the fence's read
after it, come after the insert, so the fence sees the step. A mark (the run is ending, or a
transition to an end that was refused left it): the run is read, as a claim reads it.

Whatever brings an ended run back to life (``retry_run``) must make the run live *before*
it makes any of its steps claimable again: otherwise a claim landing in between reads the
run as ended and fences the step it reopened; and it removes the end's mark after that
(a mark left behind only costs a run read per step run in place).
"""

from __future__ import annotations

from typing import Any

from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import (
    RUN_CANCELLED,
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
)
from pikku_celery.store._docs import closing_fields

Doc = dict[str, Any]

# The steps a run's end fences, and the stalled-run sweep reads: every step that may still
# run (pending, scheduled, running) and every failed step with a retry due. ``UNSETTLED`` is
# the MongoDB filter, ``is_unsettled`` the same test on a document held as a dict.
_LIVE = [STEP_PENDING, STEP_SCHEDULED, STEP_RUNNING]
UNSETTLED: Doc = {"$or": [{S.STATUS: {"$in": _LIVE}},
                          {S.STATUS: STEP_FAILED, S.DUE: {"$ne": None}}]}


def is_unsettled(doc: Doc) -> bool:
    return doc[S.STATUS] in _LIVE or (doc[S.STATUS] == STEP_FAILED and doc[S.DUE] is not None)


def ended_error(run_id: str, status: str, run_error: dict[str, Any] | None) -> dict[str, Any]:
    """The error a step of an ended run is fenced with: the cancel's own error for a
    cancelled run (what ``Engine.cancel`` gives ``cancel_steps``), else ``WorkflowRunEnded``
    (what ``Engine.fence_leftovers`` gives it)."""
    if status == RUN_CANCELLED:
        if run_error and run_error.get("type") == "WorkflowCancelledError":
            return {"type": "WorkflowCancelledError",
                    "message": str(run_error.get("message", ""))}
        return {"type": "WorkflowCancelledError", "message": f"run {run_id} was cancelled"}
    return {"type": "WorkflowRunEnded",
            "message": f"run {run_id} ended {status} before this step settled"}


def fence_fields(attempt: int, error: dict[str, Any], now_ms: int, *, running: bool) -> Doc:
    """The ``$set`` of a fence: the step fails for good (attempts spent: no retry is ever
    due), its lease goes (renewals are refused, so a body still running is told at its next
    heartbeat), and a running attempt's history entry is closed by the same write."""
    fields: Doc = {S.STATUS: STEP_FAILED, S.ERROR: error, S.RESULT: None, S.LEASE: None,
                   S.DUE: None, S.UPDATED: now_ms}
    if running:
        fields.update(closing_fields(attempt, STEP_FAILED, now_ms, error))
    return fields
