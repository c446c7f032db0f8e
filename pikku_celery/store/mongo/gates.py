"""Gates: the steps that wait without a body (a sleep, a signal or an approval gate, a step
parked on a child run) are settled by one guarded write; a settled gate's wake check is
cleared by another."""

from __future__ import annotations

from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_RUNNING, STEP_SCHEDULED, STEP_SUCCEEDED
from pikku_celery.model.validate import check_value
from pikku_celery.store._settle import waiting_fields
from pikku_celery.store.mongo.base import Doc, MongoStoreBase


class MongoGates(MongoStoreBase):
    def settle_waiting_step(self, run_id: str, step_name: str, now_ms: int, *,
                            result: Any = None, error: dict[str, Any] | None = None,
                            child_run_id: str | None = None, gate: bool = False,
                            by: str | None = None, wake_check_ms: int | None = None) -> bool:
        check_value(f"result of step {step_name!r}", result)
        guard: Doc = {S.ID: keys.invocation_id(run_id, step_name)}
        parked = None
        if child_run_id is not None:
            # Parked on the child since its insert, which opened its attempt, or since a
            # retry parked it again as a later attempt: the entry closed is that attempt's,
            # read first (a child's end is rare: one read each) and guarded on.
            guard.update({S.STATUS: STEP_RUNNING, S.CHILD_RUN: child_run_id})
            current = self._steps.find_one(guard, {S.ATTEMPT: 1}, session=self._session)
            if current is None:
                return False
            parked = current[S.ATTEMPT]
            guard[S.ATTEMPT] = parked
        fields = waiting_fields(now_ms, result=result, error=error, parked=parked, by=by,
                                wake_check_ms=wake_check_ms)
        if child_run_id is None:
            # A sleep or a gate: its one attempt starts and ends with this write.
            guard.update({S.STATUS: STEP_SCHEDULED, S.FUNCTION: None})
            if gate:
                # Never due by itself, or an approval not yet expired: "due None, or later
                # than now" as two guarded writes, not one filter with an $or (no write
                # filter has one: the wire stand-in applies an $or write filter to the
                # whole collection). A gate's due time is fixed while it waits, so at most
                # one of the two can match; a gate without expiry takes one write.
                return any(self._steps.update_one({**guard, S.DUE: due},
                                                  {"$set": fields},
                                                  session=self._session).matched_count == 1
                           for due in (None, {"$ne": None, "$gt": now_ms}))
            guard[S.DUE] = {"$ne": None, "$lte": now_ms}
        found = self._steps.update_one(guard, {"$set": fields}, session=self._session)
        return found.matched_count == 1

    def clear_wake_check(self, run_id: str, step_name: str, due_ms: int) -> bool:
        found = self._steps.update_one(
            {S.ID: keys.invocation_id(run_id, step_name), S.STATUS: STEP_SUCCEEDED,
             S.DUE: due_ms}, {"$set": {S.DUE: None}}, session=self._session)
        return found.matched_count == 1
