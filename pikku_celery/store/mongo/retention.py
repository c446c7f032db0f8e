"""Retention: bounded counts of runs, and purges of ended runs in batches (a child its
parent has not heard yet is kept: ``store._retention``)."""

from __future__ import annotations

from collections.abc import Iterable

from pikku_celery.model import keys
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import HistoryField as H
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import RUN_TERMINAL, STEP_RUNNING
from pikku_celery.store import _retention
from pikku_celery.store.base import RunMatch, check_run_match
from pikku_celery.store.mongo.base import Doc, MongoStoreBase


class MongoRetention(MongoStoreBase):
    def count_runs(self, *, status: str, workflow: str | None = None,
                   updated_before_ms: int | None = None, limit: int = 10_000,
                   match: RunMatch | None = None) -> int:
        _retention.check_count(status, workflow, updated_before_ms, limit)
        # Served by (workflow, status, ...), (status, created_ms, ...) or (status,
        # updated_ms): a count of index keys that stops at ``limit`` (with a ``match``,
        # of the documents it reads: index the fields it names).
        query: Doc = {R.STATUS: status, **check_run_match(match)}
        if workflow is not None:
            query[R.WORKFLOW] = workflow
        if updated_before_ms is not None:
            query[R.UPDATED] = {"$lt": updated_before_ms}
        return int(self._runs.count_documents(query, limit=limit, session=self._session))

    def purge_runs(self, ended_before_ms: int, *, statuses: Iterable[str] = RUN_TERMINAL,
                   limit: int = 500) -> list[str]:
        chosen = _retention.check_purge(ended_before_ms, statuses, limit)
        ended = {R.STATUS: {"$in": chosen}}
        # (status, updated_ms) serves the batch: the ended runs' keys before the cutoff.
        # A child its parent has not heard yet is kept (``_retention.parked_steps``), and
        # the batch read again past it, so a kept child never cuts a purge short: the
        # batch comes back short only when no run is left to purge. Rarely more than one
        # read (and one more of the batch's parked steps, only when it holds a child).
        unheard: set[str] = set()
        while True:
            found = list(self._runs.find({**ended, R.UPDATED: {"$lt": ended_before_ms}},
                                         {R.ID: 1, R.PARENT_RUN: 1, R.PARENT_STEP: 1},
                                         session=self._session
                                         ).limit(limit + len(unheard)))
            more = self._unheard_children([d for d in found if d[R.ID] not in unheard])
            unheard |= more
            if not more or len(found) < limit + len(unheard) - len(more):
                break
        ids = [d[R.ID] for d in found if d[R.ID] not in unheard][:limit]
        if not ids:
            return []
        self._steps.delete_many({S.RUN: {"$in": ids}}, session=self._session)
        self._steps.delete_many({S.ID: {"$in": [keys.run_end_mark_id(i) for i in ids]}},
                                session=self._session)  # the marks their ends left
        self._history.delete_many({H.RUN: {"$in": ids}}, session=self._session)
        self._events.delete_many({E.RUN: {"$in": ids}}, session=self._session)
        # The ended status again, in the delete itself: whatever was read, nothing live goes.
        self._runs.delete_many({R.ID: {"$in": ids}, **ended}, session=self._session)
        return ids

    def _unheard_children(self, runs: list[Doc]) -> set[str]:
        """The child runs among ``runs`` whose parent's step still waits on them (the parent
        has not heard the outcome: ``_retention.unheard_children``); one read by ``_id``,
        none when the batch holds no child."""
        parked = _retention.parked_steps(runs)
        if not parked:
            return set()
        return {d[S.CHILD_RUN] for d in self._steps.find(
            {S.ID: {"$in": sorted(parked)}, S.STATUS: STEP_RUNNING},
            {S.CHILD_RUN: 1}, session=self._session) if parked.get(d[S.ID]) == d.get(S.CHILD_RUN)}
