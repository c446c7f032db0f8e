"""The fields of every write that ends a step's attempt, shared by every store.

``_decide`` says what a claim does; this module says what a settle, an expiry and the settle
of a waiting step (a sleep, a gate, a step parked on a child run) write. Each function returns
a ``$set`` (dotted paths included): the MongoDB store sends it in one guarded write, the
in-memory store applies it with ``_docs.apply_set``, so both keep the same documents. Each
write closes (or opens and closes) the attempt's history entry in the same ``$set``.
"""

from __future__ import annotations

from typing import Any

from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_FAILED, STEP_SUCCEEDED
from pikku_celery.store._docs import closing_fields, entry_path, lease_expired_error, open_entry

Doc = dict[str, Any]


def succeeded_fields(attempt: int, result: Any, now_ms: int) -> Doc:
    """``set_result``: the attempt succeeded; nothing is due after it."""
    return {S.STATUS: STEP_SUCCEEDED, S.RESULT: result, S.ERROR: None, S.LEASE: None,
            S.DUE: None, S.UPDATED: now_ms,
            **closing_fields(attempt, STEP_SUCCEEDED, now_ms)}


def failed_fields(attempt: int, error: dict[str, Any], now_ms: int, due_ms: int | None) -> Doc:
    """``set_error``: the attempt failed; the next one is due at ``due_ms`` (``None`` when
    the step is failed for good: attempts spent, or a final error)."""
    return {S.STATUS: STEP_FAILED, S.ERROR: error, S.RESULT: None, S.LEASE: None,
            S.DUE: due_ms, S.UPDATED: now_ms,
            **closing_fields(attempt, STEP_FAILED, now_ms, error)}


def expired_fields(step: Doc, now_ms: int) -> Doc:
    """A claim's expiry of a lapsed running step with no attempts left."""
    error = lease_expired_error(step)
    return {S.STATUS: STEP_FAILED, S.LEASE: None, S.DUE: None, S.RESULT: None, S.ERROR: error,
            S.UPDATED: now_ms, **closing_fields(step[S.ATTEMPT], STEP_FAILED, now_ms, error)}


def waiting_fields(now_ms: int, *, result: Any, error: dict[str, Any] | None,
                   parked: int | None, by: str | None, wake_check_ms: int | None) -> Doc:
    """``settle_waiting_step``: a step parked on a child run closes its attempt ``parked``
    (the one its insert opened, or the one a retry parked it again as: never attempt 1's
    entry then, which the retry's cancel closed); a sleep or a gate opens and closes its
    one attempt here."""
    status = STEP_FAILED if error is not None else STEP_SUCCEEDED
    fields: Doc = {S.STATUS: status, S.RESULT: result, S.ERROR: error, S.LEASE: None,
                   S.DUE: wake_check_ms, S.UPDATED: now_ms}
    if parked is not None:
        fields.update(closing_fields(parked, status, now_ms, error))
    else:
        fields[S.WORKER] = by
        fields[entry_path(1)] = {**open_entry(now_ms, by, None), H.STATUS: status,
                                 H.ERROR: error, H.ENDED: now_ms}
    return fields
