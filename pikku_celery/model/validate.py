"""Refuse input that could never be stored faithfully, before anything is written.

Names become values in MongoDB documents and parts of Redis keys; data and results become
BSON. A ``$``-prefixed or dotted key would be read by MongoDB as an operator or a path, a
value JSON cannot carry would not round-trip to another worker, and a document over the
16 MB BSON limit would fail half-way through a multi-write operation.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from pikku_celery.model.errors import InvalidInputError

MAX_NAME_LEN = 200
# MongoDB refuses documents over 16 MiB; leave room for the step's own fields.
MAX_VALUE_BYTES = 15 * 1024 * 1024
# MongoDB stores at most 100 levels of nesting per document, counted as BSON counts them:
# the document is level 1 and every object or array inside adds one. Every value pikku
# stores (a run's input or output, a step's data, result or error) is a field of its own
# document, so the value itself may nest MAX_DOCUMENT_DEPTH - 1 levels. A value pikku wraps
# before storing it again (a graph node's data, a compensation's) is checked again then.
MAX_DOCUMENT_DEPTH = 100
MAX_VALUE_DEPTH = MAX_DOCUMENT_DEPTH - 1
_INT64 = 2**63
# The run state is for small shared values (a counter, a flag, an id), read by every node
# started after a write: it travels in each node's data, so it is kept small.
MAX_STATE_BYTES = 64 * 1024
# A step's progress (``ctx.progress``) is a note shown to people, rewritten as the body goes.
MAX_PROGRESS_BYTES = 16 * 1024
# A state key becomes a MongoDB field name under ``state.``: no dots, no ``$``.
_STATE_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a usable name for a workflow, step or run."""
    if not isinstance(value, str):
        raise InvalidInputError(
            f"{what} must be a string, got {type(value).__name__}: {_shown(value)}")
    if not value or len(value) > MAX_NAME_LEN:
        raise InvalidInputError(
            f"{what} must be 1 to {MAX_NAME_LEN} characters, got {_shown(value)}")
    if value.startswith("$") or "\x00" in value or value != value.strip():
        raise InvalidInputError(
            f"{what} {value!r} is not allowed (no leading '$', NUL or surrounding spaces)"
        )
    return value


def check_event_name(what: str, value: object) -> str:
    """Return ``value`` if it can name an event or a published key: a name as
    ``check_name`` has it, without ``#`` (the reach suffix of a waiting step's name, so
    ``a#2`` could not tell the second wait for ``a`` from the first for ``a#2``)."""
    check_name(what, value)
    assert isinstance(value, str)
    if "#" in value:
        raise InvalidInputError(f"{what} {value!r} is not allowed (no '#')")
    return value


#: What a caller-chosen run id may hold: ASCII letters and digits and ``- _ . : + = ~ @``,
#: never ``@`` first (``check_run_id``).
#: Every one of them is served as is in a URL path segment (the web API's and the
#: dashboard's ``runs/<run_id>``) and typed as is in a shell; ``/`` (never routed to a
#: run), ``?``, ``#``, ``%``, backslashes, spaces and any other character are refused.
_RUN_ID = re.compile(r"[A-Za-z0-9_.:+=~@\-]+")
DERIVED_RUN_ID_PREFIX = "@"  # keys.DERIVED_RUN_ID_PREFIX (validate imports no keys)


def check_run_id(value: object) -> str:
    """Return ``value`` if a caller may start a run under it: a name (``check_name``) of
    the characters above, not made of dots alone, not starting with ``@`` (the
    form of the ids pikku derives for child runs, which no caller may take first)."""
    check_name("run id", value)
    assert isinstance(value, str)
    if not _RUN_ID.fullmatch(value) or value.strip(".") == "":
        bad = sorted({c for c in value if not _RUN_ID.fullmatch(c)})
        why = (f"it holds {', '.join(repr(c) for c in bad)}" if bad
               else "it is made of dots only")
        raise InvalidInputError(
            f"run id {_shown(value)} is not allowed: {why}. A run id is ASCII letters, "
            "digits and '-', '_', '.', ':', '+', '=', '~', '@' (a '/' could never be served "
            "in a URL)")
    if value.startswith(DERIVED_RUN_ID_PREFIX):
        raise InvalidInputError(
            f"run id {_shown(value)} is not allowed: run ids starting with "
            f"{DERIVED_RUN_ID_PREFIX!r} are reserved for the ids pikku derives for child runs")
    return value


def _shown(value: object) -> str:
    # A forged name can be half a megabyte: an error message (logged, stored as a task
    # result) shows its start and its length, never all of it.
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


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


def check_state_write(writer: str, values: object, current: Mapping[str, Any]
                      ) -> dict[str, Any]:
    """Return the write of ``values`` by ``writer`` into the run state ``current``, as stored,
    if its keys are plain names and the merged map stays under ``MAX_STATE_BYTES``."""
    check_name("run state writer", writer)
    if not isinstance(values, Mapping) or not values:
        raise InvalidInputError(f"run state written by {writer!r} must be a non-empty "
                                f"mapping of names to values, got {_shown(values)}")
    for key in values:
        if not isinstance(key, str) or not _STATE_KEY.fullmatch(key):
            raise InvalidInputError(
                f"run state key {_shown(key)} written by {writer!r} must be 1 to 64 "
                "letters, digits or underscores")
    check_value(f"run state written by {writer!r}", dict(values))
    size = len(json.dumps({**current, **values}, separators=(",", ":")).encode())
    if size > MAX_STATE_BYTES:
        raise InvalidInputError(
            f"run state would be {size} bytes as JSON after the write of {writer!r}, over "
            f"the {MAX_STATE_BYTES}-byte limit: it is for small shared values; store large "
            "data elsewhere and keep its key in the state")
    stored: dict[str, Any] = as_stored(dict(values))
    return stored


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
    # Iterative, in document order: a value nested thousands of levels deep (or a list that
    # contains itself) is refused at level MAX_VALUE_DEPTH + 1, never by a RecursionError
    # half-way down (which the web API would answer with a 500 and a worker with a crash).
    pending: list[tuple[Any, str, int]] = [(value, path, 0)]
    while pending:
        item, where, depth = pending.pop()
        if isinstance(item, list | tuple | dict):
            pending.extend(reversed(_children(what, item, where, depth + 1)))
        else:
            _check_scalar(what, item, where)


def _children(what: str, value: list[Any] | tuple[Any, ...] | dict[Any, Any], path: str,
              depth: int) -> list[tuple[Any, str, int]]:
    if depth > MAX_VALUE_DEPTH:
        raise InvalidInputError(
            f"{what} is nested too deeply: {path} is at level {depth + 1} of its stored "
            f"document, and MongoDB stores at most {MAX_DOCUMENT_DEPTH} (the document is one "
            "level, each object or array one more)"
        )
    if isinstance(value, dict):
        for key in value:
            _check_key(what, key, path)
        return [(item, f"{path}.{key}", depth) for key, item in value.items()]
    return [(item, f"{path}[{index}]", depth) for index, item in enumerate(value)]


def _check_scalar(what: str, value: Any, path: str) -> None:
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


MAX_BY = 200  # characters of who retried or forked a run (its lineage's ``by``)


def check_by(by: Any, what: str = "'by'") -> str | None:
    """Return ``by`` (who retried or forked a run, kept in its lineage) if it is ``None``
    or a string of 1 to ``MAX_BY`` characters."""
    if by is not None and (not isinstance(by, str) or not 0 < len(by) <= MAX_BY):
        raise InvalidInputError(f"{what} must be a non-empty string of at most {MAX_BY} "
                                f"characters, or None; got {_shown(by)}")
    return by


MAX_CONCURRENCY = 10_000


def check_concurrency(what: str, value: object) -> int:
    """A concurrency limit: an int from 1 to ``MAX_CONCURRENCY``."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            1 <= value <= MAX_CONCURRENCY):
        raise InvalidInputError(f"{what} must be an int from 1 to {MAX_CONCURRENCY}, got "
                                f"{value!r}")
    return value


def check_progress(step_name: str, progress: Any) -> None:
    """A step's progress must be plain JSON of at most ``MAX_PROGRESS_BYTES``."""
    size = check_value(f"progress of step {step_name!r}", progress)
    if size > MAX_PROGRESS_BYTES:
        raise InvalidInputError(
            f"progress of step {step_name!r} is {size} bytes as JSON, more than "
            f"{MAX_PROGRESS_BYTES}: keep it to a few counters and a message")
