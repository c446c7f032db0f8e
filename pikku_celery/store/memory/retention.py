"""Retention on the documents held here: ``count_runs`` and ``purge_runs``, with the
checks and the kept-child rule of ``store._retention`` that the MongoDB store applies."""

from __future__ import annotations

from collections.abc import Iterable

from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.keys import StepField as S
from pikku_celery.model.records import RUN_TERMINAL, STEP_RUNNING
from pikku_celery.store import _retention
from pikku_celery.store.base import RunMatch, check_run_match, run_matches
from pikku_celery.store.memory.base import MemoryStoreBase


class MemoryRetention(MemoryStoreBase):
    def count_runs(self, *, status: str, workflow: str | None = None,
                   updated_before_ms: int | None = None, limit: int = 10_000,
                   match: RunMatch | None = None) -> int:
        _retention.check_count(status, workflow, updated_before_ms, limit)
        wanted = check_run_match(match)
        with self._lock:
            found = sum(1 for d in self._runs.values()
                        if d[R.STATUS] == status
                        and (workflow is None or d[R.WORKFLOW] == workflow)
                        and (updated_before_ms is None or d[R.UPDATED] < updated_before_ms)
                        and run_matches(d.get(R.INPUT), wanted))
        return min(found, limit)

    def purge_runs(self, ended_before_ms: int, *, statuses: Iterable[str] = RUN_TERMINAL,
                   limit: int = 500) -> list[str]:
        chosen = _retention.check_purge(ended_before_ms, statuses, limit)
        with self._lock:
            found = [d for d in self._runs.values()
                     if d[R.STATUS] in chosen and d[R.UPDATED] < ended_before_ms]
            # A child its parent has not heard yet is kept (``_retention.parked_steps``).
            parked = _retention.parked_steps(found)
            unheard = {child for step_id, child in parked.items()
                       if (step := self._steps.get(step_id)) is not None
                       and step[S.STATUS] == STEP_RUNNING and step.get(S.CHILD_RUN) == child}
            ids = [d[R.ID] for d in found if d[R.ID] not in unheard][:limit]
            doomed = set(ids)  # a step's history is in its document: it goes with it
            for key in [k for k, d in self._steps.items() if d[S.RUN] in doomed]:
                del self._steps[key]
            for key in [k for k, d in self._events.items() if d[E.RUN] in doomed]:
                del self._events[key]
            for run_id in ids:
                del self._runs[run_id]
        return ids
