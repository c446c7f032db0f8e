"""A Celery result backend whose writes for step tasks are fenced by attempt.

Set ``app.conf.result_backend = "pikku+mongodb://host:27017/db"`` (the ``pikku`` alias is a
``celery.result_backends`` entry point; ``"pikku_celery.backend:PikkuResultBackend+mongodb://
..."`` works without it). Everything Celery's own MongoDB backend does still applies: plain
tasks are stored exactly as it stores them.

Why: one task id can run more than once (a Redis visibility timeout or a lost worker
redelivers the same message). Celery's MongoDB backend keeps the *first* SUCCESS for a task
id, so a stale copy that finishes first wins over the attempt that owns the step. For step
tasks this backend keeps the outcome of the highest attempt instead: each write carries the
attempt that ran (``pikku_attempt``, as the engine reported it, never as a message header
could claim) and its filter refuses to replace a document written by
a higher attempt, in the same single write (no read-then-write):

    t0  copy A (attempt 1) pauses mid-step
    t1  copy B (same task id) reclaims the step as attempt 2, stores SUCCESS "fresh"
    t2  copy A wakes; its step write is refused; it stores FAILURE(superseded)
        -> filter {_id, pikku_attempt <= 1} matches nothing, the upsert collides: refused
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from bson.errors import InvalidDocument
from celery.backends.mongodb import MongoBackend
from kombu.exceptions import EncodeError
from pymongo.errors import DuplicateKeyError

log = logging.getLogger("pikku_celery.backend")
ATTEMPT_FIELD = "pikku_attempt"
# The attempt that ran, per task request, set by the step task from the engine's own
# outcome. Not a request attribute: Celery copies every message header onto the request, so
# a forged header could otherwise claim attempt 999 and fence out every real outcome.
_ATTEMPTS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def record_attempt(request: Any, attempt: int) -> None:
    """Tell the backend which attempt the task request ``request`` ran."""
    _ATTEMPTS[request] = attempt


def attempt_of(request: Any) -> int:
    """The attempt recorded for ``request``; 0 (never fences anything out) when none was."""
    try:
        return _ATTEMPTS.get(request, 0)
    except TypeError:  # not weak-referenceable: nothing was recorded for it
        return 0


class PikkuResultBackend(MongoBackend):  # type: ignore[misc]
    """Celery's MongoDB result backend, fenced by attempt for pikku step tasks."""

    def _store_result(self, task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        if not self._is_step(request):
            return super()._store_result(task_id, result, state, traceback=traceback,
                                         request=request, **kwargs)
        attempt = attempt_of(request)
        meta = self._get_result_meta(result=self.encode(result), state=state,
                                     traceback=traceback, request=request, format_date=False)
        meta["_id"] = task_id
        meta[ATTEMPT_FIELD] = attempt
        query = {"_id": task_id, ATTEMPT_FIELD: {"$lte": attempt}}
        for _ in range(2):  # a second try only for a concurrent first insert
            try:
                self.collection.replace_one(query, meta, upsert=True)
                return result
            except DuplicateKeyError:
                continue
            except InvalidDocument as exc:
                raise EncodeError(exc) from exc
        log.info("pikku backend: %s of task %s from attempt %d refused: a later attempt's "
                 "outcome is stored", state, task_id, attempt)
        return result

    def _is_step(self, request: Any) -> bool:
        pikku = getattr(self.app, "pikku", None)
        name = getattr(request, "task", None)
        return pikku is not None and name is not None and name in pikku.registry.steps
