"""The JSON API's schedule routes (``_api.ROUTES``), free of any web framework:

- ``GET api/schedules`` (action ``read``, asked with ``run_id`` ``None``): every schedule
  in the store, by name (``pikku.list_schedules``), each as ``schedule_views.schedule_json``
  serves it (its record, with ``timing``: ``cron ...`` or ``every ...``);
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
from pikku_celery.contrib._access import ApiError
from pikku_celery.errors import InvalidInputError
from pikku_celery.records import WorkflowSchedule
from pikku_celery.schedule_views import schedule_json

Response = tuple[int, Any]


def list_schedules(pikku: PikkuCelery) -> Response:
    return 200, {"schedules": [schedule_json(s) for s in pikku.list_schedules()]}


def known(pikku: PikkuCelery, name: str) -> WorkflowSchedule:
    """The schedule ``name``, or a 404."""
    try:
        return pikku.get_schedule(name)
    except InvalidInputError:
        raise ApiError(404, "ScheduleNotFoundError", f"no schedule named {name!r}") from None


def _no_body(body: Any) -> None:
    if body is None or (isinstance(body, Mapping) and not body):
        return
    raise InvalidInputError("the body must be empty or {}: this route takes nothing")


def pause(pikku: PikkuCelery, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, name)
    paused = pikku.pause_schedule(name)
    return 200, {"paused": paused, "schedule": schedule_json(pikku.get_schedule(name))}


def resume(pikku: PikkuCelery, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, name)
    resumed = pikku.resume_schedule(name)
    return 200, {"resumed": resumed, "schedule": schedule_json(pikku.get_schedule(name))}


def trigger(pikku: PikkuCelery, name: str, body: Any) -> Response:
    _no_body(body)
    known(pikku, name)
    return 202, {"run_id": pikku.trigger_schedule(name)}
