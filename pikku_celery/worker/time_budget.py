"""An app-wide Celery time limit as a budget for steps run in place (issue 34).

A step run in place runs inside the task that ran the pass, under that task's limits, not
under its own. On a pool that enforces limits (prefork, gevent) an app-wide
``task_time_limit`` or ``task_soft_time_limit`` used to send every step as its own task.
Instead, the messages pikku sends (orchestrate, timer and step tasks) carry the app's limits
plus a margin, and a step runs in place only while the running task's remaining limits still
cover the step's whole limit; after that the step is sent, and its task starts with the full
budget again. The margin is the smaller of ``pikku_in_place_for`` and a tenth of the
smallest limit, so a step is stopped no earlier than its limit and at most the margin later
than a task sent with the app's own limit would be.

A timeline with ``task_time_limit=300`` (margin 10 s)::

    t=0     orchestrate starts; its message says 310 s
    t=0.2   s1 runs in place: 309.8 s left, at least the 300 s its own task would have
    t=4     s2 runs in place: 306 s left
    t=10.1  s3 is sent: 299.9 s left would cut it short; its task has 310 s again

A step with a time limit of its own, or a running task with one of its own class, is never
run in place (its limit differs from what the budget accounts for).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Task

# The pool starts a task's timers when its child accepts the job, a moment before the body
# starts (when the start is noted): the remaining time is counted as this much shorter.
START_SLACK_S = 0.1
# The margin is at most this share of the smallest app-wide limit.
MARGIN_SHARE = 0.1

_started = threading.local()


def task_started(task_id: str | None) -> None:
    """The body of one of pikku's tasks starts: when it did, for the budget of the steps its
    passes may run in place (per thread: a threads or gevent pool runs many at once)."""
    _started.task = (task_id, time.monotonic())


def own_limits(task: Task) -> bool:
    """Whether ``task`` has a time limit of its own (its class or decorator), not the app's.
    Celery copies the app's limits onto a task class bound after they were set, so a limit
    equal to the app's is the app's (and is the same limit either way)."""
    hard, soft = app_limits(task)
    return bool((task.time_limit and task.time_limit != hard)
                or (task.soft_time_limit and task.soft_time_limit != soft))


def app_limits(task: Task) -> tuple[float | None, float | None]:
    conf = task.app.conf
    return conf.task_time_limit or None, conf.task_soft_time_limit or None


def margin_s(limits: tuple[float | None, float | None], in_place_ms: int) -> float:
    set_limits = [limit for limit in limits if limit]
    if not set_limits:
        return 0.0
    return min(in_place_ms / 1000, MARGIN_SHARE * min(set_limits))


def message_limits(task: Task, in_place_ms: int) -> dict[str, float]:
    """The time limits of a message pikku sends to ``task``: the app's plus the margin, when
    the app sets one and the task has none of its own (Celery puts those in the message)."""
    if in_place_ms <= 0 or own_limits(task):
        return {}
    limits = app_limits(task)
    margin = margin_s(limits, in_place_ms)
    if not margin:
        return {}
    hard, soft = limits
    options = {}
    if hard:
        options["time_limit"] = hard + margin
    if soft:
        options["soft_time_limit"] = soft + margin
    return options


def covers(current: Task, step: Task) -> bool:
    """Whether the task running now (``current``) has time enough left to run ``step`` in
    place: for each limit the step would have as its own task, the running task's (its
    message's, else the app's) minus what it has spent is at least as long; a limit the
    running task has and the step would not have: no."""
    if own_limits(step) or own_limits(current):
        return False
    wanted = app_limits(step)
    request = current.request
    sent = (*(request.timelimit or ()), None, None)
    running = (sent[0] or wanted[0], sent[1] or wanted[1])
    if running == (None, None):
        return True
    noted = getattr(_started, "task", None)
    if noted is None or noted[0] != request.id:
        return False  # not one of pikku's tasks, or its start was not noted: no budget known
    spent_s = time.monotonic() - noted[1] + START_SLACK_S
    for have, need in zip(running, wanted, strict=True):
        if have is not None and (need is None or have - spent_s < need):
            return False
    return True


def limits_note(task: Task, in_place_ms: int) -> str:
    """How the budget works for the worker's start line, e.g. ``for the first 10 s of each
    task (pikku's messages carry task_time_limit=310.0)``."""
    options: dict[str, Any] = message_limits(task, in_place_ms)
    margin = margin_s(app_limits(task), in_place_ms)
    carried = ", ".join(f"{'task_' + name}={value:g}" for name, value in options.items())
    return (f"steps run in place for the first {margin:g} s of each task, less the time "
            f"already spent (pikku's messages carry {carried}, the app's limits plus "
            f"{margin:g} s, so a step in place always has at least its own limit left)")
