"""Read models served as JSON, by the JSON API (``_api``), the dashboard and ``pikku
show --json``: plain JSON values (datetimes as ISO 8601 strings), errors as ``type`` and
``message`` (their ``traceback`` only when shown), a run's events with the waits that took
them.

The web surface shows each user value (``VALUES``) through the ``redact_value`` hook
(``present(..., redact=)``, ``shown``; ``pikku_celery.model.redaction``): what is stored is
never changed, the hook is given a copy. ``pikku show --json`` shows values as stored."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pikku_celery.model.records import (
    StepAttempt,
    StepState,
    WorkflowEvent,
    WorkflowRun,
    WorkflowSchedule,
)
from pikku_celery.model.redaction import ValueRedactor, redact_value
from pikku_celery.operate.timeline import SentEvent

_ERROR_FIELDS = ("type", "message")
Values = tuple[tuple[str, str], ...]
#: The user values each read model holds: its field, and the ``where`` the ``redact_value``
#: hook is told.
EVENT_VALUES: Values = (("payload", "event_payload"),)
VALUES: dict[type, Values] = {
    WorkflowRun: (("input", "input"), ("output", "output"), ("state", "state")),
    StepState: (("data", "step_input"), ("result", "step_result"),
                ("progress", "step_progress")),
    StepAttempt: (("result", "step_result"),),
    WorkflowEvent: EVENT_VALUES,
    WorkflowSchedule: (("data", "schedule_data"),),
}


def to_json(record: Any) -> Any:
    """A read model as plain JSON (datetimes as ISO 8601 strings)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {k: to_json(v) for k, v in dataclasses.asdict(record).items()}
    if isinstance(record, datetime):
        return record.isoformat()
    if isinstance(record, Mapping):
        return {k: to_json(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [to_json(v) for v in record]
    return record


def shown(value: Any, where: str, redact: ValueRedactor | None) -> Any:
    """A user value as the web surface shows it: as JSON (a copy), through ``redact``
    (the ``redact_value`` hook) told ``where``."""
    return redact_value(to_json(value), where, redact)


def present(record: Any, *, show_tracebacks: bool, redact: ValueRedactor | None = None,
            values: Values | None = None) -> Any:
    """A run, step or attempt as served: its ``error`` as type and message only (plus the
    traceback when shown), and no traceback in error-shaped values nested anywhere else;
    with ``redact``, each user value (``values``, else ``VALUES`` of the record's type)
    passed through it."""
    served = to_json(record)
    if isinstance(served, dict) and isinstance(served.get("error"), dict):
        error = served["error"]
        kept = _ERROR_FIELDS + (("traceback",) if show_tracebacks else ())
        served["error"] = {k: error[k] for k in kept if k in error}
    if not show_tracebacks:
        served = _without_tracebacks(served)
    if redact is not None and isinstance(served, dict):
        for field, where in VALUES.get(type(record), ()) if values is None else values:
            if field in served:
                served[field] = redact_value(served[field], where, redact)
    return served


def _without_tracebacks(value: Any) -> Any:
    # Iterative: a step's data may nest up to MongoDB's 100 levels.
    root: list[Any] = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, dict):
            if "traceback" in item and "type" in item and "message" in item:
                item = {k: v for k, v in item.items() if k != "traceback"}
                parent[key] = item
            stack.extend((item, k) for k in item)
        elif isinstance(item, list):
            stack.extend((item, i) for i in range(len(item)))
    return root[0]


def sent_events_json(events: list[SentEvent]) -> list[dict[str, Any]]:
    """A run's sent events as JSON, each with the wait that took it (``taken_by``, its
    name as shown; ``taken_by_step``, its step name; both ``None``: not taken yet)."""
    found = []
    for sent in events:
        entry = to_json(sent.event)
        entry.update(taken_by=sent.taken_by, taken_by_step=sent.taken_by_step)
        found.append(entry)
    return found
