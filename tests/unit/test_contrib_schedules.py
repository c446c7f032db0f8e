"""Schedules over the JSON API, the same for Flask and Django (issue 26 item 2):
``GET api/schedules`` lists them (action ``read``); ``POST api/schedules/<name>/pause``,
``/resume`` and ``/trigger`` are each their own action, asked with ``run_id`` ``None``;
an unknown schedule is a 404; the body is empty or ``{}``, size-limited; a run's JSON
carries ``schedule`` and ``scheduled_for``; queued runs (concurrency limits) are listed and
filtered like any other status. Who may call them (anonymous, without the
action, CSRF, cross-site) is in ``test_contrib.py``'s endpoint tables."""

from __future__ import annotations

import json

import pytest

from pikku_celery.contrib._access import ACTIONS
from pikku_celery.store.base import NewRun
from tests.support.operate import now_ms
from tests.unit.test_contrib import (
    PREFIX,
    Web,
    calls,
    reconfigured,
    running_run,
    web,
)

__all__ = ["web"]  # the fixture: Flask and Django


def test_the_schedule_actions_are_actions() -> None:
    assert {"pause_schedule", "resume_schedule", "trigger_schedule"} <= set(ACTIONS)


def test_list_pause_resume_and_trigger_over_http(web: Web) -> None:
    pikku, call = web.pikku, web.call
    assert call("GET", PREFIX + "/schedules") == (200, {"schedules": []})  # none saved
    status, paused = call("POST", PREFIX + "/schedules/nightly/pause", {})
    assert status == 200, paused
    assert paused["paused"] is True and paused["schedule"]["paused"] is True
    assert calls[-1] == ("pause_schedule", None)
    assert call("POST", PREFIX + "/schedules/nightly/pause", {})[1]["paused"] is False

    status, listed = call("GET", PREFIX + "/schedules")
    assert status == 200
    [nightly] = listed["schedules"]
    assert {k: nightly[k] for k in ("name", "workflow", "timing", "every", "cron", "tz",
                                    "catch_up", "paused", "declared", "data",
                                    "last_run_id")} == {
        "name": "nightly", "workflow": "sum", "timing": "every 1h", "every": 3600,
        "cron": None, "tz": "UTC", "catch_up": "latest", "paused": True, "declared": True,
        "data": {"a": 1, "b": 2}, "last_run_id": None}
    assert nightly["next_at"].endswith("+00:00") and nightly["last_at"] is None
    assert calls[-1] == ("read", None)

    status, triggered = call("POST", PREFIX + "/schedules/nightly/trigger", {})
    assert status == 202, triggered
    run_id = triggered["run_id"]
    assert calls[-1] == ("trigger_schedule", None)
    status, run = call("GET", PREFIX + f"/runs/{run_id}")
    assert status == 200
    stored = pikku.get_run(run_id)
    assert stored.scheduled_for is not None
    assert (run["schedule"], run["scheduled_for"]) == (
        "nightly", stored.scheduled_for.isoformat())
    plain = running_run(pikku)
    assert [(r["run_id"], r["schedule"], r["scheduled_for"])
            for r in call("GET", PREFIX + "/runs")[1]["runs"]] == [
        (plain, None, None), (run_id, "nightly", stored.scheduled_for.isoformat())]

    status, resumed = call("POST", PREFIX + "/schedules/nightly/resume", {})
    assert (status, resumed["resumed"], resumed["schedule"]["paused"]) == (200, True, False)
    assert calls[-1] == ("resume_schedule", None)
    assert call("POST", PREFIX + "/schedules/nightly/resume", {})[1]["resumed"] is False


@pytest.mark.parametrize("verb", ["pause", "resume", "trigger"])
def test_an_unknown_schedule_is_404(web: Web, verb: str) -> None:
    status, payload = web.call("POST", PREFIX + f"/schedules/nope/{verb}", {})
    assert (status, payload["error"]) == (404, "ScheduleNotFoundError")
    assert payload["message"] == "no schedule named 'nope'"
    assert web.pikku.list_runs() == []


@pytest.mark.parametrize("verb", ["pause", "resume", "trigger"])
def test_a_body_with_fields_is_400_and_a_big_one_413(web: Web, verb: str) -> None:
    status, payload = web.call("POST", PREFIX + f"/schedules/nightly/{verb}", {"x": 1})
    assert (status, payload["error"]) == (400, "InvalidInputError")
    assert web.call("POST", PREFIX + f"/schedules/nightly/{verb}", [1])[0] == 400
    with reconfigured(web, MAX_BODY_BYTES=100):
        big = json.dumps({"x": "x" * 100})
        status, payload = web.call("POST", PREFIX + f"/schedules/nightly/{verb}", raw=big)
        assert (status, payload["error"]) == (413, "RequestTooLarge")
    assert web.pikku.list_runs() == []
    assert not any(s.paused for s in web.pikku.list_schedules())


def test_queued_runs_are_listed_and_filtered(web: Web) -> None:
    store = web.pikku.engine.store
    store.create_run(NewRun("q-1", "sum", {"a": 1, "b": 1}), now_ms())
    assert store.transition_run("q-1", ["running"], "queued", now_ms())
    running_run(web.pikku)
    status, listed = web.call("GET", PREFIX + "/runs?status=queued")
    assert status == 200, listed
    assert [(r["run_id"], r["status"]) for r in listed["runs"]] == [("q-1", "queued")]
    assert web.call("GET", PREFIX + "/runs/q-1")[1]["status"] == "queued"
    assert web.call("GET", PREFIX + "/runs?status=waiting")[0] == 400


def test_a_run_filter_hides_the_schedules_whose_runs_it_would_hide(web: Web) -> None:
    """A caller restricted by PIKKU_RUN_FILTER sees, pauses and triggers only the schedules
    whose runs (their input, the schedule's data) the filter keeps; another is a 404, and
    nothing is done to it."""
    web.pikku.pause_schedule("nightly")  # saved: data {"a": 1, "b": 2}
    web.pikku.resume_schedule("nightly")
    with reconfigured(web, RUN_FILTER=lambda request: {"input.a": 2}):
        assert web.call("GET", PREFIX + "/schedules") == (200, {"schedules": []})
        for verb in ("pause", "trigger"):
            status, body = web.call("POST", PREFIX + f"/schedules/nightly/{verb}", {})
            assert (status, body["error"]) == (404, "ScheduleNotFoundError"), body
    assert web.pikku.get_schedule("nightly").paused is False
    assert web.pikku.list_runs() == []
    with reconfigured(web, RUN_FILTER=lambda request: {"input.a": 1}):
        status, listed = web.call("GET", PREFIX + "/schedules")
        assert [s["name"] for s in listed["schedules"]] == ["nightly"]
