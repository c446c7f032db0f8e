"""The dashboard's Schedules page (``<mount>/schedules``, linked from every page's header):
every schedule in the store (``pikku.list_schedules``), each with its workflow, timing, time
zone, catch-up, state (paused or active; "not declared" when this code no longer declares
it), next and latest tick, the run the latest tick started and its data (through the
``redact_value`` hook).

Each schedule gets Pause or Resume (by its state) and Trigger forms
(``<mount>/schedules/<name>/pause|resume|trigger``), each authorized as its own action
(``pause_schedule``, ``resume_schedule``, ``trigger_schedule``, asked with ``run_id``
``None`` and told the schedule: ``authorize(..., schedule=name)``) and CSRF-checked by the
adapter like the run page's buttons; a caller without the action sees why there is no
form. The schedules the caller's run filter hides are neither listed nor named among
those "declared here but not in the store yet". A pause or resume goes back to the page with a
notice; a trigger goes to the new run's page. A refused action (the schedule already
paused, not paused, or unknown) re-renders the page with the reason (409, 404).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from pikku_celery.contrib._access import (
    PAUSE_SCHEDULE,
    RESUME_SCHEDULE,
    SCHEDULE_ACTIONS,
    TRIGGER_SCHEDULE,
)
from pikku_celery.contrib._json import present
from pikku_celery.contrib._readable import (
    readable_schedule,
    readable_schedules,
    unsaved_schedules,
)
from pikku_celery.dashboard._pages import ENV, Dashboard, Page, View, segment
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import WorkflowSchedule
from pikku_celery.model.validate import check_name
from pikku_celery.operate.schedule_views import state_text, timing_text

#: The path segment of each action's form: ``schedules/<name>/<verb>``.
VERBS = {PAUSE_SCHEDULE: "pause", RESUME_SCHEDULE: "resume", TRIGGER_SCHEDULE: "trigger"}
#: ``?notice=<code>`` after a form: the page shows the text of a known code, nothing else.
NOTICES = {"paused": "schedule paused: it starts nothing until resumed",
           "resumed": "schedule resumed: it goes on from its next tick"}
FORMLESS = "no forms here (the app has no SECRET_KEY)"


@dataclass(frozen=True)
class ScheduleRefusal:
    """An action refused on the schedule ``name``, shown on the page with the reason."""

    name: str
    message: str


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule of the page; ``allowed``: the actions whose form it gets (each asked
    of ``authorize`` told the schedule)."""

    schedule: WorkflowSchedule
    timing: str
    state: str
    data: Any
    allowed: dict[str, bool]


def schedules_page(board: Dashboard, view: View) -> Page:
    return board.guarded(view.base, lambda: _render(board, view))


def act_on_schedule(board: Dashboard, view: View, name: str, action: str) -> Page:
    """A schedule form's POST (authorized for ``action`` and CSRF-checked by the adapter):
    pause or resume, then back to the page; trigger, then the new run's page."""
    def act() -> Page:
        check_name("schedule name", name)
        pikku = board.pikku
        try:
            readable_schedule(pikku, view.caller, name)
        except InvalidInputError:
            return _render(board, view, ScheduleRefusal(name, f"no schedule named {name!r}"),
                           404)
        if action == TRIGGER_SCHEDULE:
            run_id = pikku.trigger_schedule(name)
            return Page(303, redirect=f"{view.base}runs/{segment(run_id)}?"
                        + urlencode({"notice": "triggered"}))
        if action == PAUSE_SCHEDULE:
            done, code = pikku.pause_schedule(name), "paused"
            why = f"schedule {name!r} is already paused: nothing to pause"
        else:
            done, code = pikku.resume_schedule(name), "resumed"
            why = f"schedule {name!r} is not paused: nothing to resume"
        if not done:
            return _render(board, view, ScheduleRefusal(name, why), 409)
        return Page(303, redirect=f"{view.base}schedules?" + urlencode({"notice": code}))
    return board.guarded(view.base, act)


def _render(board: Dashboard, view: View, refusal: ScheduleRefusal | None = None,
            status: int = 200) -> Page:
    stored = board.pikku.list_schedules()
    rows = [ScheduleRow(s, timing_text(s), state_text(s),
                        present({"data": s.data}, show_tracebacks=False)["data"],
                        {action: view.csrf is not None
                         and view.can(action, None, schedule=s.name)
                         for action in SCHEDULE_ACTIONS})
            for s in readable_schedules(board.pikku, view.caller, stored)]
    why_not = None
    if view.csrf is None:
        why_not = FORMLESS
    elif rows and not any(any(r.allowed.values()) for r in rows):
        why_not = "you may not pause, resume or trigger schedules"
    return Page(status, ENV.get_template("schedules.html").render(
        view=view, home=view.base, rows=rows, verbs=VERBS, why_not=why_not,
        redact=board.pikku.settings.redact_value,
        refusal=refusal, unsaved=unsaved_schedules(board.pikku, view.caller, stored),
        notice=NOTICES.get(view.query.get("notice") or "")))
