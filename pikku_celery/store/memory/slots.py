"""Concurrency slots on the documents held here, with the MongoDB store's decisions
(``store._slots``)."""

from __future__ import annotations

import copy
from typing import Any

from pikku_celery.model.clock import epoch_ms
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_QUEUED, WorkflowRun
from pikku_celery.store import _docs
from pikku_celery.store._slots import SlotField as F
from pikku_celery.store._slots import check_slot, group_of
from pikku_celery.store.memory.base import MemoryStoreBase


class MemorySlots(MemoryStoreBase):
    def take_slot(self, slot: str, run_id: str, limit: int, *, workflow: str = "",
                  key: str | None = None) -> bool:
        check_slot(slot, run_id, limit)
        with self._lock:
            doc = self._slots.setdefault(slot, {F.ID: slot, F.WORKFLOW: workflow, F.KEY: key,
                                                F.HOLDERS: [], F.HELD: 0})
            holders: list[str] = doc[F.HOLDERS]
            if run_id in holders:
                return True
            if doc[F.HELD] >= limit:
                return False
            holders.append(run_id)
            doc[F.HELD] += 1
            doc[F.LIMIT] = limit
            return True

    def give_slot(self, slot: str, run_id: str) -> bool:
        check_slot(slot, run_id)
        with self._lock:
            doc = self._slots.get(slot)
            if doc is None or run_id not in doc[F.HOLDERS]:
                return False
            doc[F.HOLDERS].remove(run_id)
            doc[F.HELD] -= 1
            return True

    def slot_holders(self, slot: str) -> list[str]:
        check_slot(slot)
        with self._lock:
            doc = self._slots.get(slot)
            return list(doc[F.HOLDERS]) if doc else []

    def list_slots(self, limit: int = 1000) -> list[dict[str, Any]]:
        with self._lock:
            held = sorted((d for d in self._slots.values() if d[F.HELD] > 0),
                          key=lambda d: (d[F.HELD], d[F.ID]))[:limit]
            return [{"slot": d[F.ID], "workflow": d[F.WORKFLOW], "key": d[F.KEY],
                     "holders": list(d[F.HOLDERS])} for d in held]

    def slot_group(self, slot: str) -> dict[str, Any] | None:
        check_slot(slot)
        with self._lock:
            doc = self._slots.get(slot)
            return None if doc is None else group_of(copy.deepcopy(doc))

    def queued_ahead(self, slot: str, run: WorkflowRun) -> int:
        check_slot(slot)
        place = (epoch_ms(run.created_at), run.run_id)
        with self._lock:
            return sum(1 for d in self._runs.values()
                       if d.get(R.SLOT) == slot and d[R.STATUS] == RUN_QUEUED
                       and (d[R.CREATED], d[R.RUN]) < place)

    def next_queued(self, slot: str) -> WorkflowRun | None:
        check_slot(slot)
        with self._lock:
            queued = [d for d in self._runs.values()
                      if d.get(R.SLOT) == slot and d[R.STATUS] == RUN_QUEUED]
            if not queued:
                return None
            oldest = min(queued, key=lambda d: (d[R.CREATED], d[R.RUN]))
            return _docs.run_from_doc(copy.deepcopy(oldest))

    def queued_slots(self, limit: int = 1000) -> list[str]:
        with self._lock:
            return sorted({d[R.SLOT] for d in self._runs.values()
                           if d[R.STATUS] == RUN_QUEUED and d.get(R.SLOT)})[:limit]
