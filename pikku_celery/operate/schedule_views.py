"""How a schedule (``pikku.schedule``) and a scheduled run read, alike in the ``pikku``
commands, the JSON API and the dashboard: its timing (``cron 0 3 * * *`` or ``every
10m``), whether it ticks, and the tick a run was started for."""

from __future__ import annotations

from typing import Any

from pikku_celery.model.records import WorkflowRun, WorkflowSchedule

PAUSED, ACTIVE = "paused", "active"
#: Shown for a stored schedule no longer declared by the code of this process.
NOT_DECLARED = "not declared"
_UNITS = ((86_400, "d"), (3_600, "h"), (60, "m"))


def every_text(seconds: float) -> str:
    """``every=`` in its largest whole unit: ``1d``, ``6h``, ``10m``, ``90s``, ``0.5s``."""
    for size, unit in _UNITS:
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def timing_text(schedule: WorkflowSchedule) -> str:
    """``cron <expression>`` or ``every <interval>``."""
    if schedule.cron is not None:
        return f"cron {schedule.cron}"
    if schedule.every is not None:
        return f"every {every_text(schedule.every)}"
    return "-"


def state_text(schedule: WorkflowSchedule) -> str:
    """``paused`` or ``active``, and ``not declared`` when no code here declares it."""
    state = PAUSED if schedule.paused else ACTIVE
    return state if schedule.declared else f"{state}, {NOT_DECLARED}"


def schedule_json(schedule: WorkflowSchedule) -> dict[str, Any]:
    """The schedule as JSON (``to_json`` of the record), with its timing as shown."""
    from pikku_celery.contrib._json import to_json

    served: dict[str, Any] = to_json(schedule)
    served["timing"] = timing_text(schedule)
    return served


def is_scheduled(run: WorkflowRun) -> bool:
    return run.schedule is not None
