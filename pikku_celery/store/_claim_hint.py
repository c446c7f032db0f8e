"""What a step's message may carry so its first claim needs no read: the step as recorded.

A sent step's claim used to return the step's document (``findAndModify``) and then read
its run (the claim's half of the Dekker pair with a run's end, ``store._ended``): two
commands and two documents before the body could start (issue 34, items 1 and 3). The pass
that records a step knows the document it inserts, so it puts what a claim would read from
it in the step's message (``hint_of``). The claim then writes without reading
(``hinted_filter``): a guard that repeats every field of the hint, so the write matches only
the step exactly as the hint describes it, still pending. The state the claim returns is
built from the hint and the claim's own fields, which is what the document then holds.

A hint is never trusted: it comes from a message anyone with access to the broker can
send. The guard compares each field literally (``$eq``, so a value shaped like an operator
is only a value), and a hint that does not match (a forgery, a step claimed, failed or
reopened since, a document changed in any field the claim returns) changes nothing: the
claim goes the usual way, reading the step. A step whose data makes the hint large is sent
without one (``MAX_HINT_BYTES``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_PENDING
from pikku_celery.store._decide import running_fields
from pikku_celery.store._docs import apply_set

Doc = dict[str, Any]

#: A hint larger than this (its JSON) is not sent: the step's message stays small, and the
#: claim reads the step as it always did.
MAX_HINT_BYTES = 4096

# What a first claim leaves as it was, and ``step_from_doc`` reads: the hint holds these.
# (The claim writes every other field ``step_from_doc`` reads.) ``errors_retried`` and
# ``forked_from`` are absent from most documents: a hint without them requires them absent
# (``errors_retried`` false or ``forked_from`` set would change the state).
_KEPT = (S.ID, S.RUN, S.NAME, S.FUNCTION, S.DATA, S.ATTEMPT, S.MAX_ATTEMPTS, S.RETRY_DELAY,
         S.CHILD_RUN, S.ON_ERROR, S.CREATED, S.SEQ)
_OPTIONAL = (S.ERRORS_RETRIED, S.FORKED_FROM)


def hint_of(doc: Mapping[str, Any]) -> Doc | None:
    """The hint for a pending step inserted as ``doc`` (``_docs.new_step_doc``), or
    ``None`` when it would be larger than ``MAX_HINT_BYTES`` or the step is not one a
    message claims (not pending, no function, parked on a child run)."""
    if (doc.get(S.STATUS) != STEP_PENDING or doc.get(S.FUNCTION) is None
            or doc.get(S.CHILD_RUN) is not None or doc.get(S.ATTEMPT) != 1):
        return None
    hint = {k: doc.get(k) for k in _KEPT}
    hint.update({k: doc[k] for k in _OPTIONAL if k in doc})
    try:
        size = len(json.dumps(hint, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError):
        return None  # not plain JSON: the message could not carry it as it is
    return hint if size <= MAX_HINT_BYTES else None


def checked_hint(hint: object, step_id: str, function: str | None) -> Doc | None:
    """``hint`` when it has the shape ``hint_of`` gives and names this step and function;
    ``None`` (claim the usual way) for anything else."""
    if not isinstance(hint, Mapping) or set(hint) - {*_KEPT, *_OPTIONAL} or any(
            k not in hint for k in _KEPT):
        return None
    if hint[S.ID] != step_id or hint[S.FUNCTION] != function or hint[S.ATTEMPT] != 1:
        return None
    if not all(isinstance(hint[k], int) and not isinstance(hint[k], bool)
               for k in (S.MAX_ATTEMPTS, S.CREATED, S.SEQ)):
        return None
    return dict(hint)


def hinted_filter(hint: Doc) -> Doc:
    """The guard of a claim made from ``hint``: the step pending, at attempt 1, every field
    of the hint as it says (compared literally), the optional ones absent where it has
    none."""
    guard: Doc = {S.ID: hint[S.ID], S.STATUS: STEP_PENDING}
    for key, value in hint.items():
        if key != S.ID:
            guard[key] = {"$eq": value}
    for key in _OPTIONAL:
        if key not in hint:
            guard[key] = {"$exists": False}
    return guard


def claimed_from_hint(hint: Doc, now_ms: int, lease_ms: int, worker: str | None,
                      task_id: str | None) -> Doc:
    """The step's document (the fields a state is built from) once the hinted claim
    wrote ``running_fields`` on it."""
    doc: Doc = {**hint, S.STATUS: STEP_PENDING, S.RESULT: None, S.ERROR: None,
                S.LEASE: None}
    apply_set(doc, running_fields(now_ms, lease_ms, worker, task_id, attempt=1))
    return doc
