"""Listing and the reaper's sweeps: runs newest first, lapsed and due steps, stalled runs
and their unsettled steps. Each query is read in its paging order from an index: nothing
is sorted in memory (the schema in ``store.mongo`` names the index of each)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection

from pymongo import ASCENDING, DESCENDING

from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import (
    RUN_RUNNING,
    RUN_STATUSES,
    STEP_FAILED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepState,
    WorkflowRun,
)
from pikku_celery.model.validate import check_listing, check_name
from pikku_celery.store import _docs, _ended
from pikku_celery.store.base import RunMatch, check_run_match, due_sweep_key
from pikku_celery.store.mongo.base import Doc, MongoStoreBase


class MongoListing(MongoStoreBase):
    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before_ms: int | None = None,
                  before_run_id: str | None = None, match: RunMatch | None = None
                  ) -> list[WorkflowRun]:
        check_listing(workflow, status, limit, RUN_STATUSES)
        wanted = check_run_match(match)  # plain values only: never an operator
        # Every run has one of RUN_STATUSES: naming them all when no status is asked for
        # lets a (status, created_ms, run_id) index serve the sort (one sorted scan per
        # status, merged) instead of a scan sorted in memory.
        query: Doc = {R.STATUS: status if status is not None else {"$in": list(RUN_STATUSES)},
                      **wanted}
        if workflow is not None:
            query[R.WORKFLOW] = workflow
        if created_before_ms is not None:
            # Page on (created, id), the sort order: runs of the same millisecond are kept.
            # The outer bound keeps the scan inside the page; the $or settles the tie.
            before_ms = int(created_before_ms)
            if before_run_id is None:
                query[R.CREATED] = {"$lt": before_ms}
            else:
                query[R.CREATED] = {"$lte": before_ms}
                query["$or"] = [{R.CREATED: {"$lt": before_ms}},
                                {R.RUN: {"$lt": check_name("run id", before_run_id)}}]
        cursor = self._runs.find(query, session=self._session).sort(
            [(R.CREATED, DESCENDING), (R.RUN, DESCENDING)])
        return [_docs.run_from_doc(d) for d in cursor.limit(limit)]

    def list_forks(self, run_id: str, limit: int = 50) -> list[WorkflowRun]:
        check_name("run id", run_id)
        check_listing(None, None, limit, RUN_STATUSES)
        cursor = self._runs.find({R.FORKED_FROM: run_id}, session=self._session).sort(
            [(R.CREATED, ASCENDING), (R.RUN, ASCENDING)])
        return [_docs.run_from_doc(d) for d in cursor.limit(limit)]

    def find_lapsed_steps(self, now_ms: int, limit: int,
                          after: tuple[int, str] | None = None) -> list[StepState]:
        # (status, lease_expires_ms, _id) serves the range and the order: no sort in memory.
        query: Doc = {S.STATUS: STEP_RUNNING, S.LEASE: {"$ne": None, "$lt": now_ms}}
        query.update(_page_after(S.LEASE, after))
        cursor = self._steps.find(query, SWEPT, session=self._session).sort(
            [(S.LEASE, ASCENDING), (S.ID, ASCENDING)])
        return [_docs.step_from_doc(d) for d in cursor.limit(limit)]

    def find_due_steps(self, now_ms: int, dispatched_before_ms: int, limit: int,
                       after: tuple[int, str] | None = None) -> list[StepState]:
        # One query per branch, each read in order from its own index ((status, updated_ms,
        # _id) for undispatched steps, (status, due_ms, _id) for due ones, one sorted scan
        # per status merged by the server), then the two pages merged here: one query with
        # an $or had to sort the whole backlog in memory (no index orders both branches).
        undispatched = self._steps.find(
            {S.STATUS: STEP_PENDING, S.UPDATED: {"$lt": dispatched_before_ms},
             **_page_after(S.UPDATED, after)}, SWEPT, session=self._session
        ).sort([(S.UPDATED, ASCENDING), (S.ID, ASCENDING)]).limit(limit)
        due = self._steps.find(
            {S.STATUS: {"$in": [STEP_SCHEDULED, STEP_FAILED, STEP_SUCCEEDED]},
             S.DUE: {"$ne": None, "$lte": now_ms}, **_page_after(S.DUE, after)},
            SWEPT, session=self._session
        ).sort([(S.DUE, ASCENDING), (S.ID, ASCENDING)]).limit(limit)
        merged = heapq.merge([_docs.step_from_doc(d) for d in undispatched],
                             [_docs.step_from_doc(d) for d in due], key=due_sweep_key)
        return list(itertools.islice(merged, limit))

    def find_stalled_runs(self, idle_since_ms: int, limit: int) -> list[WorkflowRun]:
        cursor = self._runs.find({R.STATUS: RUN_RUNNING, R.UPDATED: {"$lt": idle_since_ms}},
                                 session=self._session)
        return [_docs.run_from_doc(d) for d in cursor.limit(limit)]

    def touch_runs(self, run_ids: Collection[str], now_ms: int) -> None:
        if run_ids:
            self._runs.update_many({R.ID: {"$in": list(run_ids)}},
                                   {"$max": {R.UPDATED: now_ms}}, session=self._session)

    def find_unsettled_steps(self, run_ids: Collection[str]) -> list[StepState]:
        if not run_ids:
            return []
        # Served by the (run_id, status, seq) index: a few keys per run, its unsettled
        # steps (and failed ones), not every step a long run has settled.
        found = self._steps.find({S.RUN: {"$in": list(run_ids)}, **_ended.UNSETTLED},
                                 SWEPT, session=self._session)
        return [_docs.step_from_doc(d) for d in found]


#: What the reaper's sweeps leave out of the steps they read: the body's data, its progress
#: and its attempts' history (a sweep needs names, status, attempt, function, lease and due
#: times; an opened gate's result is kept, it is its decision). Each live worker sweeps
#: every half second: a lapsed step of 8 MiB was read whole by each of them until it was
#: claimed again, a hundred MiB a second on six workers (the chaos harness's full profile
#: with partitions).
SWEPT: Doc = {S.DATA: 0, S.PROGRESS: 0, S.ATTEMPTS: 0}


def _page_after(field: str, after: tuple[int, str] | None) -> Doc:
    """The filter of a page that starts after ``(field value, _id)`` in that sort order."""
    if after is None:
        return {}
    value, step_id = after
    return {"$or": [{field: {"$gt": value}}, {field: value, S.ID: {"$gt": step_id}}]}
