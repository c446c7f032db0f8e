"""Events sent to runs: the send, the next event a wait may take, a run's events, and the
wake checks of sends whose sender stopped (``store._events``).

A send is three writes, and the event is kept by the second alone:

1. the event's document is inserted without a place (``seq`` null): no reader sees it;
2. one guarded write on the run, while it is live and its counter and pending event are
   the ones read, raises the counter and names the event given that ``seq``
   (``event_pending``): from here on the event is in the run's order;
3. the event's document is given its ``seq``.

Whoever reads the run between 2 and 3 counts the pending event at the counter's ``seq``
(``_with_pending``), and the next send gives it its ``seq`` before it raises the counter,
so every ``seq`` below the counter is on its document. Hence a reader never sees seq 2
without seq 1, and an event is either refused or kept while its run is live: nothing
appears in a run after its end (issue 31, (a) and (b)). Each write is idempotent for the
call's ``send_id``, so a send retried through an election keeps one event.

The write of 2 is also where a run's limit on its events holds (``max_events``): the
counter it is guarded on is the number of events the run has kept, checked below the
limit before the write, so of concurrent sends at the limit one write lands and the
others read the counter again and are refused (``_events.check_count``). A refusal comes
before the send's document is inserted, unless the send lost the counter to another send
first: its document is then left without a place, as when the run ends under it (listed
by no reader; deleted with its run).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pymongo.errors import DuplicateKeyError

from pikku_celery.model.errors import WorkflowEventError, WorkflowRunNotFoundError
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_LIVE, WorkflowEvent
from pikku_celery.store import _events
from pikku_celery.store.mongo.base import MongoStoreBase

Doc = dict[str, Any]
_COUNTER = {R.STATUS: 1, R.EVENTS_SENT: 1, R.EVENT_PENDING: 1}


class _Progress:
    """What a send knows of its event, for the error that may interrupt it
    (``_events.mark_unsent``)."""

    kept: bool | None = None


class MongoEvents(MongoStoreBase):
    def send_event(self, run_id: str, name: str, payload: Any, now_ms: int, *,
                   key: str | None = None, wake_check_ms: int | None = None,
                   send_id: str | None = None, max_events: int | None = None,
                   max_bytes: int | None = None) -> tuple[WorkflowEvent, bool]:
        size = _events.check_send(run_id, name, payload, key, send_id, max_bytes)
        if not self._indexes_ready:  # a database an earlier version made: no events index
            self.create_indexes()
        send_id = send_id or _events.new_send_id()
        doc = _events.new_event_doc(run_id, name, payload, key, send_id, now_ms,
                                    wake_check_ms, size=size)
        progress = _Progress()
        try:
            stored, seq = self._send(doc, progress, max_events)
        except Exception as exc:
            if _events.transient(exc):
                _events.mark_unsent(exc, progress.kept)
            raise
        return _events.event_from_doc(stored, seq), _events.created_by(stored, send_id)

    def _send(self, doc: Doc, progress: _Progress, max_events: int | None
              ) -> tuple[Doc, int]:
        run_id, event_id = doc[E.RUN], doc[E.ID]
        while True:
            # The run, then the event: a send that gave the event its place before this
            # read named it pending, or wrote its seq before it moved the counter on.
            run = self._runs.find_one({R.ID: run_id}, projection=_COUNTER,
                                      session=self._session)
            if run is None:
                raise WorkflowRunNotFoundError(run_id)
            sent: int | None = run.get(R.EVENTS_SENT)
            pending: str | None = run.get(R.EVENT_PENDING)
            counter = sent or 0
            stored = self._events.find_one({E.ID: event_id}, session=self._session)
            if stored is not None and pending == event_id:
                self._place(event_id, counter)
                return stored, counter
            if stored is not None and stored.get(E.SEQ) is not None:
                return stored, stored[E.SEQ]  # kept before: this call's, or its key's
            progress.kept = False
            if run[R.STATUS] not in RUN_LIVE:
                raise WorkflowEventError(run_id, doc[E.NAME],
                                         f"the run has ended ({run[R.STATUS]})")
            # The write below is guarded on this count: it lands only while the run has
            # kept ``counter`` events, below its limit.
            _events.check_count(run_id, doc[E.NAME], counter, max_events)
            if stored is None:
                stored = self._insert(doc)
            if pending is not None:
                self._place(pending, counter)  # its sender may have stopped before it did
            seq = counter + 1
            try:
                moved = self._runs.update_one(
                    {R.ID: run_id, R.STATUS: {"$in": list(RUN_LIVE)}, R.EVENTS_SENT: sent,
                     R.EVENT_PENDING: pending},
                    {"$set": {R.EVENTS_SENT: seq, R.EVENT_PENDING: event_id}},
                    session=self._session).matched_count == 1
            except Exception as exc:
                progress.kept = not _events.never_sent(exc)
                raise
            if moved:
                progress.kept = True
                self._place(event_id, seq)
                return stored, seq
            # Another send took the place first, or the run ended: read both again.

    def _insert(self, doc: Doc) -> Doc:
        """Insert the event's document, placeless; the stored one if it is there already
        (this call's earlier try, or its key's other send, whose event stands)."""
        try:
            self._events.insert_one(doc, session=self._session)
        except DuplicateKeyError:
            stored = self._events.find_one({E.ID: doc[E.ID]}, session=self._session)
            if stored is None:  # pragma: no cover - events are deleted only with their run
                raise
            return stored
        return doc

    def _place(self, event_id: str, seq: int) -> None:
        """Write ``seq`` on the event the run's counter gave it (once: a later write of the
        same seq finds it written)."""
        self._events.update_one({E.ID: event_id, E.SEQ: None}, {"$set": {E.SEQ: seq}},
                                session=self._session)

    def _pending(self, run_id: str, projection: Doc | None = None
                 ) -> tuple[Doc | None, bool]:
        """The run's pending event, at its seq, if its document does not carry it yet
        (with the fields ``projection`` keeps); and whether the run exists."""
        run = self._runs.find_one({R.ID: run_id}, projection=_COUNTER,
                                  session=self._session)
        if run is None or run.get(R.EVENT_PENDING) is None:
            return None, run is not None
        # Read after the run: placed since, it is found by the caller's query of placed
        # events, which comes after this read.
        stored = self._events.find_one({E.ID: run[R.EVENT_PENDING], E.SEQ: None},
                                       projection=projection, session=self._session)
        if stored is not None:
            stored[E.SEQ] = run[R.EVENTS_SENT]
        return stored, True

    def next_event(self, run_id: str, name: str, taken: Collection[int] = ()
                   ) -> WorkflowEvent | None:
        seqs = _events.check_next(run_id, name, taken)
        pending, _ = self._pending(run_id)
        # (run_id, name, seq): the run's placed events of that name in order, the taken
        # skipped.
        found = list(self._events.find(
            {E.RUN: run_id, E.NAME: name, E.SEQ: {"$nin": [None, *seqs]}},
            session=self._session).sort(E.SEQ, 1).limit(1))
        if pending is not None and pending[E.NAME] == name and pending[E.SEQ] not in seqs:
            found.append(pending)
        if not found:
            return None
        return _events.event_from_doc(min(found, key=lambda d: d[E.SEQ]))

    def list_events(self, run_id: str, limit: int = 1000, *, after: int = 0,
                    payloads: bool = True) -> list[WorkflowEvent]:
        _events.check_page(run_id, limit, after)
        projection = None if payloads else _events.WITHOUT_PAYLOAD
        pending, _ = self._pending(run_id, projection)
        # (run_id, seq): the run's placed events after ``after`` in the order they were
        # sent (a null seq is no number: never $gt).
        found = list(self._events.find({E.RUN: run_id, E.SEQ: {"$gt": after}},
                                       projection=projection,
                                       session=self._session).sort(E.SEQ, 1).limit(limit))
        if (pending is not None and pending[E.SEQ] > after
                and all(d[E.ID] != pending[E.ID] for d in found)):
            found.append(pending)
        found.sort(key=lambda d: d[E.SEQ])
        return [_events.event_from_doc(d) for d in found[:limit]]

    def find_event_wakes(self, now_ms: int, limit: int) -> list[WorkflowEvent]:
        # (wake_ms, _id): the sends whose wake check is due, oldest first; a document a
        # send never placed too (its seq 0): its sender stopped, and one wake costs a pass.
        found = self._events.find({E.WAKE: {"$ne": None, "$lte": now_ms}},
                                  session=self._session).sort(
            [(E.WAKE, 1), (E.ID, 1)]).limit(limit)
        return [_events.event_from_doc(d) for d in found]

    def clear_event_wake(self, event_id: str) -> bool:
        found = self._events.update_one({E.ID: event_id, E.WAKE: {"$ne": None}},
                                        {"$set": {E.WAKE: None}}, session=self._session)
        return found.matched_count == 1
