"""The JSON API's reads of a run's events (``_api.ROUTES``), free of any web framework, and
the pages of events the dashboard's run page shows (``page``).

Events are paged like steps and history, and listed without their payloads, which have a
route of their own: a read of a run is bounded whatever its events hold.

- ``GET api/runs/<run_id>/events?limit=&after=`` (action ``read``): a page of the run's
  events in the order sent (``limit`` 1 to ``MAX_LIMIT``, default ``DEFAULT_LIMIT``;
  ``after``: the ``next`` of the page before, the last ``seq`` it listed), each with its
  metadata (``run_id``, ``name``, ``seq``, ``sent_at``, ``key``, ``event_id``), its
  payload's ``size`` in bytes as JSON (``null`` for an event kept before sizes were
  recorded) and the wait that took it (``taken_by``, ``taken_by_step``), never its
  ``payload``; ``next``: the ``after`` of the next page, ``null`` on the last. The run's
  own JSON (``GET api/runs/<run_id>``) carries the first page as ``events`` and its
  ``next`` as ``events_next``.
- ``GET api/runs/<run_id>/events/<seq>/payload`` (action ``read``): the event ``seq``
  whole, its ``payload`` with it (an event's payload is never changed: a client reads it
  once; it is shown through the ``redact_value`` hook, told ``"event_payload"``); 404
  ``WorkflowEventNotFound`` for a ``seq`` the run has not kept.

Both read the run as every read does (``_readable.readable_run``: a run the caller's run
filter does not keep is a 404).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._access import ApiError, Caller
from pikku_celery.contrib._json import EVENT_VALUES, present, sent_events_json
from pikku_celery.contrib._readable import readable_run
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import WorkflowEvent, WorkflowRun
from pikku_celery.operate.timeline import SentEvent, build

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

Response = tuple[int, Any]
DEFAULT_LIMIT = 100
MAX_LIMIT = 500
_MAX_SEQ = 2**53  # beyond any run's counter, within every JSON reader's integers


def seq_of(raw: str | None, what: str, *, least: int) -> int | None:
    """A ``seq`` from a query or a path (``None`` when absent or empty)."""
    if raw is None or raw == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not least <= int(text) <= _MAX_SEQ:
        raise InvalidInputError(f"{what} must be an event's seq, a whole number from "
                                f"{least}, got {raw[:40]!r}")
    return int(text)


def page(pikku: PikkuCelery, run: WorkflowRun, *, after: int = 0,
         limit: int = DEFAULT_LIMIT) -> tuple[list[SentEvent], int | None]:
    """Up to ``limit`` events of ``run`` after the seq ``after``, without their payloads,
    each with the wait that took it; and the ``after`` of the next page (``None``: this
    is the last)."""
    events = pikku.list_events(run.run_id, limit + 1, after=after, payloads=False)
    more = len(events) > limit
    events = events[:limit]
    return _taken(pikku, run, events), (events[-1].seq if more else None)


def _taken(pikku: PikkuCelery, run: WorkflowRun, events: list[WorkflowEvent]
           ) -> list[SentEvent]:
    if not events:
        return []
    return build(run, pikku.get_steps(run.run_id), [], datetime.now(UTC),
                 events=events).events


def listed(events: list[SentEvent], *, show_tracebacks: bool) -> list[Any]:
    """Events as listed: no ``payload`` (its ``size`` instead)."""
    served = []
    for entry in sent_events_json(events):
        entry.pop("payload", None)
        served.append(present(entry, show_tracebacks=show_tracebacks))
    return served


def get_events(pikku: PikkuCelery, caller: Caller, run_id: str, query: Mapping[str, str],
               *, show_tracebacks: bool) -> Response:
    run = readable_run(pikku, caller, run_id)
    limit = _limit(query.get("limit"))
    after = seq_of(query.get("after"), "after", least=0) or 0
    events, more = page(pikku, run, after=after, limit=limit)
    return 200, {"events": listed(events, show_tracebacks=show_tracebacks), "next": more}


def get_event(pikku: PikkuCelery, caller: Caller, run_id: str, raw_seq: str, *,
              show_tracebacks: bool) -> Response:
    """One event with its payload."""
    run = readable_run(pikku, caller, run_id)
    seq = seq_of(raw_seq, "the event's seq", least=1)
    assert seq is not None
    found = pikku.list_events(run_id, 1, after=seq - 1)
    if not found or found[0].seq != seq:
        raise ApiError(404, "WorkflowEventNotFound", f"run {run_id!r} has no event {seq}")
    [entry] = sent_events_json(_taken(pikku, run, found))
    return 200, present(entry, show_tracebacks=show_tracebacks,
                        redact=pikku.settings.redact_value, values=EVENT_VALUES)


def _limit(raw: str | None) -> int:
    if not raw:
        return DEFAULT_LIMIT
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIMIT:
        raise InvalidInputError(f"limit must be from 1 to {MAX_LIMIT}, got {raw[:40]!r}")
    return int(text)
