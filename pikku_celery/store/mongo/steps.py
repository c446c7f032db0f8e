"""Steps: insert, settle, leases and history (their claims: ``claims``). A settle is one
write fenced by the attempt (``_settle`` holds its fields)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo import ASCENDING, ReturnDocument
from pymongo.errors import BulkWriteError, DuplicateKeyError

from pikku_celery.model import keys
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import STEP_RUNNING, StepAttempt, StepState
from pikku_celery.model.validate import as_stored, check_name, check_progress, check_value
from pikku_celery.store import _docs, _retry
from pikku_celery.store._checks import check_new_steps
from pikku_celery.store._settle import failed_fields, succeeded_fields
from pikku_celery.store.base import NOT_GIVEN, NewStep
from pikku_celery.store.mongo.base import STEP_REPLY, Doc, MongoStoreBase
from pikku_celery.store.mongo.errors import (
    DUPLICATE_KEY,
    storable,
)

_AFTER = ReturnDocument.AFTER
# A settle's reply when the caller already has the step's data: that left out too.
_WITHOUT_DATA: Doc = {**STEP_REPLY, S.DATA: 0}


class MongoSteps(MongoStoreBase):
    def insert_step(self, step: NewStep, now_ms: int) -> tuple[StepState, bool]:
        check_new_steps([step])
        if self._runs.find_one({R.ID: step.run_id}, {R.ID: 1}, session=self._session) is None:
            raise InvalidInputError(f"cannot add step {step.step_name!r}: no run "
                                    f"{step.run_id!r}")
        doc = _docs.new_step_doc(step, now_ms)
        try:
            with storable(f"data of step {step.step_name!r}"):
                self._steps.insert_one(doc, session=self._session)
            return _docs.step_from_doc(doc), True
        except DuplicateKeyError:
            existing = self._steps.find_one({S.ID: doc[S.ID]}, session=self._session)
            if existing is None:  # pragma: no cover - purged between the two calls
                raise
            return _docs.step_from_doc(existing), False

    def insert_steps(self, steps: Sequence[NewStep], now_ms: int, *, seq: int = 0
                     ) -> list[tuple[StepState, bool]]:
        check_new_steps(steps)
        if not steps:
            return []
        if not self._indexes_ready:
            self.create_indexes()
        docs = [_docs.new_step_doc(step, now_ms, seq) for step in steps]
        taken: set[str] = set()
        try:
            with storable("data of a step"):
                self._steps.insert_many(docs, ordered=False, session=self._session)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if any(e.get("code") != DUPLICATE_KEY for e in errors):
                raise
            taken = {docs[e["index"]][S.ID] for e in errors}
        return self._as_recorded(docs, taken)

    def insert_replayed_steps(self, run_id: str, steps: Sequence[StepState], now_ms: int,
                              *, source_run_id: str) -> int:
        check_name("run id", run_id)
        if not steps:
            return 0
        docs = [_retry.forked_doc(run_id, state, now_ms, source_run_id) for state in steps]
        try:
            with storable("a replayed step"):
                return len(self._steps.insert_many(docs, ordered=False,
                                                   session=self._session).inserted_ids)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if any(e.get("code") != DUPLICATE_KEY for e in errors):
                raise
            return int(exc.details.get("nInserted", 0))

    def get_step(self, run_id: str, step_name: str) -> StepState | None:
        doc = self._steps.find_one({S.ID: keys.invocation_id(run_id, step_name)},
                                   session=self._session)
        return None if doc is None else _docs.step_from_doc(doc)

    def list_steps(self, run_id: str) -> list[StepState]:
        check_name("run id", run_id)
        return [_docs.step_from_doc(d) for d in self._run_steps(run_id)]

    def set_result(self, run_id: str, step_name: str, attempt: int, result: Any,
                   now_ms: int, *, claimed_data: Any = NOT_GIVEN) -> StepState:
        check_value(f"result of step {step_name!r}", result)
        state = self._settle(run_id, step_name, attempt,
                             succeeded_fields(attempt, result, now_ms), data=claimed_data)
        assert state is not None  # _settle raises when it must match and does not
        return state

    def set_error(self, run_id: str, step_name: str, attempt: int, error: dict[str, Any],
                  now_ms: int, *, retry_at_ms: int | None = None,
                  final: bool = False, claimed_data: Any = NOT_GIVEN) -> StepState:
        check_value(f"error of step {step_name!r}", error)
        fields = failed_fields(attempt, error, now_ms, retry_at_ms or now_ms)
        # With attempts left the next one is due at retry_at_ms; with none left the step is
        # failed for good and never due again. Try the common case first.
        state = None if final else self._settle(
            run_id, step_name, attempt, fields, extra_guard={S.MAX_ATTEMPTS: {"$gt": attempt}},
            must_match=False, data=claimed_data)
        if state is None:
            fields[S.DUE] = None
            state = self._settle(run_id, step_name, attempt, fields, data=claimed_data)
        assert state is not None  # _settle raises when it must match and does not
        return state

    def _settle(self, run_id: str, step_name: str, attempt: int, fields: Doc, *,
                extra_guard: Doc | None = None, must_match: bool = True,
                data: Any = NOT_GIVEN) -> StepState | None:
        step_id = keys.invocation_id(run_id, step_name)
        guard: Doc = {S.ID: step_id, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING,
                      **(extra_guard or {})}
        # The reply leaves out what the caller has (the data its claim returned) and what
        # no state carries (the attempts' history): a large step moves its data once per
        # attempt, at its claim, not again at its settle.
        known = data is not NOT_GIVEN
        with storable(f"outcome of step {step_name!r}"):
            doc = self._steps.find_one_and_update(
                guard, {"$set": fields}, projection=_WITHOUT_DATA if known else STEP_REPLY,
                return_document=_AFTER, session=self._session)
        if doc is not None and known:
            doc[S.DATA] = as_stored(data)  # as a read would give it (a tuple as a list)
        if doc is None and not must_match:
            return None
        if doc is None:
            current = self._steps.find_one({S.ID: step_id}, {S.ATTEMPT: 1}, session=self._session)
            raise WorkflowStepSupersededError(run_id, step_name, attempt,
                                              None if current is None else current[S.ATTEMPT])
        return _docs.step_from_doc(doc)

    def renew_leases(self, held: Sequence[tuple[str, str, int]], now_ms: int,
                     lease_ms: int) -> set[tuple[str, str]]:
        if not held:
            return set()
        ids = {keys.invocation_id(run, name): (run, name, attempt) for run, name, attempt in held}
        by_attempt: dict[int, list[str]] = {}
        for step_id, (_, _, attempt) in ids.items():
            by_attempt.setdefault(attempt, []).append(step_id)
        # One write per distinct attempt number (almost always one or two), fenced by it.
        matched = 0
        for attempt, step_ids in by_attempt.items():
            matched += self._steps.update_many(
                {S.ID: {"$in": step_ids}, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING,
                 S.LEASE: {"$ne": None}},
                {"$set": {S.LEASE: now_ms + lease_ms}}, session=self._session).matched_count
        if matched == len(ids):
            return set()
        # Rare path: find out which renewals were refused.
        live = {d[S.ID] for d in self._steps.find(
            {S.ID: {"$in": list(ids)}, S.STATUS: STEP_RUNNING, S.LEASE: {"$ne": None}},
            {S.ID: 1, S.ATTEMPT: 1}, session=self._session) if d[S.ATTEMPT] == ids[d[S.ID]][2]}
        return {(run, name) for sid, (run, name, _) in ids.items() if sid not in live}

    def record_progress(self, run_id: str, step_name: str, attempt: int, progress: Any,
                        now_ms: int) -> None:
        check_progress(step_name, progress)
        step_id = keys.invocation_id(run_id, step_name)
        found = self._steps.update_one(
            {S.ID: step_id, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING},
            {"$set": {S.PROGRESS: progress, S.PROGRESS_AT: now_ms}}, session=self._session)
        if found.matched_count == 0:
            current = self._steps.find_one({S.ID: step_id}, {S.ATTEMPT: 1}, session=self._session)
            raise WorkflowStepSupersededError(run_id, step_name, attempt,
                                              None if current is None else current[S.ATTEMPT])

    def release_lease(self, run_id: str, step_name: str, attempt: int) -> bool:
        found = self._steps.update_one(
            {S.ID: keys.invocation_id(run_id, step_name), S.ATTEMPT: attempt,
             S.STATUS: STEP_RUNNING},
            {"$set": {S.LEASE: None}}, session=self._session)
        return found.matched_count == 1

    def get_history(self, run_id: str) -> list[StepAttempt]:
        check_name("run id", run_id)
        steps = self._run_steps(run_id)
        # Entries live in the step documents; a step written by an earlier version kept
        # them in the history collection, read only when such a step is there.
        legacy = (list(self._history.find({H.RUN: run_id}, session=self._session))
                  if any(S.ATTEMPTS not in d for d in steps) else None)
        return _docs.merge_history(steps, legacy)

    def _run_steps(self, run_id: str) -> list[Doc]:
        return list(self._steps.find({S.RUN: run_id}, session=self._session).sort(
            [(S.CREATED, ASCENDING), (S.NAME, ASCENDING)]))
