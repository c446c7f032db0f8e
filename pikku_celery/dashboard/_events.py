"""The run page's events: the events sent to the run (each with the wait that took it, from
the timeline) and the Send event form.

The form (``runs/<run_id>/events``) is authorized as the ``send_event`` action and
CSRF-checked like the other forms, and sends through ``pikku.send_event`` (the JSON API's
path): a name, a payload typed as JSON (empty: ``null``) and an optional idempotency key.
It is offered while the run is live, filled with the name of the event the run waits for;
a send refused (a payload that is not JSON, a bad name, a run that ended) re-renders the
page with the reason and what was typed (413 for a payload over the run's limit on an
event's size, 409 for a run at its limit on events).

The events are listed ``EVENTS_PER_PAGE`` at a time (``?events_after=<seq>`` pages on) and
without their payloads: each row says how large its payload is and reads it from the JSON
API (``api/runs/<run_id>/events/<seq>/payload``) when its ``<details>`` is opened, as a
received event wait does; the page's refresh keeps a payload read, and never reads it
again (an event's payload never changes). So a live run's page, read again every few
seconds, carries no payload however many and however large its events are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._events_api import seq_of
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowEventError,
    WorkflowEventLimitError,
    WorkflowEventNotSentError,
)
from pikku_celery.model.records import WorkflowEvent
from pikku_celery.model.validate import MAX_DOCUMENT_DEPTH
from pikku_celery.operate.timeline import Timeline

MAX_KEY_CHARS = 200
EVENTS_PER_PAGE = 100


@dataclass(frozen=True)
class EventsPage:
    """The events the run page lists (without payloads), and the links to the next page
    and back to the first (``None``: none)."""

    events: list[WorkflowEvent]
    later: str | None
    first: str | None


def events_page(pikku: PikkuCelery, run_id: str, after: str | None, here: str
                ) -> EventsPage:
    """``EVENTS_PER_PAGE`` events of the run after the seq ``after`` (``?events_after=``);
    ``here``: the run page's address."""
    start = seq_of(after, "events_after", least=0) or 0
    found = pikku.list_events(run_id, EVENTS_PER_PAGE + 1, after=start, payloads=False)
    shown = found[:EVENTS_PER_PAGE]
    later = (f"{here}?{urlencode({'events_after': shown[-1].seq})}"
             if len(found) > EVENTS_PER_PAGE else None)
    return EventsPage(shown, later, here if start else None)


def refusal_status(exc: Exception) -> int:
    """The status of a page re-rendered for a send refused with ``exc``."""
    if isinstance(exc, WorkflowEventLimitError):
        return 413 if exc.too_large else 409
    if isinstance(exc, WorkflowEventError):
        return 409  # the run has ended
    return 503 if isinstance(exc, WorkflowEventNotSentError) else 400


@dataclass(frozen=True)
class TypedEvent:
    """What the Send event form sent, as typed (kept when the send is refused)."""

    name: str
    payload: str
    key: str

    @classmethod
    def of(cls, form: Mapping[str, str]) -> TypedEvent:
        return cls(name=(form.get("name") or "").strip(),
                   payload=(form.get("payload") or "").strip(),
                   key=(form.get("key") or "").strip())

    def value(self) -> Any:
        """The payload: JSON as typed, ``None`` when nothing was typed."""
        if not self.payload:
            return None
        try:
            return json.loads(self.payload)
        except RecursionError:
            raise InvalidInputError(f"the payload is nested too deeply (MongoDB stores at "
                                    f"most {MAX_DOCUMENT_DEPTH} levels)") from None
        except ValueError as exc:
            raise InvalidInputError(f"the payload is not JSON: {exc}") from None


@dataclass(frozen=True)
class EventRefusal:
    """A send ``pikku.send_event`` refused, shown with what was typed."""

    message: str
    typed: TypedEvent


@dataclass(frozen=True)
class EventForm:
    """The Send event form: ``form`` when the caller may send here (filled with ``typed``),
    else ``why_not`` (``None`` too for a run that has ended: no form, no reason)."""

    form: bool
    why_not: str | None
    typed: TypedEvent
    refusal: EventRefusal | None = None


def event_form(timeline: Timeline, *, forms: bool, allowed: bool,
               refusal: EventRefusal | None) -> EventForm:
    """The form for the run of ``timeline``: ``forms``, whether the page has forms (a CSRF
    field); ``allowed``, whether the caller may ``send_event`` to the run."""
    waiting = timeline.waiting_event
    typed = refusal.typed if refusal is not None else TypedEvent(
        waiting.name if waiting is not None else "", "", "")
    if timeline.run.is_terminal:
        return EventForm(False, None, typed, refusal)  # a send refused as it ended: why
    if not forms:
        return EventForm(False, "no forms here (the app has no SECRET_KEY)", typed)
    if not allowed:
        return EventForm(False, "you may not send events to this run", typed)
    return EventForm(True, None, typed, refusal)
