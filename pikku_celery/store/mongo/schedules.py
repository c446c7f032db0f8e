"""Schedules (``store._schedules``): one document per schedule, found by its ``_id`` (the
schedule's name) only, so the collection needs no index of its own; every write is one
``update_one`` whose filter repeats what its decision read."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pymongo.errors import DuplicateKeyError

from pikku_celery.model.keys import ScheduleField as F
from pikku_celery.model.records import WorkflowSchedule
from pikku_celery.model.validate import check_name
from pikku_celery.store import _schedules
from pikku_celery.store._schedules import FIRING, MAX_LISTED, NewSchedule
from pikku_celery.store.mongo.base import MongoStoreBase
from pikku_celery.store.mongo.errors import storable

_SAVE_ROUNDS = 5  # a save that keeps losing races to other writers gives up after these


class MongoSchedules(MongoStoreBase):
    def save_schedule(self, schedule: NewSchedule, next_ms: int, now_ms: int
                      ) -> tuple[WorkflowSchedule, bool]:
        _schedules.check_new(schedule, next_ms, now_ms)
        for _ in range(_SAVE_ROUNDS):
            doc = self._schedules.find_one({F.ID: schedule.name}, session=self._session)
            if doc is None:
                new = _schedules.new_doc(schedule, next_ms, now_ms)
                try:
                    with storable(f"data of schedule {schedule.name!r}"):
                        self._schedules.insert_one(new, session=self._session)
                except DuplicateKeyError:
                    continue  # another worker inserted it first: compare with theirs
                return _schedules.schedule_from_doc(new), True
            if not _schedules.differs(schedule, doc):
                return _schedules.schedule_from_doc(doc), False
            changes: dict[str, Any] = {**_schedules.definition_fields(schedule),
                                       F.UPDATED: now_ms}
            if not schedule.same_timing(doc):
                changes[F.NEXT] = next_ms  # new timing: its ticks, from now on
            # Guarded on the timing read: the first writer of a new timing sets its tick.
            with storable(f"data of schedule {schedule.name!r}"):
                wrote = self._schedules.update_one(
                    {F.ID: schedule.name, **_schedules.timing_filter(doc)}, {"$set": changes},
                    session=self._session)
            if wrote.matched_count == 1:
                return _schedules.schedule_from_doc({**doc, **changes}), True
        raise RuntimeError(f"schedule {schedule.name!r}: could not save it after "
                           f"{_SAVE_ROUNDS} rounds of concurrent changes")

    def get_schedule(self, name: str) -> WorkflowSchedule | None:
        check_name("schedule name", name)
        doc = self._schedules.find_one({F.ID: name}, session=self._session)
        return None if doc is None else _schedules.schedule_from_doc(doc)

    def list_schedules(self, names: Collection[str] | None = None,
                       limit: int = MAX_LISTED) -> list[WorkflowSchedule]:
        wanted = _schedules.check_names(names, limit)
        # ``_id``: a point read per name, or the whole collection in name order.
        query = {} if wanted is None else {F.ID: {"$in": wanted}}
        found = self._schedules.find(query, session=self._session).sort(F.ID, 1).limit(limit)
        return [_schedules.schedule_from_doc(d) for d in found]

    def advance_schedule(self, name: str, from_ms: int, to_ms: int, now_ms: int, *,
                         fired_ms: int | None = None) -> bool:
        check_name("schedule name", name)
        update: dict[str, Any] = {"$set": {F.NEXT: to_ms, F.UPDATED: now_ms}}
        if fired_ms is not None:
            update["$set"][FIRING] = fired_ms
            update["$max"] = {F.LAST: fired_ms}
        # ``FIRING: None`` matches a document written before the field existed too.
        wrote = self._schedules.update_one(
            {F.ID: name, F.NEXT: from_ms, F.PAUSED: False, FIRING: None}, update,
            session=self._session)
        return wrote.matched_count == 1

    def schedules_firing(self, names: Collection[str]
                         ) -> list[tuple[WorkflowSchedule, int | None]]:
        wanted = _schedules.check_names(names, MAX_LISTED) or []
        found = self._schedules.find({F.ID: {"$in": wanted}},
                                     session=self._session).sort(F.ID, 1)
        return [(_schedules.schedule_from_doc(d), d.get(FIRING)) for d in found]

    def started_tick(self, name: str, tick_ms: int, now_ms: int) -> bool:
        check_name("schedule name", name)
        wrote = self._schedules.update_one(
            {F.ID: name, FIRING: tick_ms}, {"$set": {FIRING: None, F.UPDATED: now_ms}},
            session=self._session)
        return wrote.matched_count == 1

    def pause_schedule(self, name: str, now_ms: int) -> bool:
        check_name("schedule name", name)
        wrote = self._schedules.update_one(
            {F.ID: name, F.PAUSED: False}, {"$set": {F.PAUSED: True, F.UPDATED: now_ms}},
            session=self._session)
        return wrote.matched_count == 1

    def resume_schedule(self, name: str, next_ms: int, now_ms: int) -> bool:
        check_name("schedule name", name)
        wrote = self._schedules.update_one(
            {F.ID: name, F.PAUSED: True},
            {"$set": {F.PAUSED: False, F.NEXT: next_ms, F.UPDATED: now_ms}},
            session=self._session)
        return wrote.matched_count == 1
