"""What both stores share about events (``pikku.send_event``): the checks of a send, the
document an event is kept as, its read model, and which store errors a send retries.

An event is one document of ``workflow_events``, written once and then only given its
place (``seq``) and its wake check's end. Its ``seq`` comes from the run's own counter
(``events_sent``), raised by the same guarded write that checks the run is live and names
the event (``event_pending``): that one write is the moment the event is kept, so a run's
events have one order, the order their sends reached the run, no event is accepted by a
run that has ended, and every reader sees an event from that write on, even before its
document carries its ``seq`` (issue 31: a wait could otherwise take seq 2 while seq 1 was
still on its way, and an event could appear in a run after its end).

Every run has two limits on its events, given to each send by the engine (the
``pikku_max_event_bytes`` and ``pikku_max_events_per_run`` settings): a payload larger
than ``max_bytes`` as JSON is refused before anything is written (``check_send``), and
so is a send to a run that has kept ``max_events`` events already, decided by the same
guarded write that keeps an event (the run's counter is the number of events it kept:
the write that raises it is guarded on the count it read, so concurrent sends never take
a run past its limit). Either refusal is a ``WorkflowEventLimitError``; a key's repeat
still returns its first send's event. An event's document records its payload's size, so
a run's events are listed without their payloads (``list_events(payloads=False)``) and
still say how large each is.

A send is one event per call: the event's ``_id`` is derived from the call's own
``send_id`` (``keys.sent_event_id``), or from its ``key`` (``keys.keyed_event_id``) so
that every repeat of the key lands on the first, and a call that retries its writes
through an election lands on the document its first try wrote. Which event a
``wf.wait_for_event`` takes is not stored here: the waiting step's result names the
event's ``seq`` (``replay``), so consuming an event is the one guarded write that settles
the step.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

from pymongo.errors import ConnectionFailure, PyMongoError, ServerSelectionTimeoutError

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError, WorkflowEventLimitError
from pikku_celery.model.keys import EventField as E
from pikku_celery.model.records import WorkflowEvent
from pikku_celery.model.validate import check_event_name, check_name, check_value
from pikku_celery.store._docs import to_datetime

Doc = dict[str, Any]
MAX_EXCLUDED = 10_000  # events one run's waits of one name may have taken
_KEPT = "pikku_event_kept"  # set on a store error of a send (``mark_unsent``)


def check_send(run_id: str, name: str, payload: Any, key: str | None,
               send_id: str | None, max_bytes: int | None = None) -> int:
    """Refuse a send that can never be kept (``max_bytes``: the limit on its payload's
    size as JSON, ``None`` or 0 for none); return its payload's size."""
    check_name("run id", run_id)
    check_event_name("event name", name)
    if key is not None:
        check_name("event key", key)
    if send_id is not None:
        check_name("send id", send_id)
    size = check_value(f"payload of event {name!r}", payload)
    if max_bytes and size > max_bytes:
        raise WorkflowEventLimitError(run_id, name, WorkflowEventLimitError.MAX_EVENT_BYTES,
                                      max_bytes, size)
    return size


def check_count(run_id: str, name: str, kept: int, max_events: int | None) -> None:
    """Refuse a new event for a run that has ``kept`` events, at its limit ``max_events``
    (``None`` or 0: none). The caller's write that keeps the event must be guarded on
    ``kept``, so the check holds when sends race."""
    if max_events and kept >= max_events:
        raise WorkflowEventLimitError(run_id, name,
                                      WorkflowEventLimitError.MAX_EVENTS_PER_RUN,
                                      max_events, kept)


def check_page(run_id: str, limit: int, after: int) -> None:
    check_name("run id", run_id)
    for what, value, least in (("limit", limit, 1), ("after", after, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidInputError(f"{what} must be an int of at least {least}, got "
                                    f"{value!r}")


def check_next(run_id: str, name: str, taken: Collection[int]) -> list[int]:
    check_name("run id", run_id)
    check_name("event name", name)
    seqs = sorted(set(taken))
    if len(seqs) > MAX_EXCLUDED or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in seqs):
        raise InvalidInputError(f"taken must be at most {MAX_EXCLUDED} ints, got "
                                f"{len(seqs)} values")
    return seqs


def new_send_id() -> str:
    """A send's own id, for a caller that gave none: one event per store call."""
    return uuid.uuid4().hex


def event_doc_id(run_id: str, key: str | None, send_id: str) -> str:
    return (keys.sent_event_id(run_id, send_id) if key is None
            else keys.keyed_event_id(run_id, key))


def new_event_doc(run_id: str, name: str, payload: Any, key: str | None, send_id: str,
                  now_ms: int, wake_check_ms: int | None, seq: int | None = None, *,
                  size: int | None = None) -> Doc:
    """The event's document; ``seq`` ``None`` until the run's counter gives it a place;
    ``size``: the payload's (``check_send``)."""
    return {E.ID: event_doc_id(run_id, key, send_id), E.RUN: run_id, E.NAME: name,
            E.SEQ: seq, E.SEND: send_id, E.PAYLOAD: payload, E.SIZE: size, E.KEY: key,
            E.SENT: now_ms, E.WAKE: wake_check_ms}


#: What a listing without payloads reads of an event's document.
WITHOUT_PAYLOAD = {E.PAYLOAD: 0}


def event_from_doc(doc: Doc, seq: int | None = None) -> WorkflowEvent:
    """The read model of ``doc``, at ``seq`` when given (the run's counter gave the event
    its place before its document was told; 0 for a document no send has placed)."""
    sent = to_datetime(doc[E.SENT])
    assert sent is not None
    place = doc.get(E.SEQ) if seq is None else seq
    return WorkflowEvent(run_id=doc[E.RUN], name=doc[E.NAME], seq=place or 0,
                         payload=doc.get(E.PAYLOAD), sent_at=sent, key=doc.get(E.KEY),
                         event_id=doc[E.ID], size=doc.get(E.SIZE))


def created_by(doc: Doc, send_id: str) -> bool:
    """Whether the send ``send_id`` wrote ``doc`` (not an earlier send of its key)."""
    return bool(doc.get(E.SEND) == send_id)


# --- errors a send retries ------------------------------------------------------------------


def transient(exc: BaseException) -> bool:
    """A store error a send tries again: MongoDB unreachable or between primaries
    (``AutoReconnect``, ``NotPrimaryError``, ``NetworkTimeout``,
    ``ServerSelectionTimeoutError``: all ``ConnectionFailure``), or a write the driver
    labels retryable (a stepped-down primary's write concern error). The send's writes
    are idempotent (``store.mongo.events``), so trying again never keeps a second event."""
    return isinstance(exc, ConnectionFailure) or (
        isinstance(exc, PyMongoError) and exc.has_error_label("RetryableWriteError"))


def mark_unsent(exc: BaseException, kept: bool | None) -> None:
    """Say on a store error of a send what the store knows of its event: ``False``, it
    read that the event was not kept and issued no write that could keep it (or that
    write was never sent: no server was selected); ``True``, the write that keeps it may
    have landed; ``None``, it learned nothing before the error."""
    setattr(exc, _KEPT, kept)


def kept_as_marked(exc: BaseException) -> bool | None:
    """What ``mark_unsent`` said on ``exc`` (or on the error it was raised from: the
    MongoDB store names an unreachable server with a new error); ``True`` when nothing
    was said (a store that does not tell may have kept it)."""
    for err in (exc, exc.__cause__):
        if err is not None and hasattr(err, _KEPT):
            said = getattr(err, _KEPT)
            return said if isinstance(said, bool) else None
    return True


def never_sent(exc: BaseException) -> bool:
    """No server was selected: the command was not sent, so it wrote nothing."""
    return isinstance(exc, ServerSelectionTimeoutError)
