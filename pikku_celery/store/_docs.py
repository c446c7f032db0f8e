"""The document layout shared by every store, and its conversion to read models.

Both stores keep the same dicts (the in-memory store as Python objects, MongoDB as BSON), so
the decision logic in ``_decide`` and the read models are written once. Times are integer
epoch milliseconds on the lease service's clock: they compare the same on MongoDB, the wire
stand-in and mongomock, and they never depend on a worker's own wall clock.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.keys import invocation_id as invocation_id
from pikku_celery.model.records import (
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SUCCEEDED,
    RunLineage,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.store.base import NewRun, NewStep

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

Doc = dict[str, Any]
#: A run's trace context (``WorkflowRun.trace``): ``{"traceparent", "tracestate"}``, only on
#: a run created while tracing was on.
RUN_TRACE = "trace"


def history_id(step_id: str, attempt: int) -> str:
    return f"{step_id}:{attempt}"


def to_datetime(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def new_run_doc(run: NewRun, now_ms: int) -> Doc:
    return {
        R.ID: run.run_id,
        R.RUN: run.run_id,
        R.WORKFLOW: run.workflow,
        R.STATUS: "running" if run.slot is None else "queued",
        R.INPUT: run.input,
        R.OUTPUT: None,
        R.ERROR: None,
        R.VERSION: run.version,
        R.PARENT_RUN: run.parent_run_id,
        R.PARENT_STEP: run.parent_step_name,
        R.CANCEL_REASON: None,
        R.CREATED: now_ms,
        R.UPDATED: now_ms,
        R.STATE: {},
        R.STATE_VERSION: 0,
        R.STATE_WRITERS: [],
        # Only on a run a schedule's tick started: other runs' documents stay as they were.
        **({R.SCHEDULE: run.schedule, R.SCHEDULED: run.scheduled_ms}
           if run.schedule is not None else {}),
        **({R.SLOT: run.slot} if run.slot is not None else {}),
        # Only on a fork: other runs' documents stay as they were (a retry pushes its entry).
        **({R.FORKED_FROM: run.forked_from} if run.forked_from is not None else {}),
        **({R.LINEAGE: [dict(entry) for entry in run.lineage]} if run.lineage else {}),
        **({RUN_TRACE: dict(run.trace)} if run.trace else {}),
    }


def new_step_doc(step: NewStep, now_ms: int, seq: int = 0) -> Doc:
    """A step as first recorded; ``seq`` is the run-lease token of the pass recording it."""
    doc: Doc = {
        S.ID: invocation_id(step.run_id, step.step_name),
        S.RUN: step.run_id,
        S.NAME: step.step_name,
        S.FUNCTION: step.function,
        S.DATA: step.data,
        S.STATUS: step.status,
        S.ATTEMPT: 1,
        S.MAX_ATTEMPTS: step.max_attempts,
        S.RETRY_DELAY: step.retry_delay_ms,
        S.RESULT: None,
        S.ERROR: None,
        S.LEASE: None,
        # When a claim may start: a pending step is due at once.
        S.DUE: now_ms if step.status == STEP_PENDING else step.due_ms,
        S.STARTED: now_ms if step.status == STEP_RUNNING else None,
        S.WORKER: None,
        S.TASK_ID: None,
        S.CHILD_RUN: step.child_run_id,
        S.ON_ERROR: step.on_error,
        # A step parked on a child run starts with its insert: its one attempt is open.
        S.ATTEMPTS: ({"1": open_entry(now_ms, None, None)} if step.status == STEP_RUNNING
                     else {}),
        S.SEQ: seq,
        S.CREATED: now_ms,
        S.UPDATED: now_ms,
    }
    if not step.errors_retried:
        doc[S.ERRORS_RETRIED] = False
    return doc


def run_from_doc(doc: Doc) -> WorkflowRun:
    return WorkflowRun(
        run_id=doc[R.ID],
        workflow=doc[R.WORKFLOW],
        status=doc[R.STATUS],
        input=doc.get(R.INPUT),
        output=doc.get(R.OUTPUT),
        error=doc.get(R.ERROR),
        created_at=_dt(doc[R.CREATED]),
        updated_at=_dt(doc[R.UPDATED]),
        version=doc.get(R.VERSION),
        parent_run_id=doc.get(R.PARENT_RUN),
        parent_step_name=doc.get(R.PARENT_STEP),
        cancel_reason=doc.get(R.CANCEL_REASON),
        state=doc.get(R.STATE) or {},  # runs stored before run state have none
        state_version=doc.get(R.STATE_VERSION) or 0,
        state_writers=tuple(doc.get(R.STATE_WRITERS) or ()),
        schedule=doc.get(R.SCHEDULE),
        scheduled_for=to_datetime(doc.get(R.SCHEDULED)),
        slot=doc.get(R.SLOT),
        forked_from=doc.get(R.FORKED_FROM),
        lineage=tuple(lineage_from_doc(e) for e in doc.get(R.LINEAGE) or ()
                      if isinstance(e, dict)),
        trace=_trace(doc.get(RUN_TRACE)),
        reopen_owed=bool(doc.get(R.REOPEN)),
    )


def _trace(stored: Any) -> dict[str, str] | None:
    """A run's stored trace context; one that is not a map of text (written by hand) is
    read as none: tracing is never a reason a run cannot be read."""
    if not isinstance(stored, dict):
        return None
    return {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str)} or None


def lineage_entry(op: str, now_ms: int, *, by: str | None = None,
                  from_step: str | None = None, run_id: str | None = None,
                  keep_decisions: bool = False) -> Doc:
    """One entry of a run's ``lineage`` as stored: ``{"op", "at", "by", "from_step",
    "run_id"}`` (plus ``keep_decisions`` for a fork that kept them)."""
    entry: Doc = {"op": op, "at": now_ms, "by": by, "from_step": from_step, "run_id": run_id}
    if keep_decisions:
        entry["keep_decisions"] = True
    return entry


def lineage_from_doc(entry: Doc) -> RunLineage:
    at = entry.get("at")
    return RunLineage(op=str(entry.get("op")),
                      at=_dt(at if isinstance(at, int) else 0),
                      by=entry.get("by"), from_step=entry.get("from_step"),
                      run_id=entry.get("run_id"),
                      keep_decisions=bool(entry.get("keep_decisions")))


def step_from_doc(doc: Doc) -> StepState:
    return StepState(
        run_id=doc[S.RUN],
        step_name=doc[S.NAME],
        status=doc[S.STATUS],
        attempt=doc[S.ATTEMPT],
        max_attempts=doc[S.MAX_ATTEMPTS],
        function=doc.get(S.FUNCTION),
        data=doc.get(S.DATA),
        result=doc.get(S.RESULT),
        error=doc.get(S.ERROR),
        lease_expires_at=to_datetime(doc.get(S.LEASE)),
        created_at=_dt(doc[S.CREATED]),
        updated_at=_dt(doc[S.UPDATED]),
        invocation_id=doc[S.ID],
        due_at=to_datetime(doc.get(S.DUE)),
        child_run_id=doc.get(S.CHILD_RUN),
        retry_delay_ms=doc.get(S.RETRY_DELAY) or 0,
        errors_retried=doc.get(S.ERRORS_RETRIED) is not False,
        on_error=doc.get(S.ON_ERROR),
        task_id=doc.get(S.TASK_ID),
        forked_from=doc.get(S.FORKED_FROM),
        progress=doc.get(S.PROGRESS),
        progress_at=to_datetime(doc.get(S.PROGRESS_AT)),
    )


def entry_path(attempt: int, field: str | None = None) -> str:
    """The dotted path of attempt ``attempt``'s history entry (or one of its fields)."""
    path = f"{S.ATTEMPTS}.{attempt}"
    return path if field is None else f"{path}.{field}"


def open_entry(now_ms: int, worker: str | None, task_id: str | None) -> Doc:
    """The entry a claim writes for the attempt it starts."""
    return {H.STATUS: STEP_RUNNING, H.STARTED: now_ms, H.ENDED: None, H.ERROR: None,
            H.WORKER: worker, H.TASK_ID: task_id}


def closing_fields(attempt: int, status: str, now_ms: int,
                   error: dict[str, Any] | None = None) -> Doc:
    """``$set`` fields that close an attempt's entry, in the write that settles it."""
    return {entry_path(attempt, H.STATUS): status, entry_path(attempt, H.ERROR): error,
            entry_path(attempt, H.ENDED): now_ms}


def superseded_fields(step: Doc) -> Doc:
    """``$set`` fields a reclaim writes for the running attempt it fences out: it lost its
    lease (its end is not known)."""
    attempt = step[S.ATTEMPT]
    return {entry_path(attempt, H.STATUS): STEP_FAILED,
            entry_path(attempt, H.ERROR): lease_lost_error(step[S.RUN], step[S.NAME],
                                                           attempt)}


def apply_set(doc: Doc, fields: Doc) -> None:
    """Apply ``$set`` fields (dotted paths included) to a document held as a dict, as
    MongoDB would: the in-memory store writes exactly what the MongoDB store does."""
    for path, value in fields.items():
        target = doc
        *parents, last = path.split(".")
        for part in parents:
            child = target.get(part)
            if not isinstance(child, dict):
                child = target[part] = {}
            target = child
        target[last] = value


def history_doc(step: Doc, attempt: int, status: str, *, result: Any = None,
                error: dict[str, Any] | None = None, ended_ms: int | None = None,
                started_ms: int | None = None) -> Doc:
    """One attempt as a reader sees it (the shape of a history document)."""
    return {
        H.ID: history_id(step[S.ID], attempt),
        H.STEP: step[S.ID],
        H.RUN: step[S.RUN],
        H.NAME: step[S.NAME],
        H.ATTEMPT: attempt,
        H.STATUS: status,
        H.RESULT: result,
        H.ERROR: error,
        H.STARTED: started_ms if started_ms is not None else step.get(S.STARTED),
        H.ENDED: ended_ms,
        H.WORKER: step.get(S.WORKER),
        H.TASK_ID: step.get(S.TASK_ID),
    }


def settled_history(step: Doc) -> Doc:
    """The attempt a settled step document describes."""
    status = step[S.STATUS]
    return history_doc(
        step, step[S.ATTEMPT], status,
        result=step.get(S.RESULT) if status == STEP_SUCCEEDED else None,
        error=step.get(S.ERROR) if status == STEP_FAILED else None,
        ended_ms=step[S.UPDATED],
    )


def written_entries(step: Doc) -> dict[int, Doc]:
    """The history entries written in a step document, by attempt, each in the shape of a
    history document; nothing filled in. A succeeded entry's result is the step's (only
    the last attempt can succeed, and its entry is closed in the write that stores it)."""
    out: dict[int, Doc] = {}
    for key, entry in (step.get(S.ATTEMPTS) or {}).items():
        attempt = int(key)
        status = entry.get(H.STATUS)
        out[attempt] = {
            H.ID: history_id(step[S.ID], attempt), H.STEP: step[S.ID], H.RUN: step[S.RUN],
            H.NAME: step[S.NAME], H.ATTEMPT: attempt, H.STATUS: status,
            H.RESULT: step.get(S.RESULT) if status == STEP_SUCCEEDED else None,
            H.ERROR: entry.get(H.ERROR), H.STARTED: entry.get(H.STARTED),
            H.ENDED: entry.get(H.ENDED), H.WORKER: entry.get(H.WORKER),
            H.TASK_ID: entry.get(H.TASK_ID)}
    return out


def merge_history(steps: list[Doc], legacy: list[Doc] | None = None) -> list[StepAttempt]:
    """Every attempt of ``steps``, from the entries written in each step document (or, for
    a step written by an earlier version, from its ``legacy`` history documents).

    The step document wins for its current attempt. An earlier attempt still recorded
    ``running``, or not recorded at all, lost its lease: it is reported ``failed`` with a
    lease-expired error, never ``running`` forever. (A step's entries are written by the
    writes that change the step, so none goes missing; the fill-in covers documents
    written otherwise, by hand or by older versions.)
    """
    by_step: dict[str, dict[int, Doc]] = {}
    for entry in legacy or ():
        by_step.setdefault(entry[H.STEP], {})[entry[H.ATTEMPT]] = entry
    out: list[StepAttempt] = []
    for step in steps:
        entries = (written_entries(step) if S.ATTEMPTS in step
                   else by_step.get(step[S.ID], {}))
        current = step[S.ATTEMPT]
        totals = attempt_totals(step, current)
        for attempt in range(1, current):
            out.append(_attempt_from_entry(_earlier_entry(step, attempt, entries.get(attempt)),
                                           totals[attempt]))
        if step.get(S.STARTED) is not None or step[S.STATUS] in (STEP_SUCCEEDED, STEP_FAILED):
            out.append(_attempt_from_entry(_current_entry(step, entries.get(current)),
                                           totals[current]))
    return out


def attempt_totals(step: Doc, current: int) -> dict[int, int]:
    """The total of attempts each attempt ``1..current`` ran under. A step's
    ``max_attempts`` changes only when a retry gives it a new budget, and the retry writes
    the total it replaces into the last attempt's entry (``HistoryField.MAX_ATTEMPTS``,
    ``store._retry.reopened``): an attempt's total is the one written in its own entry or
    the first later entry that has one, else the step's current one. So "attempt 1/2"
    stays 1/2 after a retry, where it would otherwise read 1/4, then 1/6."""
    written = step.get(S.ATTEMPTS) or {}
    totals: dict[int, int] = {}
    total = step[S.MAX_ATTEMPTS]
    for attempt in range(current, 0, -1):
        entry = written.get(str(attempt))
        if isinstance(entry, dict) and isinstance(entry.get(H.MAX_ATTEMPTS), int):
            total = entry[H.MAX_ATTEMPTS]
        totals[attempt] = total
    return totals


def lease_lost_error(run_id: str, step_name: str, attempt: int) -> dict[str, Any]:
    return {
        "type": "WorkflowStepLeaseExpiredError",
        "message": f"attempt {attempt} of step {step_name!r} of run {run_id} lost its lease "
        "(its worker died or stalled) and was superseded",
    }


def _earlier_entry(step: Doc, attempt: int, recorded: Doc | None) -> Doc:
    if recorded is None:
        entry = history_doc(step, attempt, STEP_FAILED,
                            error=lease_lost_error(step[S.RUN], step[S.NAME], attempt))
        # Nothing is known of that attempt.
        entry[H.STARTED] = entry[H.WORKER] = entry[H.TASK_ID] = None
        return entry
    if recorded[H.STATUS] == STEP_RUNNING:
        entry = dict(recorded)
        entry[H.STATUS] = STEP_FAILED
        entry[H.ERROR] = lease_lost_error(step[S.RUN], step[S.NAME], attempt)
        return entry
    return recorded


def _current_entry(step: Doc, recorded: Doc | None) -> Doc:
    status = step[S.STATUS]
    if status in (STEP_SUCCEEDED, STEP_FAILED):
        entry = settled_history(step)
    else:
        entry = history_doc(step, step[S.ATTEMPT], status)
    if recorded is not None and recorded.get(H.STARTED) is not None:
        entry[H.STARTED] = recorded[H.STARTED]
    return entry


def _attempt_from_entry(entry: Doc, total: int | None = None) -> StepAttempt:
    return StepAttempt(
        run_id=entry[H.RUN],
        step_name=entry[H.NAME],
        attempt=entry[H.ATTEMPT],
        status=entry[H.STATUS],
        result=entry.get(H.RESULT),
        error=entry.get(H.ERROR),
        started_at=to_datetime(entry.get(H.STARTED)),
        ended_at=to_datetime(entry.get(H.ENDED)),
        worker=entry.get(H.WORKER),
        task_id=entry.get(H.TASK_ID),
        max_attempts=total,
    )


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def lease_expired_error(step: Doc) -> dict[str, Any]:
    """The error of a step failed for good because its last attempt lost its worker."""
    from pikku_celery.model.errors import WorkflowStepLeaseExpiredError

    exc = WorkflowStepLeaseExpiredError(step[S.RUN], step[S.NAME], step[S.ATTEMPT])
    return {"type": type(exc).__name__, "message": str(exc), "attempt": step[S.ATTEMPT]}
