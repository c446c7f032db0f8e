"""Gates: the steps that wait without a body (a sleep, a signal or an approval gate, a step
parked on a child run), settled once; a settled gate's wake check, cleared once."""

from __future__ import annotations

import copy
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_RUNNING, STEP_SCHEDULED, STEP_SUCCEEDED
from pikku_celery.model.validate import as_stored, check_value
from pikku_celery.store import _docs
from pikku_celery.store._decide import is_due
from pikku_celery.store._settle import waiting_fields
from pikku_celery.store.memory.base import Doc, MemoryStoreBase


class MemoryGates(MemoryStoreBase):
    def settle_waiting_step(self, run_id: str, step_name: str, now_ms: int, *,
                            result: Any = None, error: dict[str, Any] | None = None,
                            child_run_id: str | None = None, gate: bool = False,
                            by: str | None = None, wake_check_ms: int | None = None) -> bool:
        check_value(f"result of step {step_name!r}", result)
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or not _is_waiting(doc, now_ms, child_run_id, gate):
                return False
            # Parked on a child since its insert (which opened its one attempt), or a sleep
            # or a gate (its one attempt starts and ends here).
            _docs.apply_set(doc, copy.deepcopy(waiting_fields(
                now_ms, result=as_stored(result), error=as_stored(error),
                parked=doc[S.ATTEMPT] if doc[S.STATUS] == STEP_RUNNING else None, by=by,
                wake_check_ms=wake_check_ms)))
            return True

    def clear_wake_check(self, run_id: str, step_name: str, due_ms: int) -> bool:
        with self._lock:
            doc = self._steps.get(keys.invocation_id(run_id, step_name))
            if doc is None or doc[S.STATUS] != STEP_SUCCEEDED or doc[S.DUE] != due_ms:
                return False
            doc[S.DUE] = None
            return True


def _is_waiting(doc: Doc, now_ms: int, child_run_id: str | None, gate: bool) -> bool:
    """The guard of the MongoDB store's ``settle_waiting_step``, on a document."""
    if child_run_id is not None:
        return doc[S.STATUS] == STEP_RUNNING and doc.get(S.CHILD_RUN) == child_run_id
    if doc[S.STATUS] != STEP_SCHEDULED or doc.get(S.FUNCTION) is not None:
        return False
    if gate:  # never due by itself, or an approval not yet expired
        return doc.get(S.DUE) is None or not is_due(doc, now_ms)
    return is_due(doc, now_ms)
