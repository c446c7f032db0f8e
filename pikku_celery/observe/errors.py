"""Error trackers: a step run in place that fails reaches them as a failure of that step.

A step run in place raises inside the orchestrating task's pass, which records the failure
and goes on: to Celery (and so to Sentry, Rollbar, Bugsnag...) nothing failed, or at best
``orchestrate`` did. For such an attempt this observer does what Celery does for a task that
fails (``celery.app.trace``):

* sends Celery's ``task_failure`` signal, with the step's task as its sender, the attempt's
  task id, the step's message arguments ``(run_id, step_name)`` and the exception, so any
  hook on Celery's task failure reports it;
* with ``sentry-sdk`` initialised with its Celery integration (which wraps task execution
  and does not listen to ``task_failure``, so nothing is reported twice), captures the
  exception as that integration captures a task's (unhandled, mechanism ``celery``), named
  after the step's task, tagged ``celery_task_id`` and ``pikku.run_id``,
  ``pikku.workflow``, ``pikku.step``, ``pikku.attempt``.

Reported as Celery reports a task: only an attempt that fails the step (no attempt left, or
an error it does not retry); one with a retry to come is Celery's ``Retry``, which neither
``task_failure`` nor Sentry's integration report. A superseded attempt is no failure: its
outcome was refused, and the attempt that superseded it reports its own.

A step that runs as its own task fails as that task, reported by Celery and the trackers
already; while it runs, its Sentry scope (the task's own, which the Celery integration
opens) gets the same ``pikku.*`` tags.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, current_task, signals
from kombu.utils.objects import cached_property

from pikku_celery.observe import Observer

log = logging.getLogger("pikku_celery")


def tags(fields: dict[str, Any]) -> dict[str, str]:
    """The ``pikku.*`` tags of one attempt event (tracker tags are strings)."""
    found = {"pikku.run_id": fields.get("run_id"), "pikku.workflow": fields.get("workflow"),
             "pikku.step": fields.get("step_name"), "pikku.attempt": fields.get("attempt")}
    return {key: str(value) for key, value in found.items() if value is not None}


class StepFailures:
    """The observer: a failed step attempt run in place, to Celery's failure hooks."""

    def __init__(self, app: Celery) -> None:
        self._app = app

    def __call__(self, event: str, sender: str, fields: dict[str, Any]) -> None:
        if event == "step_attempt_started" and not fields.get("in_place"):
            self._sentry.tag_task_scope(fields)
            return
        if (event != "step_attempt_finished" or fields.get("status") != "failed"
                or not fields.get("in_place") or fields.get("retry_at") is not None):
            return
        exc = fields.get("exception")
        if not isinstance(exc, BaseException):
            return
        task = self._app.tasks.get(str(fields.get("function")))
        args = (fields.get("run_id"), fields.get("step_name"))
        if task is not None:
            from billiard.einfo import ExceptionInfo

            einfo = ExceptionInfo((type(exc), exc, exc.__traceback__))
            signals.task_failure.send(sender=task, task_id=fields.get("task_id"),
                                      exception=exc, args=args, kwargs={},
                                      traceback=exc.__traceback__, einfo=einfo)
        self._sentry.capture(exc, fields, args)

    @cached_property
    def _sentry(self) -> _Sentry:
        return _Sentry()


class _Sentry:
    """sentry-sdk's side, when it is installed (imported on first use, not before)."""

    def __init__(self) -> None:
        try:
            import sentry_sdk
            from sentry_sdk.integrations.celery import CeleryIntegration
        except ImportError:
            self._sdk: Any = None
            return
        self._sdk, self._integration = sentry_sdk, CeleryIntegration

    def _active(self) -> bool:
        sdk = self._sdk
        return sdk is not None and sdk.get_client().get_integration(self._integration) is not None

    def tag_task_scope(self, fields: dict[str, Any]) -> None:
        """A sent step's attempt: tag the scope its task runs in (only inside that task,
        whose scope the integration opened and closes)."""
        request = getattr(current_task, "request", None) if current_task else None
        if (not self._active() or request is None
                or getattr(request, "id", None) != fields.get("task_id")):
            return
        self._sdk.get_isolation_scope().set_tags(tags(fields))

    def capture(self, exc: BaseException, fields: dict[str, Any], args: tuple[Any, ...]
                ) -> None:
        if not self._active():
            return
        sdk = self._sdk
        from sentry_sdk.utils import event_from_exception

        client = sdk.get_client()
        event, hint = event_from_exception(exc, client_options=client.options,
                                           mechanism={"type": "celery", "handled": False})
        name = str(fields.get("function"))
        task_id = fields.get("task_id")

        def as_the_step(event: Any, hint: Any) -> Any:
            # Runs after the processors of the orchestrating task's scope (the current
            # scope's run last): the event is the step's, not ``orchestrate``'s.
            event.setdefault("tags", {}).update({"celery_task_id": task_id, **tags(fields)})
            # The message's arguments are pikku's ids (run, step), never the step's data.
            job = {"task_name": name, "args": list(args), "kwargs": {}}
            event.setdefault("extra", {})["celery-job"] = job
            event["transaction"] = name
            return event

        with sdk.new_scope() as scope:
            scope.add_event_processor(as_the_step)
            sdk.capture_event(event, hint=hint)


def install(pikku: Any) -> Observer | None:
    """Always installed: ``task_failure`` is Celery's, and Sentry is looked for when a step
    fails (an initialised client with the Celery integration), not before."""
    return StepFailures(pikku.app)
