"""Why steps will be sent as messages instead of run in place, said once when a worker
starts. Running in place is what makes a workflow faster than a Celery chain, and the
reasons it is off or bounded (a step's own time limit or rate limit, a limit on pikku's
orchestrate task, the settings, an app-wide time limit as a budget) are silent otherwise: a
user sees only a slower worker (issue 34). On a pool that enforces no time limit (threads,
solo), a limit sends nothing, and the worker says that instead."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from pikku_celery.worker.task_names import ORCHESTRATE_KIND, internal_task
from pikku_celery.worker.time_budget import limits_note, own_limits

#: At most this many steps named in the line; the rest are counted.
NAMED = 10


def sent_reasons(app: Celery, step_names: list[str], *, continue_in_place: bool,
                 in_place_steps: int, in_place_ms: int, limits_enforced: bool = True,
                 pool: str | None = None) -> list[str]:
    """The lines to log: empty when every step may run in place. ``limits_enforced``:
    whether the worker's pool (``pool``) enforces time limits (``pool_limits``)."""
    if not continue_in_place or in_place_steps <= 0:
        setting = ("pikku_continue_in_place is off" if not continue_in_place
                   else "pikku_in_place_steps is 0")
        return [f"pikku: every step is sent as a task of its own, none runs in place: "
                f"{setting}"]
    app_wide = _limits(app.conf.task_time_limit, app.conf.task_soft_time_limit,
                       "task_time_limit", "task_soft_time_limit")
    orchestrate = internal_task(app, ORCHESTRATE_KIND)
    own = _task_limits(orchestrate) if own_limits(orchestrate) else ""
    lines = []
    if (app_wide or own) and not limits_enforced:
        lines.append(f"pikku: this worker's pool ({pool}) enforces no time limit, so "
                     f"{app_wide or f'{orchestrate.name} having {own}'} sends no step: steps "
                     f"run in place")
    elif own:
        return [f"pikku: every step is sent as a task of its own, none runs in place: "
                f"{orchestrate.name} has {own}"]
    elif app_wide:
        lines.append(f"pikku: the app sets {app_wide}: {limits_note(orchestrate, in_place_ms)}")
    limited = []
    for name in sorted(step_names):
        task = app.tasks.get(name)
        if task is None:
            continue
        reason = _task_limits(task) if limits_enforced and own_limits(task) else ""
        if task.rate_limit:
            reason = ", ".join(filter(None, (reason, f"rate_limit={task.rate_limit!r}")))
        if reason:
            limited.append(f"{name} ({reason})")
    if not limited:
        return lines
    named = ", ".join(limited[:NAMED])
    more = f" and {len(limited) - NAMED} more" if len(limited) > NAMED else ""
    return [*lines, f"pikku: these steps are sent as tasks of their own, never run in place "
            f"(a step run in place would run inside the limits of the task that runs it): "
            f"{named}{more}"]


def _task_limits(task: Task) -> str:
    return _limits(task.time_limit, task.soft_time_limit, "time_limit", "soft_time_limit")


def _limits(hard: Any, soft: Any, hard_name: str, soft_name: str) -> str:
    return ", ".join(f"{name}={value}" for name, value in ((hard_name, hard), (soft_name, soft))
                     if value)
