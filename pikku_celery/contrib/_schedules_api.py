"""The JSON API's schedule routes (``_api.ROUTES``), free of any web framework:

- ``GET api/schedules`` (action ``read``, asked with ``run_id`` ``None``): the schedules
  whose runs the caller's run filter keeps (``_readable``; an unknown name and a hidden one
  are both a 404 below), by name (``pikku.list_schedules``), each as
  ``schedule_views.schedule_json`` serves it (its record, with ``timing``: ``cron ...``
  or ``every ...``), its ``data`` through the ``redact_value`` hook (``served``);
- ``POST api/schedules/<name>/pause``, ``/resume`` (``pikku.pause_schedule``,
  ``resume_schedule``): 200 with ``{"paused": bool}`` / ``{"resumed": bool}`` (``false``:
  it already was / was not paused) and the schedule as it is now;
- ``POST api/schedules/<name>/trigger`` (``pikku.trigger_schedule``): 202 with the new
  run's ``run_id``.

Each POST is its own action (``pause_schedule``, ``resume_schedule``,
``trigger_schedule``, asked with ``run_id`` ``None``), takes an empty body (or ``{}``) and
goes through the size, type and cross-site checks of every POST. An unknown name is a 404
(``ScheduleNotFoundError``), not the 400 of ``InvalidInputError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib._access import ApiError, Caller
from pikku_celery.contrib._readable import readable_schedule, readable_schedules
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import WorkflowSchedule
from pikku_celery.model.redaction import redact_value
from pikku_celery.operate.schedule_views import schedule_json

Response = tuple[int, Any]


def served(pikku: PikkuCelery, schedule: WorkflowSchedule) -> dict[str, Any]:
    """The schedule as served: its ``data`` (a copy) through the ``redact_value`` hook."""
    found = schedule_json(schedule)
    found["data"] = redact_value(found.get("data"), "schedule_data",
                                 pikku.settings.redact_value)
    return found


def list_schedules(pikku: PikkuCelery, caller: Caller) -> Response:
    return 200, {"schedules": [served(pikku, s) for s in readable_schedules(pikku, caller)]}


def known(pikku: PikkuCelery, caller: Caller, name: str) -> WorkflowSchedule:
    """The schedule ``name``, or a 404 (also for one the caller's run filter hides)."""
    try:
        return readable_schedule(pikku, caller, name)
    except InvalidInputError:
        raise ApiError(404, "ScheduleNotFoundError", f"no schedule named {name!r}") from None


def _no_body(body: Any) -> None:
    if body is None or (isinstance(body, Mapping) and not body):
        return
    raise InvalidInputError("the body must be empty or {}: this route takes nothing")


def pause(pikku: PikkuCelery, caller: Caller, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, caller, name)
    paused = pikku.pause_schedule(name)
    return 200, {"paused": paused, "schedule": served(pikku, pikku.get_schedule(name))}


def resume(pikku: PikkuCelery, caller: Caller, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, caller, name)
    resumed = pikku.resume_schedule(name)
    return 200, {"resumed": resumed, "schedule": served(pikku, pikku.get_schedule(name))}


def trigger(pikku: PikkuCelery, caller: Caller, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, caller, name)
    return 202, {"run_id": pikku.trigger_schedule(name)}
