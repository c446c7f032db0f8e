"""Events sent to runs, on the documents held here, with the MongoDB store's decisions
(``store._events``)."""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

from pikku_celery.model.errors import WorkflowEventError, WorkflowRunNotFoundError
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_LIVE, WorkflowEvent
from pikku_celery.model.validate import as_stored
from pikku_celery.store import _events
from pikku_celery.store.memory.base import MemoryStoreBase


class MemoryEvents(MemoryStoreBase):
    def send_event(self, run_id: str, name: str, payload: Any, now_ms: int, *,
                   key: str | None = None, wake_check_ms: int | None = None,
                   send_id: str | None = None, max_events: int | None = None,
                   max_bytes: int | None = None) -> tuple[WorkflowEvent, bool]:
        # Under the lock, the run's counter and the event's document are one write: the
        # reference for the MongoDB store's three (``store.mongo.events``).
        size = _events.check_send(run_id, name, payload, key, send_id, max_bytes)
        send_id = send_id or _events.new_send_id()
        with self._lock:
            sent = self._events.get(_events.event_doc_id(run_id, key, send_id))
            if sent is not None:  # this call's earlier try, or its key's first send
                return (_events.event_from_doc(copy.deepcopy(sent)),
                        _events.created_by(sent, send_id))
            run = self._runs.get(run_id)
            if run is None:
                raise WorkflowRunNotFoundError(run_id)
            if run[R.STATUS] not in RUN_LIVE:
                raise WorkflowEventError(run_id, name, f"the run has ended ({run[R.STATUS]})")
            kept = run.get(R.EVENTS_SENT) or 0
            _events.check_count(run_id, name, kept, max_events)
            run[R.EVENTS_SENT] = seq = kept + 1
            doc = _events.new_event_doc(run_id, name, as_stored(payload), key, send_id,
                                        now_ms, wake_check_ms, seq, size=size)
            self._events[doc[E.ID]] = doc
            return _events.event_from_doc(copy.deepcopy(doc)), True

    def next_event(self, run_id: str, name: str, taken: Collection[int] = ()
                   ) -> WorkflowEvent | None:
        seqs = set(_events.check_next(run_id, name, taken))
        with self._lock:
            found = [d for d in self._events.values() if d[E.RUN] == run_id
                     and d[E.NAME] == name and d[E.SEQ] not in seqs]
            if not found:
                return None
            return _events.event_from_doc(copy.deepcopy(min(found, key=lambda d: d[E.SEQ])))

    def list_events(self, run_id: str, limit: int = 1000, *, after: int = 0,
                    payloads: bool = True) -> list[WorkflowEvent]:
        _events.check_page(run_id, limit, after)
        with self._lock:
            found = sorted((d for d in self._events.values()
                            if d[E.RUN] == run_id and d[E.SEQ] > after),
                           key=lambda d: d[E.SEQ])[:limit]
            return [_events.event_from_doc(copy.deepcopy(
                d if payloads else {k: v for k, v in d.items() if k != E.PAYLOAD}))
                for d in found]

    def find_event_wakes(self, now_ms: int, limit: int) -> list[WorkflowEvent]:
        with self._lock:
            found = sorted((d for d in self._events.values()
                            if d[E.WAKE] is not None and d[E.WAKE] <= now_ms),
                           key=lambda d: (d[E.WAKE], d[E.ID]))[:limit]
            return [_events.event_from_doc(copy.deepcopy(d)) for d in found]

    def clear_event_wake(self, event_id: str) -> bool:
        with self._lock:
            doc = self._events.get(event_id)
            if doc is None or doc[E.WAKE] is None:
                return False
            doc[E.WAKE] = None
            return True
