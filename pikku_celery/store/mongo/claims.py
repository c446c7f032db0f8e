"""Claims: a step's first claim (from its message's hint, or optimistic), a reclaim
decided on one read (``_decide``), a step inserted already claimed by the pass that runs it
in place, and the settles that travel with a pass's next write. A claim that won checks
for a run's end after its write (``store._ended``): in the same command when it needs no
read (the end's mark), else by reading the run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo import ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError

from pikku_celery.model import keys
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowStepNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import RUN_TERMINAL, STEP_RUNNING, StepState
from pikku_celery.model.validate import check_value
from pikku_celery.store import _docs, _ended
from pikku_celery.store._checks import check_new_steps
from pikku_celery.store._claim_hint import checked_hint, claimed_from_hint, hinted_filter
from pikku_celery.store._decide import (
    Action,
    claimed_step_doc,
    decide_claim,
    first_claim_filter,
    guard_for,
    running_fields,
)
from pikku_celery.store._settle import expired_fields, succeeded_fields
from pikku_celery.store.base import ClaimResult, NewClaim, NewStep
from pikku_celery.store.mongo.base import STEP_REPLY, Doc, MongoStoreBase
from pikku_celery.store.mongo.errors import (
    DUPLICATE_KEY,
    IMMUTABLE_FIELD,
    PERMANENT_WRITE_CODES,
    storable,
)

_AFTER = ReturnDocument.AFTER


def _end_mark(run_id: str) -> UpdateOne:
    """The write of the mark a run's end leaves among its steps (``store._ended``)."""
    return UpdateOne({S.ID: keys.run_end_mark_id(run_id)}, {"$setOnInsert": {S.RUN: None}},
                     upsert=True)


class MongoClaims(MongoStoreBase):
    def settle_and_insert_steps(self, run_id: str, step_name: str, attempt: int, result: Any,
                                now_ms: int, steps: Sequence[NewStep], *, seq: int = 0,
                                end_mark: bool = False) -> list[tuple[StepState, bool]]:
        """One ``update`` command: the settle, guarded as ``settle_and_claim_new``'s (a
        settle that matches nothing stops the ordered command before the inserts), then
        each step's insert, an upsert that leaves an existing step untouched, then (with
        ``end_mark``) the upsert of the run's end mark, as ``transition_run`` writes it."""
        check_value(f"result of step {step_name!r}", result)
        check_new_steps(steps)
        if not self._indexes_ready:
            self.create_indexes()
        docs = [_docs.new_step_doc(step, now_ms, seq) for step in steps]
        try:
            with storable(f"outcome of step {step_name!r}"):
                wrote = self._steps.bulk_write([
                    self._guarded_settle(run_id, step_name, attempt, result, now_ms),
                    *(UpdateOne({S.ID: d[S.ID]},
                                {"$setOnInsert": {k: v for k, v in d.items() if k != S.ID}},
                                upsert=True) for d in docs),
                    *([_end_mark(run_id)] if end_mark else []),
                ], ordered=True, session=self._session)
        except BulkWriteError as exc:
            error = (exc.details.get("writeErrors") or [{}])[0]
            code, index = error.get("code"), error.get("index")
            if index == 0 and code == IMMUTABLE_FIELD:
                raise self._superseded(run_id, step_name, attempt) from None
            if code in PERMANENT_WRITE_CODES:
                what = "the result" if index == 0 else "the data"
                raise InvalidInputError(f"{what} of step {step_name!r} or the steps after it "
                                        f"cannot be stored in MongoDB (error {code})") from exc
            raise
        created = {i - 1 for i in (wrote.upserted_ids or {}) if 0 < i <= len(docs)}
        return self._as_recorded(docs, {d[S.ID] for i, d in enumerate(docs)
                                        if i not in created})

    def _guarded_settle(self, run_id: str, step_name: str, attempt: int, result: Any,
                        now_ms: int) -> UpdateOne:
        """A settle as one statement of an ordered command: an upsert guarded on the
        attempt whose insert would change ``_id`` (refused, error 66), so a settle that
        matches nothing stops the command there, and writes nothing."""
        return UpdateOne(
            {S.ID: keys.invocation_id(run_id, step_name), S.ATTEMPT: attempt,
             S.STATUS: STEP_RUNNING},
            {"$set": succeeded_fields(attempt, result, now_ms),
             "$setOnInsert": {S.ID: {"never": "inserted"}}}, upsert=True)

    def _superseded(self, run_id: str, step_name: str, attempt: int
                    ) -> WorkflowStepSupersededError:
        """The error of a settle that matched nothing, naming the step's attempt now."""
        current = self._steps.find_one({S.ID: keys.invocation_id(run_id, step_name)},
                                       {S.ATTEMPT: 1}, session=self._session)
        return WorkflowStepSupersededError(run_id, step_name, attempt,
                                           None if current is None else current[S.ATTEMPT])

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
        guarded = self._guarded_settle(run_id, step_name, attempt, result, now_ms)
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
                raise self._superseded(run_id, step_name, attempt) from None
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

    def claim_step(self, run_id: str, step_name: str, function: str | None, now_ms: int,
                   lease_ms: int, worker: str | None = None,
                   task_id: str | None = None, *, expected: object = None) -> ClaimResult:
        step_id = keys.invocation_id(run_id, step_name)
        hint = checked_hint(expected, step_id, function)
        if hint is not None:
            hinted = self._claim_hinted(hint, now_ms, lease_ms, worker, task_id)
            if hinted is not None:
                return hinted
        # Steady state: a fresh step is claimed by one write, with no read before it.
        claimed = self._steps.find_one_and_update(
            first_claim_filter(step_id, function, now_ms),
            {"$set": running_fields(now_ms, lease_ms, worker, task_id, attempt=1)},
            projection=STEP_REPLY, return_document=_AFTER, session=self._session)
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
        claimed = self._steps.find_one_and_update(guard, update, projection=STEP_REPLY,
                                                  return_document=_AFTER, session=self._session)
        if claimed is None:
            return ClaimResult(None)  # lost the race to another claimer
        return self._unless_run_ended(claimed, now_ms)

    def _claim_hinted(self, hint: Doc, now_ms: int, lease_ms: int, worker: str | None,
                      task_id: str | None) -> ClaimResult | None:
        """A first claim from the step's message (``store._claim_hint``): one ``update``
        command of two ordered statements, as ``claim_new_step``'s. The claim, an upsert
        whose insert would change ``_id`` (refused, error 66: the hint did not match, and
        the command stops there), then the write that only matches the mark a run's end
        leaves (``store._ended``), run after the claim: this side's read after its write.
        ``None`` when the hint did not match: claim the usual way."""
        fields = running_fields(now_ms, lease_ms, worker, task_id, attempt=1)
        try:
            wrote = self._steps.bulk_write([
                UpdateOne(hinted_filter(hint),
                          {"$set": fields, "$setOnInsert": {S.ID: {"never": "inserted"}}},
                          upsert=True),
                UpdateOne({S.ID: keys.run_end_mark_id(hint[S.RUN])},
                          {"$setOnInsert": {S.RUN: None}}),
            ], ordered=True, session=self._session)
        except BulkWriteError as exc:
            error = (exc.details.get("writeErrors") or [{}])[0]
            if error.get("index") == 0 and error.get("code") in (IMMUTABLE_FIELD,
                                                                 DUPLICATE_KEY):
                return None
            raise
        claimed = claimed_from_hint(hint, now_ms, lease_ms, worker, task_id)
        if wrote.matched_count == 1:  # no end mark: the end comes after this claim
            return ClaimResult(_docs.step_from_doc(claimed))
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
