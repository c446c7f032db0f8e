"""Schedules on the documents held here, with the MongoDB store's guards
(``store._schedules``)."""

from __future__ import annotations

import copy
from collections.abc import Collection

from pikku_celery.model.keys import ScheduleField as F
from pikku_celery.model.records import WorkflowSchedule
from pikku_celery.model.validate import as_stored, check_name
from pikku_celery.store import _schedules
from pikku_celery.store._schedules import FIRING, MAX_LISTED, NewSchedule
from pikku_celery.store.memory.base import MemoryStoreBase


class MemorySchedules(MemoryStoreBase):
    def save_schedule(self, schedule: NewSchedule, next_ms: int, now_ms: int
                      ) -> tuple[WorkflowSchedule, bool]:
        _schedules.check_new(schedule, next_ms, now_ms)
        schedule = NewSchedule(**{**vars(schedule), "data": as_stored(schedule.data)})
        with self._lock:
            doc = self._schedules.get(schedule.name)
            if doc is None:
                doc = self._schedules[schedule.name] = _schedules.new_doc(
                    schedule, next_ms, now_ms)
                return _schedules.schedule_from_doc(copy.deepcopy(doc)), True
            if not _schedules.differs(schedule, doc):
                return _schedules.schedule_from_doc(copy.deepcopy(doc)), False
            if not schedule.same_timing(doc):
                doc[F.NEXT] = next_ms
            doc.update(_schedules.definition_fields(schedule))
            doc[F.UPDATED] = now_ms
            return _schedules.schedule_from_doc(copy.deepcopy(doc)), True

    def get_schedule(self, name: str) -> WorkflowSchedule | None:
        check_name("schedule name", name)
        with self._lock:
            doc = self._schedules.get(name)
            return None if doc is None else _schedules.schedule_from_doc(copy.deepcopy(doc))

    def list_schedules(self, names: Collection[str] | None = None,
                       limit: int = MAX_LISTED) -> list[WorkflowSchedule]:
        wanted = _schedules.check_names(names, limit)
        with self._lock:
            found = sorted(name for name in self._schedules
                           if wanted is None or name in wanted)[:limit]
            return [_schedules.schedule_from_doc(copy.deepcopy(self._schedules[n]))
                    for n in found]

    def advance_schedule(self, name: str, from_ms: int, to_ms: int, now_ms: int, *,
                         fired_ms: int | None = None) -> bool:
        check_name("schedule name", name)
        with self._lock:
            doc = self._schedules.get(name)
            if (doc is None or doc[F.NEXT] != from_ms or doc[F.PAUSED]
                    or doc.get(FIRING) is not None):
                return False
            doc[F.NEXT], doc[F.UPDATED] = to_ms, now_ms
            if fired_ms is not None:
                doc[FIRING] = fired_ms
                if doc[F.LAST] is None or fired_ms > doc[F.LAST]:
                    doc[F.LAST] = fired_ms
            return True

    def schedules_firing(self, names: Collection[str]
                         ) -> list[tuple[WorkflowSchedule, int | None]]:
        wanted = _schedules.check_names(names, MAX_LISTED) or []
        with self._lock:
            docs = [copy.deepcopy(self._schedules[n]) for n in wanted if n in self._schedules]
        return [(_schedules.schedule_from_doc(d), d.get(FIRING)) for d in docs]

    def started_tick(self, name: str, tick_ms: int, now_ms: int) -> bool:
        check_name("schedule name", name)
        with self._lock:
            doc = self._schedules.get(name)
            if doc is None or doc.get(FIRING) != tick_ms:
                return False
            doc[FIRING], doc[F.UPDATED] = None, now_ms
            return True

    def pause_schedule(self, name: str, now_ms: int) -> bool:
        return self._set_paused(name, True, now_ms)

    def resume_schedule(self, name: str, next_ms: int, now_ms: int) -> bool:
        return self._set_paused(name, False, now_ms, next_ms)

    def _set_paused(self, name: str, paused: bool, now_ms: int,
                    next_ms: int | None = None) -> bool:
        check_name("schedule name", name)
        with self._lock:
            doc = self._schedules.get(name)
            if doc is None or doc[F.PAUSED] == paused:
                return False
            doc[F.PAUSED], doc[F.UPDATED] = paused, now_ms
            if next_ms is not None:
                doc[F.NEXT] = next_ms
            return True
