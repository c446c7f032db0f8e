"""Read models served as JSON, by the JSON API (``_api``), the dashboard and ``pikku
show --json``: plain JSON values (datetimes as ISO 8601 strings), errors as ``type`` and
``message`` (their ``traceback`` only when shown), a run's events with the waits that took
them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pikku_celery.operate.timeline import SentEvent

_ERROR_FIELDS = ("type", "message")


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


def present(record: Any, *, show_tracebacks: bool) -> Any:
    """A run, step or attempt as served: its ``error`` as type and message only (plus the
    traceback when shown), and no traceback in error-shaped values nested anywhere else."""
    served = to_json(record)
    if isinstance(served, dict) and isinstance(served.get("error"), dict):
        error = served["error"]
        kept = _ERROR_FIELDS + (("traceback",) if show_tracebacks else ())
        served["error"] = {k: error[k] for k in kept if k in error}
    return served if show_tracebacks else _without_tracebacks(served)


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
