"""Refuse input that could never be stored faithfully, before anything is written.

Names become values in MongoDB documents and parts of Redis keys; data and results become
BSON. A ``$``-prefixed or dotted key would be read by MongoDB as an operator or a path, a
value JSON cannot carry would not round-trip to another worker, and a document over the
16 MB BSON limit would fail half-way through a multi-write operation.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pikku_celery.errors import InvalidInputError

MAX_NAME_LEN = 200
# MongoDB refuses documents over 16 MiB; leave room for the step's own fields.
MAX_VALUE_BYTES = 15 * 1024 * 1024
_INT64 = 2**63


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a usable name for a workflow, step or run."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a string, got {type(value).__name__}: {value!r}")
    if not value or len(value) > MAX_NAME_LEN:
        raise InvalidInputError(f"{what} must be 1 to {MAX_NAME_LEN} characters, got {value!r}")
    if value.startswith("$") or "\x00" in value or value != value.strip():
        raise InvalidInputError(
            f"{what} {value!r} is not allowed (no leading '$', NUL or surrounding spaces)"
        )
    return value


def check_value(what: str, value: Any) -> int:
    """Check that ``value`` is plain JSON data MongoDB can store; return its encoded size."""
    _walk(what, value, what)
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # pragma: no cover - _walk catches these first
        raise InvalidInputError(f"{what} is not JSON-serialisable: {exc}") from exc
    size = len(encoded.encode())
    if size > MAX_VALUE_BYTES:
        raise InvalidInputError(
            f"{what} is {size} bytes as JSON, over the {MAX_VALUE_BYTES}-byte limit "
            "(MongoDB documents are capped at 16 MB); store large data elsewhere and pass a key"
        )
    return size


def as_stored(value: Any) -> Any:
    """``value`` as a store gives it back (tuples become lists): what to compare a stored
    value with. ``value`` must have passed ``check_value``."""
    return json.loads(json.dumps(value))


def check_step_document(step_name: str, data: Any, *, result: Any = None,
                        error: Any = None) -> None:
    """Check that an outcome fits in the step document beside the step's data.

    Each value alone passing ``check_value`` is not enough: MongoDB refuses an update whose
    *resulting* document passes 16 MiB (error 17419), and a write that can never succeed
    must fail the attempt at once, not be retried."""
    outcome = "error" if error is not None else "result"
    size = check_value(f"{outcome} of step {step_name!r}",
                       error if error is not None else result)
    data_size = len(json.dumps(data, separators=(",", ":")).encode())
    if size + data_size > MAX_VALUE_BYTES:
        raise InvalidInputError(
            f"{outcome} of step {step_name!r} is {size} bytes as JSON and the step's data "
            f"{data_size}: together over the {MAX_VALUE_BYTES}-byte limit of one MongoDB "
            "document; store large data elsewhere and pass a key")


def _walk(what: str, value: Any, path: str) -> None:
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise InvalidInputError(f"{what}: integer at {path} does not fit in 64 bits")
        return
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise InvalidInputError(f"{what}: {value!r} at {path} is not valid JSON")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(what, item, f"{path}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_key(what, key, path)
            _walk(what, item, f"{path}.{key}")
        return
    raise InvalidInputError(
        f"{what}: value at {path} of type {type(value).__name__} is not JSON-serialisable"
    )


def _check_key(what: str, key: object, path: str) -> None:
    if not isinstance(key, str):
        raise InvalidInputError(f"{what}: key {key!r} at {path} must be a string")
    if key.startswith("$") or "." in key or "\x00" in key:
        raise InvalidInputError(
            f"{what}: key {key!r} at {path} would be read by MongoDB as an operator or a path "
            "(keys may not start with '$' or contain '.')"
        )


MAX_LIST_LIMIT = 1000


def check_listing(workflow: object, status: object, limit: object,
                  statuses: tuple[str, ...]) -> None:
    """Filters of ``list_runs``: a name, a known status, a bounded positive limit."""
    if workflow is not None:
        check_name("workflow name", workflow)
    if status is not None and status not in statuses:
        raise InvalidInputError(f"unknown run status {status!r}; one of {list(statuses)}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidInputError(f"limit must be an int from 1 to {MAX_LIST_LIMIT}, got {limit!r}")
