"""Concurrency slots on MongoDB (``store._slots``): take one for a run (one guarded
upsert), give it back, read a group's holders, and the runs queued for a group."""

from __future__ import annotations

from typing import Any

from pymongo.errors import DuplicateKeyError

from pikku_celery.model.clock import epoch_ms
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_QUEUED, WorkflowRun
from pikku_celery.store import _docs
from pikku_celery.store._slots import SlotField as F
from pikku_celery.store._slots import check_slot, group_of
from pikku_celery.store.mongo.base import MongoStoreBase


class MongoSlots(MongoStoreBase):
    def take_slot(self, slot: str, run_id: str, limit: int, *, workflow: str = "",
                  key: str | None = None) -> bool:
        check_slot(slot, run_id, limit)
        # Adds the run while the group has fewer than ``limit`` holders and not the run:
        # matched, the upsert adds it; unmatched, it tries to insert the group again and
        # MongoDB refuses the duplicate _id (full, or the run holds one already).
        try:
            self._slots.update_one(
                {F.ID: slot, F.HOLDERS: {"$ne": run_id}, F.HELD: {"$lt": limit}},
                {"$push": {F.HOLDERS: run_id}, "$inc": {F.HELD: 1}, "$set": {F.LIMIT: limit},
                 "$setOnInsert": {F.WORKFLOW: workflow, F.KEY: key}},
                upsert=True, session=self._session)
            return True
        except DuplicateKeyError:
            return run_id in self.slot_holders(slot)

    def give_slot(self, slot: str, run_id: str) -> bool:
        check_slot(slot, run_id)
        found = self._slots.update_one({F.ID: slot, F.HOLDERS: run_id},
                                       {"$pull": {F.HOLDERS: run_id}, "$inc": {F.HELD: -1}},
                                       session=self._session)
        return found.modified_count == 1

    def slot_holders(self, slot: str) -> list[str]:
        check_slot(slot)
        doc = self._slots.find_one({F.ID: slot}, projection={F.HOLDERS: 1},
                                   session=self._session)
        return list(doc.get(F.HOLDERS) or []) if doc else []

    def list_slots(self, limit: int = 1000) -> list[dict[str, Any]]:
        # (held, _id): the groups that have holders.
        found = self._slots.find({F.HELD: {"$gt": 0}}, session=self._session).sort(
            [(F.HELD, 1), (F.ID, 1)]).limit(limit)
        return [{"slot": d[F.ID], "workflow": d.get(F.WORKFLOW), "key": d.get(F.KEY),
                 "holders": list(d.get(F.HOLDERS) or [])} for d in found]

    def slot_group(self, slot: str) -> dict[str, Any] | None:
        check_slot(slot)
        doc = self._slots.find_one({F.ID: slot}, session=self._session)
        return None if doc is None else group_of(doc)

    def queued_ahead(self, slot: str, run: WorkflowRun) -> int:
        check_slot(slot)
        created = epoch_ms(run.created_at)
        # (slot, status, created_ms, run_id): the queue's index, counted up to the run.
        return self._runs.count_documents(
            {R.SLOT: slot, R.STATUS: RUN_QUEUED,
             "$or": [{R.CREATED: {"$lt": created}},
                     {R.CREATED: created, R.RUN: {"$lt": run.run_id}}]},
            session=self._session)

    def next_queued(self, slot: str) -> WorkflowRun | None:
        check_slot(slot)
        # (slot, status, created_ms, run_id): the group's queued runs, oldest first.
        found = list(self._runs.find({R.SLOT: slot, R.STATUS: RUN_QUEUED},
                                     session=self._session).sort(
            [(R.CREATED, 1), (R.RUN, 1)]).limit(1))
        return _docs.run_from_doc(found[0]) if found else None

    def queued_slots(self, limit: int = 1000) -> list[str]:
        # (status, updated_ms): the queued runs, by the status's index.
        found = self._runs.find({R.STATUS: RUN_QUEUED}, projection={R.SLOT: 1},
                                session=self._session).limit(limit)
        return sorted({d[R.SLOT] for d in found if d.get(R.SLOT)})
