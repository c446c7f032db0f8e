"""Steps: insert, claim (``_decide``), settle, leases and history.

A fresh step is claimed by one optimistic write; any other claim reads the step, decides
(``_decide.decide_claim``) and writes once, guarded on what it read. A claim that won reads
its run after its write and fences itself when the run has ended (``store._ended``). A
settle is one write fenced by the attempt (``_settle`` holds its fields)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo import ASCENDING, ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from pikku_celery.model import keys
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import RUN_TERMINAL, STEP_RUNNING, StepAttempt, StepState
from pikku_celery.model.validate import check_name, check_progress, check_value
from pikku_celery.store import _docs, _ended, _retry
from pikku_celery.store._checks import check_new_steps
from pikku_celery.store._decide import (
    Action,
    claimed_step_doc,
    decide_claim,
    first_claim_filter,
    guard_for,
    running_fields,
)
from pikku_celery.store._settle import expired_fields, failed_fields, succeeded_fields
from pikku_celery.store.base import ClaimResult, NewClaim, NewStep
from pikku_celery.store.mongo.base import Doc, MongoStoreBase
from pikku_celery.store.mongo.errors import (
    DUPLICATE_KEY,
    IMMUTABLE_FIELD,
    PERMANENT_WRITE_CODES,
    storable,
)

_AFTER = ReturnDocument.AFTER


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
        existing = {d[S.ID]: d for d in self._steps.find({S.ID: {"$in": sorted(taken)}},
                                                         session=self._session)
                    } if taken else {}
        return [(_docs.step_from_doc(existing[d[S.ID]]), False) if d[S.ID] in existing
                else (_docs.step_from_doc(d), True) for d in docs]

    def claim_new_step(self, step: NewStep, now_ms: int, lease_ms: int, *, seq: int = 0,
                       worker: str | None = None, task_id: str | None = None) -> NewClaim:
        """One ``update`` command of two ordered statements: the claimed step's insert (an
        upsert that leaves an existing step untouched), then a write that changes nothing
        and only matches the mark a run's end leaves before its own write
        (``store._ended``). The server runs them in order, each on its latest data, so the
        second is this side's read after its write, at no extra round trip. Only when the
        mark is there (the run is ending, or has ended) is the run read, as a claim reads
        it, to tell which."""
        return self._claim_new(step, now_ms, lease_ms, seq, worker, task_id, settle=None)

    def settle_and_claim_new(self, run_id: str, step_name: str, attempt: int, result: Any,
                             now_ms: int, step: NewStep, lease_ms: int, *, seq: int = 0,
                             worker: str | None = None, task_id: str | None = None
                             ) -> NewClaim:
        """``claim_new_step``'s command with the settle as its first statement: an upsert
        guarded on the attempt whose insert would change ``_id`` (refused, error 66), so a
        settle that matches nothing stops the ordered command before the claim, and writes
        nothing."""
        check_value(f"result of step {step_name!r}", result)
        guarded = UpdateOne(
            {S.ID: keys.invocation_id(run_id, step_name), S.ATTEMPT: attempt,
             S.STATUS: STEP_RUNNING},
            {"$set": succeeded_fields(attempt, result, now_ms),
             "$setOnInsert": {S.ID: {"never": "inserted"}}}, upsert=True)
        return self._claim_new(step, now_ms, lease_ms, seq, worker, task_id,
                               settle=(guarded, run_id, step_name, attempt))

    def _claim_new(self, step: NewStep, now_ms: int, lease_ms: int, seq: int,
                   worker: str | None, task_id: str | None,
                   settle: tuple[UpdateOne, str, str, int] | None) -> NewClaim:
        check_new_steps([step])
        if not self._indexes_ready:
            self.create_indexes()
        doc = claimed_step_doc(step, now_ms, lease_ms, worker, task_id, seq)
        fields = {k: v for k, v in doc.items() if k != S.ID}
        first = [] if settle is None else [settle[0]]
        try:
            with storable(f"data of step {step.step_name!r}"):
                wrote = self._steps.bulk_write([
                    *first,
                    UpdateOne({S.ID: doc[S.ID]}, {"$setOnInsert": fields}, upsert=True),
                    UpdateOne({S.ID: keys.run_end_mark_id(step.run_id)},
                              {"$setOnInsert": {S.RUN: None}}),
                ], ordered=True, session=self._session)
        except BulkWriteError as exc:
            error = (exc.details.get("writeErrors") or [{}])[0]
            code, index = error.get("code"), error.get("index")
            if settle is not None and index == 0 and code == IMMUTABLE_FIELD:
                _, run_id, step_name, attempt = settle
                current = self._steps.find_one({S.ID: keys.invocation_id(run_id, step_name)},
                                               {S.ATTEMPT: 1}, session=self._session)
                raise WorkflowStepSupersededError(
                    run_id, step_name, attempt,
                    None if current is None else current[S.ATTEMPT]) from None
            if code in PERMANENT_WRITE_CODES:  # as ``storable`` reports one MongoDB refuses
                what = "the result" if settle is not None and index == 0 else "the data"
                raise InvalidInputError(f"{what} of step {step.step_name!r} cannot be stored "
                                        f"in MongoDB (error {code})") from exc
            if code != DUPLICATE_KEY or index != len(first):
                raise  # not a concurrent insert of the same step
            wrote = None
        if wrote is None or len(first) not in (wrote.upserted_ids or {}):
            existing = self._steps.find_one({S.ID: doc[S.ID]}, session=self._session)
            if existing is None:  # pragma: no cover - purged between the two calls
                raise WorkflowStepNotFoundError(step.run_id, step.step_name)
            return NewClaim(_docs.step_from_doc(existing), created=False)
        if wrote.matched_count == len(first):  # no end mark: the end comes after this claim
            return NewClaim(_docs.step_from_doc(doc), created=True)
        claim = self._unless_run_ended(doc, now_ms)
        if claim.state is None:
            return NewClaim(None, created=True, run_status=claim.run_status)
        return NewClaim(claim.state, created=True)

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

    def claim_step(self, run_id: str, step_name: str, function: str | None, now_ms: int,
                   lease_ms: int, worker: str | None = None,
                   task_id: str | None = None) -> ClaimResult:
        step_id = keys.invocation_id(run_id, step_name)
        # Steady state: a fresh step is claimed by one write, with no read before it.
        claimed = self._steps.find_one_and_update(
            first_claim_filter(step_id, function, now_ms),
            {"$set": running_fields(now_ms, lease_ms, worker, task_id, attempt=1)},
            return_document=_AFTER, session=self._session)
        if claimed is not None:
            return self._unless_run_ended(claimed, now_ms)
        doc = self._steps.find_one({S.ID: step_id}, session=self._session)
        if doc is None:
            raise WorkflowStepNotFoundError(run_id, step_name)
        decision = decide_claim(doc, function, now_ms)
        guard = guard_for(decision, step_id, now_ms)
        if decision.action is Action.NONE:
            return ClaimResult(None)
        if decision.action is Action.EXPIRE:
            return self._expire(guard, doc, now_ms)
        attempt = doc[S.ATTEMPT] + (1 if decision.action is Action.RECLAIM else 0)
        fields = running_fields(now_ms, lease_ms, worker, task_id, attempt=attempt)
        if decision.action is Action.RECLAIM and doc[S.STATUS] == STEP_RUNNING:
            fields.update(_docs.superseded_fields(doc))  # the attempt this write fences out
        update: Doc = {"$set": fields}
        if decision.action is Action.RECLAIM:
            update["$inc"] = {S.ATTEMPT: 1}
        claimed = self._steps.find_one_and_update(guard, update, return_document=_AFTER,
                                                  session=self._session)
        if claimed is None:
            return ClaimResult(None)  # lost the race to another claimer
        return self._unless_run_ended(claimed, now_ms)

    def _unless_run_ended(self, claimed: Doc, now_ms: int) -> ClaimResult:
        """The claim's half of the Dekker pair with a run's end (``store._ended``): read the
        run *after* the claim's write; when it has ended, fence the attempt just started
        (guarded on it: a fence by the ender that landed first is kept) and claim nothing.
        One point read by ``_id`` per claim that won; a lost claim reads nothing."""
        run = self._runs.find_one({R.ID: claimed[S.RUN]}, {R.STATUS: 1, R.ERROR: 1},
                                  session=self._session)
        if run is None or run[R.STATUS] not in RUN_TERMINAL:
            return ClaimResult(_docs.step_from_doc(claimed))
        attempt = claimed[S.ATTEMPT]
        error = _ended.ended_error(claimed[S.RUN], run[R.STATUS], run.get(R.ERROR))
        self._steps.update_one(
            {S.ID: claimed[S.ID], S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING},
            {"$set": _ended.fence_fields(attempt, error, now_ms, running=True)},
            session=self._session)
        return ClaimResult(None, run_status=run[R.STATUS])

    def _expire(self, guard: Doc, doc: Doc, now_ms: int) -> ClaimResult:
        found = self._steps.update_one(guard, {"$set": expired_fields(doc, now_ms)},
                                       session=self._session)
        if found.matched_count == 0:
            return ClaimResult(None)  # renewed (or claimed) since we read it
        return ClaimResult(None, wake_run=True)

    def set_result(self, run_id: str, step_name: str, attempt: int, result: Any,
                   now_ms: int) -> StepState:
        check_value(f"result of step {step_name!r}", result)
        state = self._settle(run_id, step_name, attempt,
                             succeeded_fields(attempt, result, now_ms))
        assert state is not None  # _settle raises when it must match and does not
        return state

    def set_error(self, run_id: str, step_name: str, attempt: int, error: dict[str, Any],
                  now_ms: int, *, retry_at_ms: int | None = None,
                  final: bool = False) -> StepState:
        check_value(f"error of step {step_name!r}", error)
        fields = failed_fields(attempt, error, now_ms, retry_at_ms or now_ms)
        # With attempts left the next one is due at retry_at_ms; with none left the step is
        # failed for good and never due again. Try the common case first.
        state = None if final else self._settle(
            run_id, step_name, attempt, fields, extra_guard={S.MAX_ATTEMPTS: {"$gt": attempt}},
            must_match=False)
        if state is None:
            fields[S.DUE] = None
            state = self._settle(run_id, step_name, attempt, fields)
        assert state is not None  # _settle raises when it must match and does not
        return state

    def _settle(self, run_id: str, step_name: str, attempt: int, fields: Doc, *,
                extra_guard: Doc | None = None, must_match: bool = True) -> StepState | None:
        step_id = keys.invocation_id(run_id, step_name)
        guard: Doc = {S.ID: step_id, S.ATTEMPT: attempt, S.STATUS: STEP_RUNNING,
                      **(extra_guard or {})}
        with storable(f"outcome of step {step_name!r}"):
            doc = self._steps.find_one_and_update(guard, {"$set": fields},
                                                  return_document=_AFTER, session=self._session)
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

