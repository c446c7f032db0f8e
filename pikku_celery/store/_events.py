"""What both stores share about events (``pikku.send_event``): the checks of a send, the
document an event is kept as, and its read model.

An event is one document of ``workflow_events``, written once and never changed but for its
wake check. Its ``seq`` comes from the run's own counter (``events_sent``), raised by the
same guarded write that checks the run is live, so a run's events have one order, the
order their sends reached the run, and no event is accepted by a run that has ended. A
``key`` makes the send idempotent: the event's ``_id`` is derived from it, so a retried
send lands on the document the first one wrote (``keys.keyed_event_id``). Which event a
``wf.wait_for_event`` takes is not stored here: the waiting step's result names the
event's ``seq`` (``replay``), so consuming an event is the one guarded write that settles
the step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pikku_celery import keys
from pikku_celery.errors import InvalidInputError
from pikku_celery.keys import EventField as E
from pikku_celery.records import WorkflowEvent
from pikku_celery.store._docs import to_datetime
from pikku_celery.validate import check_event_name, check_name, check_value

Doc = dict[str, Any]
MAX_EXCLUDED = 10_000  # events one run's waits of one name may have taken


def check_send(run_id: str, name: str, payload: Any, key: str | None) -> None:
    check_name("run id", run_id)
    check_event_name("event name", name)
    if key is not None:
        check_name("event key", key)
    check_value(f"payload of event {name!r}", payload)


def check_next(run_id: str, name: str, taken: Collection[int]) -> list[int]:
    check_name("run id", run_id)
    check_name("event name", name)
    seqs = sorted(set(taken))
    if len(seqs) > MAX_EXCLUDED or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seqs):
        raise InvalidInputError(f"taken must be at most {MAX_EXCLUDED} ints, got "
                                f"{len(seqs)} values")
    return seqs


def new_event_doc(run_id: str, name: str, payload: Any, key: str | None, seq: int,
                  now_ms: int, wake_check_ms: int | None) -> Doc:
    return {E.ID: keys.event_id(run_id, seq) if key is None else keys.keyed_event_id(run_id, key),
            E.RUN: run_id, E.NAME: name, E.SEQ: seq, E.PAYLOAD: payload, E.KEY: key,
            E.SENT: now_ms, E.WAKE: wake_check_ms}


def event_from_doc(doc: Doc) -> WorkflowEvent:
    sent = to_datetime(doc[E.SENT])
    assert sent is not None
    return WorkflowEvent(run_id=doc[E.RUN], name=doc[E.NAME], seq=doc[E.SEQ],
                         payload=doc.get(E.PAYLOAD), sent_at=sent, key=doc.get(E.KEY),
                         event_id=doc[E.ID])
