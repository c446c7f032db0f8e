"""Events sent to runs: the send (the run's counter, then the event's insert), the next
event a wait may take, a run's events, and the wake checks of sends whose sender stopped
(``store._events``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from pikku_celery import keys
from pikku_celery.errors import WorkflowEventError, WorkflowRunNotFoundError
from pikku_celery.keys import EventField as E
from pikku_celery.keys import RunField as R
from pikku_celery.records import RUN_LIVE, WorkflowEvent
from pikku_celery.store import _events
from pikku_celery.store.mongo.base import MongoStoreBase
from pikku_celery.validate import check_name


class MongoEvents(MongoStoreBase):
    def send_event(self, run_id: str, name: str, payload: Any, now_ms: int, *,
                   key: str | None = None, wake_check_ms: int | None = None
                   ) -> tuple[WorkflowEvent, bool]:
        _events.check_send(run_id, name, payload, key)
        if not self._indexes_ready:  # a database an earlier version made: no events index
            self.create_indexes()
        if key is not None:
            sent = self._events.find_one({E.ID: keys.keyed_event_id(run_id, key)},
                                         session=self._session)
            if sent is not None:
                return _events.event_from_doc(sent), False
        # The run's counter, raised only while the run is live: the event's place in the
        # run's order, and the check that the run takes events, in one write.
        run = self._runs.find_one_and_update(
            {R.ID: run_id, R.STATUS: {"$in": list(RUN_LIVE)}}, {"$inc": {R.EVENTS_SENT: 1}},
            projection={R.EVENTS_SENT: 1}, return_document=ReturnDocument.AFTER,
            session=self._session)
        if run is None:
            raise self._refused(run_id, name)
        doc = _events.new_event_doc(run_id, name, payload, key, run[R.EVENTS_SENT], now_ms,
                                    wake_check_ms)
        try:
            self._events.insert_one(doc, session=self._session)
        except DuplicateKeyError:  # the same key, sent at the same time: the first stands
            first = self._events.find_one({E.ID: doc[E.ID]}, session=self._session)
            if first is None:  # pragma: no cover - events are deleted only with their run
                raise
            return _events.event_from_doc(first), False
        return _events.event_from_doc(doc), True

    def _refused(self, run_id: str, name: str) -> Exception:
        """Why a send found no live run: an unknown run, or one that has ended."""
        found = self._runs.find_one({R.ID: run_id}, projection={R.STATUS: 1},
                                    session=self._session)
        if found is None:
            return WorkflowRunNotFoundError(run_id)
        return WorkflowEventError(run_id, name, f"the run has ended ({found[R.STATUS]})")

    def next_event(self, run_id: str, name: str, taken: Collection[int] = ()
                   ) -> WorkflowEvent | None:
        seqs = _events.check_next(run_id, name, taken)
        # (run_id, name, seq): the run's events of that name in order, the taken skipped.
        query: dict[str, Any] = {E.RUN: run_id, E.NAME: name}
        if seqs:
            query[E.SEQ] = {"$nin": seqs}
        found = self._events.find(query, session=self._session).sort(E.SEQ, 1).limit(1)
        docs = list(found)
        return _events.event_from_doc(docs[0]) if docs else None

    def list_events(self, run_id: str, limit: int = 1000) -> list[WorkflowEvent]:
        check_name("run id", run_id)
        # (run_id, seq): the run's events in the order they were sent.
        found = self._events.find({E.RUN: run_id}, session=self._session
                                  ).sort(E.SEQ, 1).limit(limit)
        return [_events.event_from_doc(d) for d in found]

    def find_event_wakes(self, now_ms: int, limit: int) -> list[WorkflowEvent]:
        # (wake_ms, _id): the sends whose wake check is due, oldest first.
        found = self._events.find({E.WAKE: {"$ne": None, "$lte": now_ms}},
                                  session=self._session).sort(
            [(E.WAKE, 1), (E.ID, 1)]).limit(limit)
        return [_events.event_from_doc(d) for d in found]

    def clear_event_wake(self, event_id: str) -> bool:
        found = self._events.update_one({E.ID: event_id, E.WAKE: {"$ne": None}},
                                        {"$set": {E.WAKE: None}}, session=self._session)
        return found.matched_count == 1
