"""Signals, Celery-style: connect a receiver to follow runs and step attempts.

    from pikku_celery import signals

    @signals.step_attempt_finished.connect
    def on_attempt(sender, run_id, step_name, attempt, status, duration, **kwargs):
        metrics.timing(f"step.{step_name}.{status}", duration)

They are ``celery.utils.dispatch.Signal`` objects, like ``celery.signals``: receivers take
``sender`` and keyword arguments (accept ``**kwargs``: fields may be added), ``connect(sender=
...)`` filters by sender, and a receiver that raises is logged and never stops the engine.
Each is sent in the process that did the work (the worker that ran the attempt, the process
that drove the pass), after the store recorded it.

===========================  ===============  =============================================
signal                       sender           fields (besides ``pikku``, the instance)
===========================  ===============  =============================================
``run_started``              workflow name    ``run_id``, ``workflow``, ``parent_run_id``
``run_finished``             workflow name    ``run_id``, ``workflow``, ``status``
                                              (``completed``/``failed``/``cancelled``),
                                              ``output``, ``error``, ``duration`` (seconds
                                              since the run was created)
``step_attempt_started``     step task name   ``run_id``, ``step_name``, ``attempt``,
                                              ``max_attempts``, ``function``, ``task_id``
                                              (the Celery task id of the delivery; for a
                                              step run in place, the id pikku gave the
                                              attempt; ``None`` for an inline delivery),
                                              ``worker``, ``in_place`` (``True`` when a
                                              pass ran the step itself, with no message
                                              of its own)
``step_attempt_finished``    step task name   the same, and ``status`` (``succeeded`` or
                                              ``failed``), ``result``, ``error``,
                                              ``retry_at`` (when the next attempt may start;
                                              ``None`` when none will), ``duration``,
                                              ``exception`` (the exception object of a
                                              failure; ``None`` otherwise)
``step_attempt_superseded``  step task name   the same as started, and ``status``
                                              (``superseded``), ``current_attempt``,
                                              ``duration``: the attempt's outcome was refused
===========================  ===============  =============================================

``run_started`` is sent once per run, by the process that created it (a repeated ``start``
with the same ``run_id`` sends nothing). An attempt whose worker died sends ``started`` and
nothing more: the reclaim that supersedes it happens in another process, which sends its own
attempt's signals.
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

from pikku_celery import observe
from pikku_celery.observe import Observer, tell

_STEP_FIELDS = {"pikku", "run_id", "step_name", "attempt", "max_attempts", "function",
                "task_id", "in_place"}

run_started = Signal(name="pikku_run_started",
                     providing_args={"pikku", "run_id", "workflow", "parent_run_id"})
run_finished = Signal(name="pikku_run_finished",
                      providing_args={"pikku", "run_id", "workflow", "status", "output",
                                      "error", "duration"})
step_attempt_started = Signal(name="pikku_step_attempt_started",
                              providing_args=_STEP_FIELDS | {"worker"})
step_attempt_finished = Signal(name="pikku_step_attempt_finished",
                               providing_args=_STEP_FIELDS | {"status", "result", "error",
                                                              "retry_at", "duration",
                                                              "exception"})
step_attempt_superseded = Signal(name="pikku_step_attempt_superseded",
                                 providing_args=_STEP_FIELDS | {"status", "current_attempt",
                                                                "duration"})

_BY_EVENT = {
    "run_started": run_started,
    "run_finished": run_finished,
    "step_attempt_started": step_attempt_started,
    "step_attempt_finished": step_attempt_finished,
    "step_attempt_superseded": step_attempt_superseded,
}


class SignalSender:
    """The engine's ``emit`` for one ``PikkuCelery``: each public event as its signal, and
    every event to the observers (``pikku_celery.observe``: traces, metrics, logs...)."""

    def __init__(self, pikku: Any, observers: list[Observer] | None = None) -> None:
        self._pikku = pikku
        self._observers = observe.install(pikku) if observers is None else observers

    def __call__(self, event: str, sender: str, **fields: Any) -> None:
        signal = _BY_EVENT.get(event)  # passes have no public signal
        if signal is not None and signal.receivers:  # the common case: one attribute read
            signal.send(sender=sender, pikku=self._pikku, **fields)
        if self._observers:
            tell(self._observers, event, sender, fields)


__all__ = ["run_finished", "run_started", "step_attempt_finished", "step_attempt_started",
           "step_attempt_superseded"]
