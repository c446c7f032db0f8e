"""What a retry of a failed or cancelled run does to each step its end left failed for good
(``WorkflowStore.retry_run``), and what a fork copies (``insert_replayed_steps``), shared by
every store.

A step a body failed, or a run's end fenced, is given a fresh attempt budget, due now: the
claim of its message reclaims it as the next attempt, and every earlier attempt keeps its
history entry. A wait the run had not passed waits again for what it waited for, until its
own deadline (``own_deadline``): a sleep until the time it was to end, an approval or an event
wait until its expiry (never, without one); a step parked on a child run is parked again, as
a new attempt, for the child run (which the engine retries first). Steps that succeeded are
kept: the run replays them."""

from __future__ import annotations

from typing import Any

from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import (
    LINEAGE_RETRY,
    RUN_QUEUED,
    RUN_RUNNING,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepState,
)
from pikku_celery.model.validate import check_by
from pikku_celery.store._docs import entry_path, lineage_entry, new_step_doc, open_entry
from pikku_celery.store.base import NewStep

Doc = dict[str, Any]
BUDGET = "retry_budget"  # the attempts a retry gives: the step's first max_attempts
# The replayed names of waits (``replay``'s prefixes; ``replay`` imports the store, so its
# names are repeated here, and ``tests/unit/test_retry_composition.py`` holds them equal).
WAIT_PREFIXES = ("__approval:", "__event:")  # gates that expire at ``expires_at_ms``
NO_DEADLINE_PREFIXES = ("__suspend:", "__publish:")


def revived_fields(now_ms: int, *, queued: bool) -> Doc:
    """The ``$set`` that brings an ended run back: live, or ``queued`` for its slot."""
    fields: Doc = {R.STATUS: RUN_QUEUED if queued else RUN_RUNNING, R.OUTPUT: None,
                   R.ERROR: None, R.CANCEL_REASON: None, R.UPDATED: now_ms}
    if queued:
        fields[R.REOPEN] = True
    return fields


def retry_entry(now_ms: int, by: str | None) -> Doc:
    """A retry as its run's ``lineage`` records it (``by``: who asked, when known)."""
    return lineage_entry(LINEAGE_RETRY, now_ms, by=check_by(by, "retried by"))


def reopened(doc: Doc, now_ms: int) -> Doc:
    """The update that reopens ``doc`` (a step failed for good) for a retry at ``now_ms``.
    Guard it on the attempt and status read, and on ``due`` being ``None``."""
    fields: Doc = {S.ERROR: None, S.RESULT: None, S.UPDATED: now_ms, **kept_total(doc)}
    if doc.get(S.CHILD_RUN) is not None:
        attempt = doc[S.ATTEMPT] + 1
        fields.update({S.STATUS: STEP_RUNNING, S.LEASE: None, S.DUE: None, S.STARTED: now_ms,
                       S.ATTEMPT: attempt, S.MAX_ATTEMPTS: max(doc[S.MAX_ATTEMPTS], attempt),
                       entry_path(attempt): open_entry(now_ms, None, None)})
    elif doc.get(S.FUNCTION) is not None and not ran(doc):
        # Fenced before its first claim (a cancel while its message waited): its attempt
        # never ran and has no history entry. It waits for that first claim again, as the
        # same attempt, instead of being reclaimed as the next one (which would leave an
        # attempt in its numbering that never ran and is in no history).
        budget = doc.get(BUDGET) or doc[S.MAX_ATTEMPTS]
        fields.update({S.STATUS: STEP_PENDING, S.DUE: now_ms, BUDGET: budget,
                       S.MAX_ATTEMPTS: doc[S.ATTEMPT] - 1 + budget})
    elif doc.get(S.FUNCTION) is not None:
        budget = doc.get(BUDGET) or doc[S.MAX_ATTEMPTS]
        fields.update({S.DUE: now_ms, S.MAX_ATTEMPTS: doc[S.ATTEMPT] + budget, BUDGET: budget})
    else:  # a wait: it waits again, until its own deadline
        fields.update({S.STATUS: STEP_SCHEDULED, S.DUE: own_deadline(doc, now_ms)})
    return {"$set": fields}


def own_deadline(doc: Doc, now_ms: int) -> int | None:
    """When the wait ``doc`` (a step of no function) was to end when it was recorded:
    a gate (an approval, an event wait) at its expiry, never without one; a sleep at its
    recorded time plus its length; a suspend or a publish never by itself. A retry that
    made a gate due now would expire it on the next pass: an event wait would go on with
    its ``default`` and an approval with ``expired``, though nobody sent or decided
    anything (issue 31, defect 1). A deadline already past stays past: the next pass
    expires it, as it would have had the run never ended."""
    name = doc[S.NAME]
    data: Doc = doc[S.DATA] if isinstance(doc.get(S.DATA), dict) else {}
    if name.startswith(WAIT_PREFIXES):
        expires = data.get("expires_at_ms")
        return expires if isinstance(expires, int) else None
    if name.startswith(NO_DEADLINE_PREFIXES):
        return None
    sleep_ms = data.get("sleep_ms")  # a sleep: recorded at created_ms, due sleep_ms later
    if isinstance(sleep_ms, int) and isinstance(doc.get(S.CREATED), int):
        return int(doc[S.CREATED]) + sleep_ms
    return now_ms  # a sleep of no known length (recorded by an older version): due now


FORKED_FROM = S.FORKED_FROM  # the run a replayed step was copied from
EVENT_PREFIX = "__event:"  # replay.EVENT_PREFIX: a wait's result holds the event it took


def forked_doc(run_id: str, state: StepState, now_ms: int, source_run_id: str) -> Doc:
    """``state``, a succeeded step of run ``source_run_id``, as a step of ``run_id`` that a
    fork replays: succeeded with the same result, one attempt, its history entry closed,
    and ``forked_from`` naming the source.

    An event wait's result names the event it took by its ``seq``, which is the
    *source's* seq: the fork's own events are numbered from 1 too, and a copied seq
    counted as taken would hide the fork's event of that seq from its next wait (issue
    31, defect 2). The copy keeps the payload and moves the seq to ``forked_seq``: what
    the fork takes is read from its own waits only (``replay``)."""
    result = state.result
    if (state.step_name.startswith(EVENT_PREFIX) and isinstance(result, dict)
            and "seq" in result):
        result = {k: v for k, v in result.items() if k != "seq"}
        result["forked_seq"] = state.result["seq"]
    doc = new_step_doc(NewStep(
        run_id=run_id, step_name=state.step_name, function=state.function, data=state.data,
        max_attempts=state.max_attempts, retry_delay_ms=state.retry_delay_ms,
        on_error=state.on_error, errors_retried=state.errors_retried), now_ms)
    doc.update({S.STATUS: STEP_SUCCEEDED, S.RESULT: result, S.DUE: None,
                S.STARTED: now_ms, S.CHILD_RUN: state.child_run_id, FORKED_FROM: source_run_id,
                S.ATTEMPTS: {"1": {**open_entry(now_ms, None, None), H.STATUS: STEP_SUCCEEDED,
                                   H.ENDED: now_ms}}})
    return doc


def ran(doc: Doc) -> bool:
    """Whether the current attempt of ``doc`` was ever claimed (it has a history entry)."""
    return isinstance((doc.get(S.ATTEMPTS) or {}).get(str(doc[S.ATTEMPT])), dict)


def kept_total(doc: Doc) -> Doc:
    """The ``$set`` that keeps, in the entry of ``doc``'s last attempt, the total of
    attempts it ran under (``HistoryField.MAX_ATTEMPTS``), before a retry gives the step a
    new one: the history then shows "attempt 2/2" for it after the retry, not "2/4"
    (``_docs.attempt_totals``). Nothing for a step with no entry for that attempt (a
    document of an earlier version: a half-written entry would read as an attempt)."""
    if not ran(doc):
        return {}
    return {entry_path(doc[S.ATTEMPT], H.MAX_ATTEMPTS): doc[S.MAX_ATTEMPTS]}
