"""What a claim should do with a step, decided from one read of its document.

Pure functions shared by every store, so the in-memory reference store and MongoDB take the
same decisions. A store turns the decision into *one* guarded write whose filter repeats
every fact the decision rested on (status, attempt, lease lapsed, retry due): if anything
changed between the read and the write, the write matches nothing and the claim is lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.errors import WorkflowStepFunctionMismatchError
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import (
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
)
from pikku_celery.store._docs import apply_set, entry_path, new_step_doc, open_entry
from pikku_celery.store.base import NewStep

Doc = dict[str, Any]


class Action(enum.Enum):
    FIRST_CLAIM = "first_claim"  # pending/scheduled -> running, attempt unchanged
    RECLAIM = "reclaim"  # failed or lapsed running -> running, attempt + 1
    EXPIRE = "expire"  # lapsed running, no attempts left -> failed (lease expired)
    NONE = "none"  # not yours: live lease, settled, spent, not yet due


@dataclass(frozen=True)
class Decision:
    action: Action
    status: str
    attempt: int


def decide_claim(doc: Doc, function: str | None, now_ms: int) -> Decision:
    """Decide a claim from one read. Raises before any write if the message names a
    function other than the one the workflow dispatched (contract invariant 8)."""
    if doc.get(S.FUNCTION) != function:
        raise WorkflowStepFunctionMismatchError(doc[S.RUN], doc[S.NAME], doc.get(S.FUNCTION),
                                                function)
    status, attempt = doc[S.STATUS], doc[S.ATTEMPT]
    return Decision(_action(doc, status, attempt, now_ms), status, attempt)


def _action(doc: Doc, status: str, attempt: int, now_ms: int) -> Action:
    spent = attempt >= doc[S.MAX_ATTEMPTS]
    if status == STEP_PENDING or (status == STEP_SCHEDULED and is_due(doc, now_ms)):
        return Action.FIRST_CLAIM
    if status == STEP_RUNNING and lease_lapsed(doc, now_ms):
        return Action.EXPIRE if spent else Action.RECLAIM
    if status == STEP_FAILED and not spent and is_due(doc, now_ms):
        return Action.RECLAIM
    return Action.NONE


def lease_lapsed(doc: Doc, now_ms: int) -> bool:
    """A running step with *no* lease is parked on a child run and never lapses."""
    lease = doc.get(S.LEASE)
    return lease is not None and lease < now_ms


def is_due(doc: Doc, now_ms: int) -> bool:
    due = doc.get(S.DUE)
    return due is not None and due <= now_ms


def guard_for(decision: Decision, step_id: str, now_ms: int) -> Doc:
    """The filter that makes a decision's write a compare-and-set on what was read."""
    guard: Doc = {S.ID: step_id, S.ATTEMPT: decision.attempt, S.STATUS: decision.status}
    if decision.status == STEP_RUNNING:
        guard[S.LEASE] = {"$ne": None, "$lt": now_ms}
    elif decision.status in (STEP_SCHEDULED, STEP_FAILED):
        guard[S.DUE] = {"$ne": None, "$lte": now_ms}
    return guard


def first_claim_filter(step_id: str, function: str | None, now_ms: int) -> Doc:
    """The optimistic first-claim filter: claims a fresh step in one write, no read.

    A pending step is due from its insertion, so one plain conjunction covers pending and
    due scheduled steps; both are always at attempt 1 (no transition leads back to them),
    which the filter states so the write can open attempt 1's history entry. (No ``$or``
    in write filters: the nx-27017 stand-in applies an ``$or`` filter of
    ``find_one_and_update`` to the whole collection, ignoring ``_id``.)"""
    return {
        S.ID: step_id,
        S.FUNCTION: function,
        S.STATUS: {"$in": [STEP_PENDING, STEP_SCHEDULED]},
        S.ATTEMPT: 1,
        S.DUE: {"$ne": None, "$lte": now_ms},
    }


def running_fields(now_ms: int, lease_ms: int, worker: str | None,
                   task_id: str | None = None, *, attempt: int) -> Doc:
    """The ``$set`` of a claim that starts ``attempt``: the lease, and the attempt's history
    entry, opened in the same write."""
    return {
        entry_path(attempt): open_entry(now_ms, worker, task_id),
        S.STATUS: STEP_RUNNING,
        S.LEASE: now_ms + lease_ms,
        S.STARTED: now_ms,
        S.WORKER: worker,
        S.TASK_ID: task_id,
        S.RESULT: None,
        S.ERROR: None,
        S.DUE: None,
        S.UPDATED: now_ms,
        S.PROGRESS: None,
        S.PROGRESS_AT: None,
    }


def claimed_step_doc(step: NewStep, now_ms: int, lease_ms: int, worker: str | None,
                     task_id: str | None, seq: int) -> Doc:
    """A new pending step as its first claim would leave it: the insert of a step run at
    once by the pass that records it (``claim_new_step``)."""
    if step.status != STEP_PENDING or step.function is None or step.child_run_id is not None:
        raise ValueError(f"step {step.step_name!r}: only a pending step of a function can be "
                         "inserted claimed")
    doc = new_step_doc(step, now_ms, seq)
    apply_set(doc, running_fields(now_ms, lease_ms, worker, task_id, attempt=1))
    return doc
