"""Schedules on the dashboard, the same for Flask and Django (issue 26 item 2): a Schedules
page (linked from every page's header) lists each schedule with its timing, state, ticks
and last run, and Pause/Resume and Trigger forms, each authorized as its own action
(``pause_schedule``, ``resume_schedule``, ``trigger_schedule``, asked with ``run_id``
``None``) and CSRF-checked like the run page's buttons; a refused action re-renders the
page with the reason. Runs started by a schedule show it and their tick on the runs list
and the run page; queued runs (concurrency limits) are listed, counted and filtered.
``tests/integration/test_dashboard_schedules_browser.py`` drives the page in Chromium."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery.dashboard import _pages
from pikku_celery.store.base import NewRun
from tests.support.operate import now_ms
from tests.unit.test_contrib import EVIL, authorize, make_pikku, with_schedule
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site
from tests.unit.test_dashboard_events import block

SCHEDULES = f"{BASE}schedules"


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    pikku = with_schedule(make_pikku())
    pikku.schedule("daily", "sum", cron="0 6 * * 1-5", tz="Europe/Helsinki",
                   data={"a": 5, "b": 5})
    for name in ("nightly", "daily"):
        pikku.get_schedule(name)  # saved, as a worker does when it starts
    yield flask_site(pikku) if request.param == "flask" else django_site(pikku)


def row(text: str, name: str) -> str:
    return block(text, f"schedule-{name}", "tr")


def action(name: str, verb: str) -> str:
    return f"{SCHEDULES}/{name}/{verb}"


def test_the_page_lists_the_schedules_with_forms(site: Site) -> None:
    runs = site.get(BASE)
    assert f'<a href="{SCHEDULES}" id="nav-schedules">Schedules</a>' in runs.text
    page = site.get(SCHEDULES)
    assert page.status == 200, page.text
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")
    daily = row(page.text, "daily")
    assert 'data-paused="false"' in daily
    assert "cron 0 6 * * 1-5" in daily and "Europe/Helsinki" in daily and "latest" in daily
    assert '<span class="badge s-active">active</span>' in daily
    assert f'action="{action("daily", "pause")}"' in daily
    assert f'action="{action("daily", "trigger")}"' in daily
    assert f'action="{action("daily", "resume")}"' not in daily
    nightly = row(page.text, "nightly")
    assert "every 1h" in nightly and "UTC" in nightly
    assert f'href="{BASE}?workflow=sum"' in nightly
    assert "&#34;a&#34;: 1" in nightly  # its data, escaped
    assert 'id="unsaved"' not in page.text

    site.pikku.registry.schedules.pop("daily")  # the code no longer declares it
    site.pikku.schedule("weekly", "sum", cron="0 0 * * 0", data={"a": 0, "b": 0})
    page = site.get(SCHEDULES)
    assert 'class="muted not-declared">not declared<' in row(page.text, "daily")
    assert "not declared" not in row(page.text, "nightly")
    assert "not in the store yet (a worker saves them when it starts): weekly" in page.text


def test_pause_resume_and_trigger_through_the_forms(site: Site) -> None:
    pikku = site.pikku
    field, token = site.get(SCHEDULES).form_token()
    paused = site.post(action("nightly", "pause"), {field: token})
    assert paused.status == 303, paused.text
    assert paused.headers["Location"].endswith(f"{SCHEDULES}?notice=paused")
    assert pikku.get_schedule("nightly").paused
    page = site.get(paused.headers["Location"])
    assert 'id="notice">schedule paused: it starts nothing until resumed<' in page.text
    nightly = row(page.text, "nightly")
    assert 'data-paused="true"' in nightly and "s-paused" in nightly
    assert f'action="{action("nightly", "resume")}"' in nightly
    assert f'action="{action("nightly", "pause")}"' not in nightly

    again = site.post(action("nightly", "pause"), {field: token})  # a stale page's form
    assert again.status == 409
    refused = block(again.text, "schedule-refused", "p")
    assert "schedule &#39;nightly&#39; is already paused: nothing to pause" in refused
    assert 'id="schedules"' in again.text  # the page, re-rendered

    triggered = site.post(action("nightly", "trigger"), {field: token})
    assert triggered.status == 303
    location = triggered.headers["Location"]
    assert location.endswith("?notice=triggered") and f"{BASE}runs/" in location
    [run] = pikku.list_runs()
    assert run.schedule == "nightly" and run.scheduled_for is not None
    assert pikku.get_schedule("nightly").paused  # the trigger did not resume it
    run_page = site.get(location)
    assert "run started: its schedule was triggered" in run_page.text
    assert f'id="run-schedule" href="{SCHEDULES}#schedule-nightly">nightly<' in run_page.text
    shown = _pages.format_time(run.scheduled_for)
    assert f'id="run-scheduled-for">{shown}<' in run_page.text
    listed = block(site.get(BASE).text, "runs", "table")
    assert f'href="{SCHEDULES}#schedule-nightly">nightly</a> · {shown}' in listed

    resumed = site.post(action("nightly", "resume"), {field: token})
    assert resumed.headers["Location"].endswith(f"{SCHEDULES}?notice=resumed")
    assert not pikku.get_schedule("nightly").paused
    again = site.post(action("nightly", "resume"), {field: token})
    assert again.status == 409
    assert "is not paused: nothing to resume" in html.unescape(again.text)


def test_an_unknown_schedule_re_renders_the_page_with_404(site: Site) -> None:
    field, token = site.get(SCHEDULES).form_token()
    for verb in ("pause", "resume", "trigger"):
        answer = site.post(action("nope", verb), {field: token})
        assert answer.status == 404, verb
        assert "no schedule named &#39;nope&#39;" in block(answer.text, "schedule-refused",
                                                            "p")
    assert site.pikku.list_runs() == []


def test_a_reader_sees_no_forms_and_is_refused(site: Site) -> None:
    page = site.get(SCHEDULES, user="reader")
    assert page.status == 200
    assert "<form" not in block(page.text, "schedules", "table")
    assert "you may not pause, resume or trigger schedules" in page.text
    field, token = site.token("reader")
    for verb, name in (("pause", "pause_schedule"), ("trigger", "trigger_schedule")):
        refused = site.post(action("nightly", verb), {field: token}, user="reader")
        assert refused.status == 403 and f"not allowed to {name}" in refused.text
    assert site.get(SCHEDULES, user="nobody").status == 403
    assert site.get(SCHEDULES, user=None).status in (401, 403)
    assert site.post(action("nightly", "pause"), {field: token}, user=None).status in (
        401, 403)
    assert not site.pikku.get_schedule("nightly").paused and site.pikku.list_runs() == []


def may_only_trigger(request: Any, action: str, run_id: str | None) -> bool:
    return authorize(request, action, run_id) and action in ("read", "trigger_schedule")


def test_each_form_is_its_own_action(site: Site) -> None:
    pikku = site.pikku
    other = (flask_site(pikku, PIKKU_AUTHORIZE=may_only_trigger)
             if site.framework == "flask"
             else django_site(pikku, PIKKU_AUTHORIZE=may_only_trigger))
    page = other.get(SCHEDULES)
    nightly = row(page.text, "nightly")
    assert "/trigger" in nightly and "/pause" not in nightly
    field, token = page.form_token()
    assert other.post(action("nightly", "pause"), {field: token}).status == 403
    assert not pikku.get_schedule("nightly").paused
    assert other.post(action("nightly", "trigger"), {field: token}).status == 303


def test_csrf_size_and_cross_site_are_checked(site: Site) -> None:
    field, token = site.get(SCHEDULES).form_token()
    for form in ({"x": "1"}, {field: "y" * len(token)}):
        refused = site.post(action("nightly", "pause"), form)
        assert refused.status == 403 and "CSRF" in refused.text, form
    big = {field: token, "pad": "x" * _pages.MAX_FORM_BYTES}
    assert site.post(action("nightly", "pause"), big).status == 413
    assert site.post(action("nightly", "pause"), "{}", content_type="application/json",
                     headers={"X-CSRFToken": token}).status == 415
    if site.framework == "flask":
        assert site.post(action("nightly", "trigger"), {field: token},
                         headers=EVIL).status == 403
    assert not site.pikku.get_schedule("nightly").paused and site.pikku.list_runs() == []


def test_queued_runs_are_listed_counted_and_filtered(site: Site) -> None:
    store = site.pikku.engine.store
    store.create_run(NewRun("q-1", "sum", {"a": 1, "b": 1}), now_ms())
    assert store.transition_run("q-1", ["running"], "queued", now_ms())
    site.pikku.start("sum", {"a": 2, "b": 2}, run_id="r-1")
    page = site.get(BASE)
    counts = block(page.text, "counts", "div")
    assert re.search(r'data-status="queued"><b>1</b><small>queued</small>', counts)
    assert '<option value="queued">queued</option>' in page.text
    assert '<span class="badge s-queued">queued</span>' in block(page.text, "runs", "table")
    assert ".s-queued {" in page.text  # styled
    filtered = site.get(f"{BASE}?status=queued")
    assert re.findall(r'<tr data-run-id="([^"]+)"', filtered.text) == ["q-1"]
    assert 'id="run-status">queued<' in site.get(f"{BASE}runs/q-1").text


@pytest.mark.parametrize("framework", ["flask", "django"])
def test_a_run_filter_hides_the_schedules_whose_runs_it_would_hide(framework: str) -> None:
    """The page lists only the schedules whose runs (their input: the schedule's data) the
    caller's PIKKU_RUN_FILTER keeps, as the JSON API does."""
    pikku = with_schedule(make_pikku())  # nightly: data {"a": 1, "b": 2}
    pikku.schedule("daily", "sum", cron="0 6 * * 1-5", data={"a": 5, "b": 5})
    for name in ("nightly", "daily"):
        pikku.get_schedule(name)
    only_fives = {"PIKKU_RUN_FILTER": lambda request: {"input.a": 5}}
    site = (flask_site(pikku, **only_fives) if framework == "flask"
            else django_site(pikku, **only_fives))
    page = site.get(SCHEDULES)
    assert page.status == 200, page.text
    assert 'id="schedule-daily"' in page.text
    assert 'id="schedule-nightly"' not in page.text
