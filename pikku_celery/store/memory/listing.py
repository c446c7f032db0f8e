"""Listing and the reaper's sweeps: runs newest first, lapsed and due steps, stalled runs
and their unsettled steps, in the MongoDB store's orders and pages."""

from __future__ import annotations

import copy
from collections.abc import Collection

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
from pikku_celery.store._decide import is_due, lease_lapsed
from pikku_celery.store.base import RunMatch, check_run_match, due_sweep_key, run_matches
from pikku_celery.store.memory.base import Doc, MemoryStoreBase


class MemoryListing(MemoryStoreBase):
    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before_ms: int | None = None,
                  before_run_id: str | None = None, match: RunMatch | None = None
                  ) -> list[WorkflowRun]:
        check_listing(workflow, status, limit, RUN_STATUSES)
        wanted = check_run_match(match)
        cursor = None if created_before_ms is None else (created_before_ms, before_run_id)
        with self._lock:
            docs = [d for d in self._runs.values()
                    if (workflow is None or d[R.WORKFLOW] == workflow)
                    and (status is None or d[R.STATUS] == status)
                    and (cursor is None or _before(d, cursor))
                    and run_matches(d.get(R.INPUT), wanted)]
            docs.sort(key=lambda d: (d[R.CREATED], d[R.ID]), reverse=True)
            return [_docs.run_from_doc(copy.deepcopy(d)) for d in docs[:limit]]

    def list_forks(self, run_id: str, limit: int = 50) -> list[WorkflowRun]:
        check_name("run id", run_id)
        check_listing(None, None, limit, RUN_STATUSES)
        with self._lock:
            docs = sorted((d for d in self._runs.values() if d.get(R.FORKED_FROM) == run_id),
                          key=lambda d: (d[R.CREATED], d[R.ID]))
            return [_docs.run_from_doc(copy.deepcopy(d)) for d in docs[:limit]]

    def find_lapsed_steps(self, now_ms: int, limit: int,
                          after: tuple[int, str] | None = None) -> list[StepState]:
        with self._lock:
            docs = [d for d in self._steps.values()
                    if d[S.STATUS] == STEP_RUNNING and lease_lapsed(d, now_ms)]
            keyed = sorted(((d[S.LEASE], d[S.ID]), d) for d in docs)
            return _page(keyed, after, limit)

    def find_due_steps(self, now_ms: int, dispatched_before_ms: int, limit: int,
                       after: tuple[int, str] | None = None) -> list[StepState]:
        with self._lock:
            docs = [d for d in self._steps.values()
                    if (d[S.STATUS] == STEP_PENDING and d[S.UPDATED] < dispatched_before_ms)
                    or (d[S.STATUS] in (STEP_SCHEDULED, STEP_FAILED, STEP_SUCCEEDED)
                        and is_due(d, now_ms))]
            keyed = sorted((due_sweep_key(_docs.step_from_doc(d)), d) for d in docs)
            return _page(keyed, after, limit)

    def find_stalled_runs(self, idle_since_ms: int, limit: int) -> list[WorkflowRun]:
        with self._lock:
            docs = [d for d in self._runs.values()
                    if d[R.STATUS] == RUN_RUNNING and d[R.UPDATED] < idle_since_ms]
            return [_docs.run_from_doc(copy.deepcopy(d)) for d in docs[:limit]]

    def touch_runs(self, run_ids: Collection[str], now_ms: int) -> None:
        with self._lock:
            for run_id in run_ids:
                doc = self._runs.get(run_id)
                if doc is not None:
                    doc[R.UPDATED] = max(doc[R.UPDATED], now_ms)

    def find_unsettled_steps(self, run_ids: Collection[str]) -> list[StepState]:
        wanted = set(run_ids)
        with self._lock:
            return [_docs.step_from_doc(copy.deepcopy(d)) for d in self._steps.values()
                    if d[S.RUN] in wanted and _ended.is_unsettled(d)]


def _page(keyed: list[tuple[tuple[int, str], Doc]], after: tuple[int, str] | None,
          limit: int) -> list[StepState]:
    """The page of ``keyed`` (sorted by its paging key) that starts after ``after``."""
    page = [d for key, d in keyed if after is None or key > after][:limit]
    return [_docs.step_from_doc(copy.deepcopy(d)) for d in page]


def _before(doc: Doc, cursor: tuple[int, str | None]) -> bool:
    created, run_id = cursor
    if doc[R.CREATED] != created:
        return bool(doc[R.CREATED] < created)
    return run_id is not None and doc[R.ID] < run_id
