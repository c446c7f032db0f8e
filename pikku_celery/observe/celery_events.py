"""Celery's task events for the steps a pass runs in place, so Flower and ``celery events``
list them as they list sent tasks.

A step run in place has no message: the worker's consumer never sees it, so Celery sends no
``task-received``/``task-started``/``task-succeeded`` for it. When the worker sends task
events (``celery worker -E``, or ``worker_send_task_events = True``), this observer sends
them itself, under the task id the pass gave the attempt (recorded as its ``task_id``), with
the step's task name, its message's arguments, the result's repr and the runtime, from the
process that ran the step (a prefork child: the ``pid`` field says which), the way a task
sends its own events (``Task.send_event``: a producer from the app's pool, the worker's
hostname). A step that runs as its own task is left to Celery, which reports it already: no
event is sent twice.

Whether the worker sends task events is read once, when it starts (``worker_init``, before
its pool forks): ``celery control enable_events`` at run time reaches the worker's consumer,
not its pool's processes, so it does not turn these on (nor ``disable_events`` off).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from celery import Celery, signals
from celery.utils.saferepr import saferepr

from pikku_celery.observe import Observer

log = logging.getLogger("pikku_celery")

#: Set on a Celery app by ``worker_init`` when its worker sends task events: the worker's
#: hostname (the ``hostname`` field of every event, as its consumer's dispatcher sends).
HOSTNAME_ATTR = "_pikku_task_events_hostname"
RESULT_REPR_MAX = 1024  # Celery's ``Task.resultrepr_maxsize``


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None and getattr(sender, "task_events", False):
        setattr(app, HOSTNAME_ATTR, sender.hostname)


# Connected when this module is imported (``worker/tasks.py`` imports it with the app's
# tasks, before any worker starts); strong, so it outlives any one app.
signals.worker_init.connect(_on_worker_init, weak=False)


def events_hostname(app: Celery) -> str | None:
    """The hostname to send ``app``'s step events as, when this process is (or was forked
    from) a worker that sends task events; else ``None``."""
    hostname = getattr(app, HOSTNAME_ATTR, None)
    return hostname if isinstance(hostname, str) else None


def _current_task_ids() -> tuple[str | None, str | None]:
    """The id and root id of the Celery task this thread is running (the orchestrate or
    step task whose pass runs the step), the in-place step's parent."""
    from celery import current_task

    request = getattr(current_task, "request", None) if current_task else None
    if request is None or getattr(request, "called_directly", True):
        return None, None
    task_id = getattr(request, "id", None)
    return task_id, getattr(request, "root_id", None) or task_id


class StepEvents:
    """The observer: one step attempt run in place, as Celery's task events."""

    def __init__(self, app: Celery) -> None:
        self._app = app

    def __call__(self, event: str, sender: str, fields: dict[str, Any]) -> None:
        if not fields.get("in_place") or not event.startswith("step_attempt"):
            return
        task_id = fields.get("task_id")
        hostname = events_hostname(self._app)
        if hostname is None or not task_id:
            return
        if event == "step_attempt_started":
            parent_id, root_id = _current_task_ids()
            self._send(hostname, "task-received", task_id, name=fields["function"],
                       args=saferepr((fields["run_id"], fields["step_name"])), kwargs="{}",
                       root_id=root_id, parent_id=parent_id,
                       retries=max(0, int(fields["attempt"]) - 1), eta=None, expires=None)
            self._send(hostname, "task-started", task_id)
        elif event == "step_attempt_finished":
            self._finished(hostname, task_id, fields)
        # ``step_attempt_superseded``: no event. Its task stays STARTED, as a sent task's
        # does whose worker lost it; the attempt that superseded it has its own task id.

    def _finished(self, hostname: str, task_id: str, fields: dict[str, Any]) -> None:
        if fields.get("status") == "succeeded":
            self._send(hostname, "task-succeeded", task_id,
                       result=saferepr(fields.get("result"), RESULT_REPR_MAX),
                       runtime=fields.get("duration"))
            return
        exception = fields.get("exception")
        error = fields.get("error") or {}
        shown = saferepr(exception) if exception is not None else str(error.get("type"))
        trace = _traceback(exception) if exception is not None else error.get("traceback")
        kind = "task-failed" if fields.get("retry_at") is None else "task-retried"
        self._send(hostname, kind, task_id, exception=shown, traceback=trace or "")

    def _send(self, hostname: str, kind: str, task_id: str, **fields: Any) -> None:
        # A producer from the app's pool per event (the pool is per process and thread-safe),
        # as ``Task.send_event`` sends: nothing to share across a fork or between threads.
        conf = self._app.conf
        with self._app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(kind, uuid=task_id, retry=True,
                            retry_policy=conf.task_publish_retry_policy, **fields)


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def install(pikku: Any) -> Observer | None:
    """Always installed: it sends nothing outside a worker that sends task events (one
    attribute read per attempt event)."""
    return StepEvents(pikku.app)
