"""Runs: create, read (a run and its steps in one command), transitions, run state, and the
end's fence of the steps a run left unsettled (``store._ended``); workflow versions."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from pymongo import ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from pikku_celery.model import keys
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.keys import VersionField as V
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_RUNNING,
    STEP_STATUSES,
    StepState,
    WorkflowRun,
)
from pikku_celery.model.validate import check_name, check_state_write
from pikku_celery.store import _docs, _ended, _retry
from pikku_celery.store._checks import check_new_run, check_run_end, run_conflict
from pikku_celery.store.base import NewRun, RunRead
from pikku_celery.store.mongo.base import Doc, MongoStoreBase
from pikku_celery.store.mongo.errors import IMMUTABLE_FIELD, storable


class MongoRuns(MongoStoreBase):
    def create_run(self, run: NewRun, now_ms: int) -> tuple[WorkflowRun, bool]:
        check_new_run(run)
        if not self._indexes_ready:
            self.create_indexes()
        doc = _docs.new_run_doc(run, now_ms)
        try:
            with storable("workflow input"):
                self._runs.insert_one(doc, session=self._session)
            return _docs.run_from_doc(doc), True
        except DuplicateKeyError:
            existing = self._runs.find_one({R.ID: run.run_id}, session=self._session)
            if existing is None:  # pragma: no cover - purged between the two calls
                raise
            if existing[R.WORKFLOW] != run.workflow:
                raise run_conflict(run, existing[R.WORKFLOW]) from None
            return _docs.run_from_doc(existing), False

    def get_run(self, run_id: str) -> WorkflowRun | None:
        check_name("run id", run_id)
        doc = self._runs.find_one({R.ID: run_id}, session=self._session)
        return None if doc is None else _docs.run_from_doc(doc)

    def read_run(self, run_id: str, *, run: bool = True, input: bool = True,
                 all_steps: bool = False, step_names: Collection[str] = (),
                 recorded_after: int | None = None) -> RunRead:
        check_name("run id", run_id)
        wanted = _steps_filter(run_id, all_steps, step_names, recorded_after)
        if not run:
            found = [] if wanted is None else list(self._steps.find(wanted, session=self._session))
            return RunRead(None, [_docs.step_from_doc(d) for d in found])
        # The run and its steps in one command: the run's document, then the steps'.
        pipeline: list[Doc] = [{"$match": {R.ID: run_id}}]
        if not input:
            pipeline.append({"$project": {R.INPUT: 0}})
        if wanted is not None:
            pipeline.append({"$unionWith": {"coll": keys.STEPS,
                                            "pipeline": [{"$match": wanted}]}})
        docs = list(self._runs.aggregate(pipeline, session=self._session))
        head = docs[0] if docs and S.NAME not in docs[0] else None
        return RunRead(None if head is None else _docs.run_from_doc(head),
                       [_docs.step_from_doc(d) for d in docs[1 if head else 0:]])

    def transition_run(self, run_id: str, from_statuses: Iterable[str], to_status: str,
                       now_ms: int, *, output: Any = None, error: dict[str, Any] | None = None,
                       cancel_reason: str | None = None, marked: bool = False) -> bool:
        check_run_end(run_id, output, error)
        fields: Doc = {R.STATUS: to_status, R.OUTPUT: output, R.ERROR: error,
                       R.UPDATED: now_ms}
        if cancel_reason is not None:
            fields[R.CANCEL_REASON] = cancel_reason
        if to_status in RUN_TERMINAL and not marked:
            # The end's mark first, then the run's write (``store._ended``): a step a pass
            # inserts claimed after this point sees the mark and reads the run.
            self._steps.update_one({S.ID: keys.run_end_mark_id(run_id)},
                                   {"$setOnInsert": {S.RUN: None}}, upsert=True,
                                   session=self._session)
        with storable("workflow output"):
            found = self._runs.update_one(
                {R.ID: run_id, R.STATUS: {"$in": list(from_statuses)}}, {"$set": fields},
                session=self._session)
        return found.matched_count == 1

    def retry_run(self, run_id: str, now_ms: int, *, queued: bool = False,
                  by: str | None = None) -> list[StepState] | None:
        check_name("run id", run_id)
        # The reopen is owed from this write on (``R.REOPEN``), and forgotten only once it
        # is done: a call cut short after it (an election) is finished by ``resume_retry``.
        found = self._runs.update_one(
            {R.ID: run_id, R.STATUS: {"$in": [RUN_FAILED, RUN_CANCELLED]}},
            {"$set": {**_retry.revived_fields(now_ms, queued=queued), R.REOPEN: True},
             "$push": {R.LINEAGE: _retry.retry_entry(now_ms, by)}}, session=self._session)
        if found.matched_count == 0:
            return None
        return [] if queued else self._reopen_owed(run_id, now_ms)

    def resume_retry(self, run_id: str, now_ms: int) -> list[StepState] | None:
        check_name("run id", run_id)
        if self._runs.find_one({R.ID: run_id, R.STATUS: RUN_RUNNING, R.REOPEN: True},
                               {R.ID: 1}, session=self._session) is None:
            return None
        return self._reopen_owed(run_id, now_ms)

    def _reopen_owed(self, run_id: str, now_ms: int) -> list[StepState]:
        reopened = self._reopen_steps(run_id, now_ms)
        self._runs.update_one({R.ID: run_id, R.STATUS: RUN_RUNNING, R.REOPEN: True},
                              {"$unset": {R.REOPEN: ""}}, session=self._session)
        return reopened

    def admit_run(self, run_id: str, now_ms: int) -> list[StepState] | None:
        check_name("run id", run_id)
        # A reopen owed stays owed until it is done (``_reopen_owed``): a pass landing
        # between this write and the reopen finishes it (``engine.reopen.finish_reopen``) instead
        # of replaying the failed steps as the run's outcome.
        before = self._runs.find_one_and_update(
            {R.ID: run_id, R.STATUS: RUN_QUEUED},
            {"$set": {R.STATUS: RUN_RUNNING, R.UPDATED: now_ms}},
            projection={R.REOPEN: 1}, session=self._session)
        if before is None:
            return None
        return self._reopen_owed(run_id, now_ms) if before.get(R.REOPEN) else []

    def _reopen_steps(self, run_id: str, now_ms: int) -> list[StepState]:
        """The steps of a run just made live again that its end left failed for good."""
        # Live first, then the end's mark goes: a step run in place meanwhile saw the mark
        # and read the run (live), or sees neither. The mark goes before any step is
        # reopened: a fence of the end that lands after this refuses itself.
        self._steps.delete_one({S.ID: keys.run_end_mark_id(run_id)}, session=self._session)
        reopened = []
        for doc in self._steps.find({S.RUN: run_id, S.STATUS: STEP_FAILED, S.DUE: None},
                                    session=self._session):
            after = self._steps.find_one_and_update(
                {S.ID: doc[S.ID], S.ATTEMPT: doc[S.ATTEMPT], S.STATUS: STEP_FAILED,
                 S.DUE: None}, _retry.reopened(doc, now_ms),
                return_document=ReturnDocument.AFTER, session=self._session)
            if after is not None:
                reopened.append(_docs.step_from_doc(after))
        return reopened

    def write_run_state(self, run_id: str, writer: str, values: Mapping[str, Any],
                        version: int, now_ms: int) -> WorkflowRun | None:
        check_name("run id", run_id)
        current = self._runs.find_one({R.ID: run_id}, projection={R.STATE: 1},
                                      session=self._session)
        if current is None:
            return None
        # Checked against the map as read; the guard below makes sure it is still that map.
        stored = check_state_write(writer, values, current.get(R.STATE) or {})
        # Runs stored before run state have no version field: null matches a missing one.
        at = version if version else {"$in": [0, None]}
        doc = self._runs.find_one_and_update(
            {R.ID: run_id, R.STATE_VERSION: at},
            {"$set": {**{f"{R.STATE}.{k}": v for k, v in stored.items()},
                      R.STATE_VERSION: version + 1},
             "$push": {R.STATE_WRITERS: writer}, "$max": {R.UPDATED: now_ms}},
            return_document=ReturnDocument.AFTER, session=self._session)
        return None if doc is None else _docs.run_from_doc(doc)

    def touch_run(self, run_id: str, now_ms: int) -> str | None:
        check_name("run id", run_id)
        doc = self._runs.find_one_and_update({R.ID: run_id}, {"$max": {R.UPDATED: now_ms}},
                                             projection={R.STATUS: 1},
                                             return_document=ReturnDocument.AFTER,
                                             session=self._session)
        return None if doc is None else str(doc[R.STATUS])

    def cancel_steps(self, run_id: str, error: dict[str, Any], now_ms: int, *,
                     while_ended: bool = False) -> int:
        check_name("run id", run_id)
        fenced = 0
        # With ``while_ended``, each fence is the second statement of an ordered command
        # whose first matches the end's mark and fails without it (an upsert that would
        # change ``_id``): a retry that removed the mark stops the fence before it writes.
        end_standing = [UpdateOne({S.ID: keys.run_end_mark_id(run_id)},
                                  {"$setOnInsert": {S.ID: {"never": "inserted"}}},
                                  upsert=True)] if while_ended else []
        # Only what the guard repeats (a projection built per call: drivers may keep it).
        read = {S.ATTEMPT: 1, S.STATUS: 1, S.DUE: 1}
        for doc in self._steps.find({S.RUN: run_id, **_ended.UNSETTLED}, read,
                                    session=self._session):
            # Each step is fenced by a write that repeats what was read (attempt, status,
            # due): one that settled since the read keeps its outcome and its history entry.
            # An attempt in flight ends here, its entry closed by the same write; a failed
            # one waiting for its retry keeps its own entry. Cancels are rare and runs have
            # few unsettled steps: one write each is cheap.
            # A step claimed between the read and its write is not matched here: its claim
            # reads the run after its own write and fences itself (``_unless_run_ended``).
            guard: Doc = {S.ID: doc[S.ID], S.ATTEMPT: doc[S.ATTEMPT], S.STATUS: doc[S.STATUS],
                          S.DUE: doc.get(S.DUE)}
            fields = _ended.fence_fields(doc[S.ATTEMPT], error, now_ms,
                                         running=doc[S.STATUS] == STEP_RUNNING)
            if not end_standing:
                fenced += self._steps.update_one(guard, {"$set": fields},
                                                 session=self._session).matched_count
                continue
            try:
                fenced += self._steps.bulk_write(
                    [*end_standing, UpdateOne(guard, {"$set": fields})], ordered=True,
                    session=self._session).matched_count - 1
            except BulkWriteError as exc:
                codes = [e.get("code") for e in exc.details.get("writeErrors") or ()]
                if codes != [IMMUTABLE_FIELD]:
                    raise
                return fenced  # the end was undone (a retry): nothing more is fenced
        return fenced

    # --- versions ---------------------------------------------------------------------

    def record_version(self, workflow: str, version: str, source: str, now_ms: int) -> bool:
        try:
            self._versions.insert_one({V.ID: f"{workflow}:{version}", V.WORKFLOW: workflow,
                                       V.VERSION: version, V.SOURCE: source,
                                       V.CREATED: now_ms}, session=self._session)
            return True
        except DuplicateKeyError:
            return False

    def get_version(self, workflow: str, version: str) -> dict[str, Any] | None:
        doc = self._versions.find_one({V.ID: f"{workflow}:{version}"}, session=self._session)
        return None if doc is None else {k: v for k, v in doc.items() if k != V.ID}


def _steps_filter(run_id: str, all_steps: bool, step_names: Collection[str],
                  recorded_after: int | None) -> Doc | None:
    """The steps ``read_run`` asks for (``None``: none). Each clause is served by an index:
    ``_id`` for named steps, ``(run_id, status, seq)`` for those recorded since a token
    (every status named: one range of ``seq`` per status)."""
    if all_steps:
        return {S.RUN: run_id}
    clauses: list[Doc] = []
    if step_names:
        ids = sorted(keys.invocation_id(run_id, name) for name in step_names)
        clauses.append({S.ID: {"$in": ids}})
    if recorded_after is not None:
        clauses.append({S.RUN: run_id, S.STATUS: {"$in": list(STEP_STATUSES)},
                        S.SEQ: {"$gt": recorded_after}})
    if not clauses:
        return None
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}
