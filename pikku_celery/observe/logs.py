"""Logs: every pikku log line says which run, workflow, step and attempt it is about, and a
step run in place is logged as Celery logs a task.

Structured fields: each record logged through the ``pikku_celery`` logger (and its children:
``pikku_celery.reaper``, ``pikku_celery.heartbeat``...) carries the attributes ``run_id``,
``workflow``, ``step`` and ``attempt`` (``None`` when not known), as ``extra=`` would set
them, so a JSON formatter (``python-json-logger``, structlog's ``ExtraAdder``...) outputs
them and a plain format may name them (``%(run_id)s``). They are those of the work the
thread is doing: a pass of a run (``run_id``), a step attempt (the step and attempt too),
read from a context variable (``current``) the engine's reports set. A record that sets
them itself (``extra={"run_id": ...}``) keeps its own. ``workflow`` is set when the report
names it.

Task lines: Celery's worker logs each task it runs (``Task add[<id>] succeeded in 0.004s:
3``); a step run in place is no task of Celery's, so pikku logs the same line for it, at the
same levels, under the task id its attempt records: ``succeeded`` (INFO), ``retry:`` (INFO,
a retry to come) or ``raised unexpected`` (ERROR, with the traceback: the step failed for
good).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any

from celery.utils.saferepr import saferepr

from pikku_celery.observe import Observer

log = logging.getLogger("pikku_celery")

#: The record attributes this adds (its ``extra=`` fields).
FIELDS = ("run_id", "workflow", "step", "attempt")
_NONE: tuple[Any, ...] = (None, None, None, None)
RESULT_REPR_MAX = 1024  # Celery's ``Task.resultrepr_maxsize``

#: The fields of the work this context is doing, in ``FIELDS``' order.
current: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "pikku_log_fields", default=_NONE)


class ContextFilter(logging.Filter):
    """Copies the current fields onto each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        values = current.get()
        for name, value in zip(FIELDS, values, strict=True):
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class _Frames(threading.local):
    """The passes and attempts under way in this thread, innermost last: an attempt runs
    inside a pass (in place) or alone (a delivery), a pass may run inside a delivery."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, tuple[Any, ...]]] = []


class LogContext:
    """The observer: keeps ``current`` to the innermost pass or attempt of this thread, and
    logs the task lines of steps run in place."""

    def __init__(self) -> None:
        self._frames = _Frames()

    def __call__(self, event: str, sender: str, fields: dict[str, Any]) -> None:
        stack = self._frames.stack
        run_id = fields.get("run_id")
        if event == "pass_started":
            stack.append(("pass", (run_id, fields.get("workflow"), None, None)))
        elif event == "step_attempt_started":
            if not fields.get("in_place"):
                # A delivery is the outermost work of its thread: a frame left below it is
                # an earlier delivery's that an exception ended before its report did.
                stack.clear()
            workflow = fields.get("workflow") or next(  # a step run in place: its pass's
                (frame[1] for kind, frame in reversed(stack) if frame[0] == run_id), None)
            stack.append(("step", (run_id, workflow, fields.get("step_name"),
                                   fields.get("attempt"))))
        elif event == "pass_finished":
            _pop(stack, "pass", run_id, None)
        elif event in ("step_attempt_finished", "step_attempt_superseded"):
            _pop(stack, "step", run_id, fields.get("step_name"))
            if event == "step_attempt_finished" and fields.get("in_place"):
                task_line(fields)
        else:
            return
        current.set(stack[-1][1] if stack else _NONE)


def _pop(stack: list[tuple[str, tuple[Any, ...]]], kind: str, run_id: Any, step: Any) -> None:
    """Remove the innermost frame ``kind`` of ``run_id`` (and ``step``), with any left
    above it (an attempt whose end was never reported: its worker escaped with an error)."""
    for index in range(len(stack) - 1, -1, -1):
        frame_kind, values = stack[index]
        if frame_kind == kind and values[0] == run_id and (step is None or values[2] == step):
            del stack[index:]
            return


def task_line(fields: dict[str, Any]) -> None:
    """The line Celery's worker logs when a task ends (``celery.app.trace``), for a step
    run in place; with the attempt's fields as ``extra``."""
    extra = {"run_id": fields.get("run_id"), "workflow": fields.get("workflow"),
             "step": fields.get("step_name"), "attempt": fields.get("attempt")}
    name, task_id = fields.get("function"), fields.get("task_id")
    if fields.get("status") == "succeeded":
        if not log.isEnabledFor(logging.INFO):
            return  # not even the result's repr
        log.info("Task %s[%s] succeeded in %ss: %s", name, task_id, fields.get("duration"),
                 saferepr(fields.get("result"), RESULT_REPR_MAX), extra=extra)
        return
    exc = fields.get("exception")
    shown = saferepr(exc) if exc is not None else str((fields.get("error") or {}).get("type"))
    retry_at = fields.get("retry_at")
    if retry_at is not None:  # the words of a sent step's retry (``tasks.retry_of``)
        text = f"{type(exc).__name__}: {exc}" if exc is not None else shown
        attempt = int(fields.get("attempt") or 0)
        log.info("Task %s[%s] retry: attempt %d of %s failed (%s); pikku runs attempt %d "
                 "at %s", name, task_id, attempt, fields.get("max_attempts"),
                 text if len(text) <= 500 else text[:500] + "...", attempt + 1,
                 retry_at.isoformat(timespec="milliseconds"), extra=extra)
        return
    exc_info = (type(exc), exc, exc.__traceback__) if isinstance(exc, BaseException) else None
    log.error("Task %s[%s] raised unexpected: %s", name, task_id, shown, exc_info=exc_info,
              extra=extra)


_FILTER = ContextFilter()
_OBSERVER = LogContext()


def add_filter() -> None:
    """Put the filter on ``pikku_celery`` and each of its children that exists (a logger's
    filters see only what is logged to that logger, not what its children pass up)."""
    names = ["pikku_celery", *(name for name in logging.root.manager.loggerDict
                               if name.startswith("pikku_celery."))]
    for name in names:
        logging.getLogger(name).addFilter(_FILTER)  # once: ``addFilter`` skips a duplicate


def install(pikku: Any) -> Observer | None:
    """Always installed (the standard library's logging only); one observer for all the
    ``PikkuCelery`` instances of the process, since the fields are per thread."""
    add_filter()  # again: loggers made since the import get it too
    return _OBSERVER


# On import (``worker/tasks.py`` imports this with the app's tasks): a line logged before
# any engine is built (a worker's start-up notes) has the fields too, so a format naming
# them (``%(run_id)s``) never fails on a pikku record.
add_filter()
