"""The run page's events: the events sent to the run (each with the wait that took it, from
the timeline) and the Send event form.

The form (``runs/<run_id>/events``) is authorized as the ``send_event`` action and
CSRF-checked like the other forms, and sends through ``pikku.send_event`` (the JSON API's
path): a name, a payload typed as JSON (empty: ``null``) and an optional idempotency key.
It is offered while the run is live, filled with the name of the event the run waits for;
a send refused (a payload that is not JSON, a bad name, a run that ended) re-renders the
page with the reason and what was typed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.validate import MAX_DOCUMENT_DEPTH
from pikku_celery.operate.timeline import Timeline

MAX_KEY_CHARS = 200


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
