"""Concurrency slots on the documents held here, with the MongoDB store's decisions
(``store._slots``)."""

from __future__ import annotations

import copy
from typing import Any

from pikku_celery.keys import RunField as R
from pikku_celery.records import WorkflowRun
from pikku_celery.store import _docs
from pikku_celery.store._slots import RUN_SLOT, check_slot
from pikku_celery.store._slots import SlotField as F
from pikku_celery.store.memory.base import MemoryStoreBase

RUN_QUEUED = "queued"


class MemorySlots(MemoryStoreBase):
    @property
    def _slots(self) -> dict[str, dict[str, Any]]:
        """The slot groups, made at first use."""
        found: dict[str, dict[str, Any]] | None = self.__dict__.get("_slot_groups")
        if found is None:
            found = self.__dict__["_slot_groups"] = {}
        return found

    def take_slot(self, slot: str, run_id: str, limit: int, *, workflow: str = "",
                  key: str | None = None) -> bool:
        check_slot(slot, run_id, limit)
        with self._lock:
            doc = self._slots.setdefault(slot, {F.ID: slot, F.WORKFLOW: workflow, F.KEY: key,
                                                F.HOLDERS: []})
            holders: list[str] = doc[F.HOLDERS]
            if run_id in holders:
                return True
            if len(holders) >= limit:
                return False
            holders.append(run_id)
            return True

    def give_slot(self, slot: str, run_id: str) -> bool:
        check_slot(slot, run_id)
        with self._lock:
            doc = self._slots.get(slot)
            if doc is None or run_id not in doc[F.HOLDERS]:
                return False
            doc[F.HOLDERS].remove(run_id)
            return True

    def slot_holders(self, slot: str) -> list[str]:
        with self._lock:
            doc = self._slots.get(slot)
            return list(doc[F.HOLDERS]) if doc else []

    def list_slots(self, limit: int = 1000) -> list[dict[str, Any]]:
        with self._lock:
            return [{"slot": d[F.ID], "workflow": d[F.WORKFLOW], "key": d[F.KEY],
                     "holders": list(d[F.HOLDERS])}
                    for d in list(self._slots.values())[:limit] if d[F.HOLDERS]]

    def next_queued(self, slot: str) -> WorkflowRun | None:
        with self._lock:
            queued = [d for d in self._runs.values()
                      if d.get(RUN_SLOT) == slot and d[R.STATUS] == RUN_QUEUED]
            if not queued:
                return None
            oldest = min(queued, key=lambda d: (d[R.CREATED], d[R.RUN]))
            return _docs.run_from_doc(copy.deepcopy(oldest))

    def queued_slots(self, limit: int = 1000) -> list[str]:
        with self._lock:
            return sorted({d[RUN_SLOT] for d in self._runs.values()
                           if d[R.STATUS] == RUN_QUEUED and d.get(RUN_SLOT)})[:limit]
