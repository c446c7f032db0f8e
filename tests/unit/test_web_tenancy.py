"""Issue 35's tenancy items, each on Flask and Django: start is no oracle under
``PIKKU_RUN_FILTER`` (item 1), the filter constrains what a caller may start and
``authorize`` is told the input (item 2), ``authorize`` is told the event and the schedule
(item 5), the Schedules page names no schedule the filter hides (item 5) and a
percent-encoded ``?%74oken=`` never reaches the access log in clear (item 5)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from werkzeug.test import Client

from pikku_celery import PikkuCelery, WorkflowContext
from pikku_celery.contrib._access import SCHEDULE_ACTIONS, Caller, Rules
from pikku_celery.contrib._readable import hidden_run
from pikku_celery.dashboard import standalone
from tests.unit.test_contrib import PREFIX, calls, make_pikku, running_run, with_schedule
from tests.unit.test_dashboard import BASE
from tests.unit.test_dashboard_events import block
from tests.unit.test_dashboard_schedules import SCHEDULES, action, row
from tests.unit.test_web_security import framework, listed, my_runs, site_for, user_of, web_for

__all__ = ["framework"]  # the fixture: Flask and Django

START = PREFIX + "/workflows/sum/runs"


def signed_in(request: Any, action: str, run_id: str | None) -> bool:
    """A 3-argument rule letting every signed-in user do everything: the run filter alone
    keeps the tenants apart."""
    return user_of(request) is not None


def with_tenants(pikku: PikkuCelery) -> PikkuCelery:
    """``pikku`` with ``per_owner``: one run at a time per ``owner`` of its input."""
    @pikku.workflow("per_owner", concurrency=1, concurrency_key=lambda data: data["owner"])
    def per_owner(wf: WorkflowContext, data: Any) -> Any:
        return data

    return pikku


# --- item 1: no oracle on a run the filter hides ------------------------------------------


def test_start_is_no_oracle_under_the_run_filter(framework: str) -> None:
    """Ann may start runs and read every run id, but her filter hides bob's run: her
    start under its id answers byte for byte the same whether her guess of its input is
    right or wrong, and the same as under an id no run has; nothing is written."""
    pikku = make_pikku()
    secret = {"owner": "bob", "a": 1, "b": 2}
    pikku.start("sum", secret, run_id="bob-secret")
    web = web_for(framework, pikku, AUTHORIZE=signed_in, RUN_FILTER=my_runs)
    answers = []
    for guess in (secret, {"owner": "bob", "a": 9, "b": 2}):
        status, _ = web.call("POST", START, {"input": guess, "run_id": "bob-secret"},
                             user="ann")
        answers.append((status, web.body))
    status, _ = web.call("POST", START, {"input": secret, "run_id": "no-such-run"},
                         user="ann")
    assert answers[0] == answers[1] == (status, web.body)
    assert status == 403 and b"bob" not in web.body
    # An input she may start: the id is taken, refused as any taken id is, nothing of
    # its run said (its workflow, its owner, whether her input was its input).
    status, payload = web.call("POST", START, {"input": {"owner": "ann", "a": 1, "b": 2},
                                               "run_id": "bob-secret"}, user="ann")
    assert (status, payload["error"]) == (409, "WorkflowRunConflictError")
    hidden = web.body
    assert b"bob'" not in hidden and b"'sum'" not in hidden
    pikku.start("sum", {"owner": "ann", "a": 1, "b": 2}, run_id="ann-own")
    status, payload = web.call("POST", START, {"input": {"owner": "ann", "a": 5, "b": 2},
                                               "run_id": "ann-own"}, user="ann")
    assert status == 409 and web.body == hidden.replace(b"bob-secret", b"ann-own")
    assert sorted(r.run_id for r in pikku.list_runs()) == ["ann-own", "bob-secret"]
    assert pikku.get_run("bob-secret").input == secret


def test_a_run_the_filter_hides_is_hidden_from_a_start() -> None:
    """What a start checks before the idempotent match: a run the filter hides is hidden
    even from a caller ``authorize`` lets read every run; an id no run has is not."""
    pikku = make_pikku()
    pikku.start("sum", {"owner": "bob", "a": 1, "b": 2}, run_id="bob-1")
    pikku.start("sum", {"owner": "ann", "a": 1, "b": 2}, run_id="ann-1")
    rules = Rules(authorize=lambda *args: True, run_filter=lambda r: {"input.owner": "ann"})
    caller = Caller(rules, None, lambda action, run_id, about: None)
    assert hidden_run(pikku, caller, "bob-1")
    assert not hidden_run(pikku, caller, "ann-1") and not hidden_run(pikku, caller, "none")
    with pytest.raises(TypeError, match="never told"):
        caller.check("read", None, colour="red")  # a keyword authorize is never told


# --- item 2: a start is checked against the filter, and authorize sees the input -----------


def test_a_tenant_cannot_start_a_run_whose_input_names_another(framework: str) -> None:
    pikku = with_tenants(make_pikku())
    web = web_for(framework, pikku, AUTHORIZE=signed_in, RUN_FILTER=my_runs)
    url = PREFIX + "/workflows/per_owner/runs"
    # Hers, hers under an id of bob's choosing, nobody's, and hers and his alike (the
    # filter reads a list as any of its items: it would be in both listings).
    for body in ({"input": {"owner": "ann"}}, {"input": {"owner": "ann"}, "run_id": "planted"},
                 {"input": None}, {"input": {"owner": ["bob", "ann"]}}):
        status, payload = web.call("POST", url, body, user="bob")
        assert (status, payload["error"]) == (403, "PermissionDenied"), body
        assert "run filter" in payload["message"] and "input.owner" in payload["message"]
    assert pikku.list_runs() == []
    # Her listing and her concurrency slot are hers alone.
    assert listed(web, "ann")[0] == []
    status, started = web.call("POST", url, {"input": {"owner": "ann"}}, user="ann")
    assert status == 202
    assert pikku.get_run(started["run_id"]).status == "running"  # not queued
    status, own = web.call("POST", url, {"input": {"owner": "bob"}, "run_id": "bob-1"},
                           user="bob")
    assert (status, own) == (202, {"run_id": "bob-1"})
    assert listed(web, "ann")[0] == [started["run_id"]]
    assert listed(web, "bob")[0] == ["bob-1"]


asked: list[tuple[str, str | None, Any]] = []


def input_rule(request: Any, action: str, run_id: str | None, *, input: Any = None) -> bool:
    """Starts of sums up to 100 only."""
    asked.append((action, run_id, input))
    if action == "start":
        return isinstance(input, dict) and input.get("a", 0) <= 100
    return user_of(request) is not None


def test_authorize_is_told_the_input_and_run_id_of_a_start(framework: str) -> None:
    pikku = make_pikku()
    web = web_for(framework, pikku, AUTHORIZE=input_rule)
    asked.clear()
    small = {"a": 1, "b": 2}
    assert web.call("POST", START, {"input": small, "run_id": "small"})[0] == 202
    assert [a for a in asked if a[0] == "start"] == [("start", "small", small)]  # once
    status, payload = web.call("POST", START, {"input": {"a": 500, "b": 1}})
    assert (status, payload["error"]) == (403, "PermissionDenied")
    assert ("start", None, {"a": 500, "b": 1}) in asked
    assert [r.run_id for r in pikku.list_runs()] == ["small"]
    # A 3-argument rule is asked as before, and told the run id a start names.
    legacy = web_for(framework, pikku)
    calls.clear()
    assert legacy.call("POST", START, {"input": small, "run_id": "legacy"})[0] == 202
    assert [c for c in calls if c[0] == "start"] == [("start", None), ("start", "legacy")]


# --- item 5: the event and the schedule are told to authorize -------------------------------


told: list[tuple[str, dict[str, Any]]] = []


def named_rule(request: Any, action: str, run_id: str | None, **about: Any) -> bool:
    """Only the event ``paid`` (``None``: may this caller send events at all?) and only
    the schedule ``nightly``."""
    told.append((action, about))
    if action == "send_event":
        return about.get("event") in (None, "paid")
    if action in SCHEDULE_ACTIONS:
        return about.get("schedule") == "nightly"
    return user_of(request) is not None


def two_schedules() -> PikkuCelery:
    pikku = with_schedule(make_pikku())
    pikku.schedule("daily", "sum", cron="0 6 * * 1-5", data={"a": 5, "b": 5})
    for name in ("nightly", "daily"):
        pikku.get_schedule(name)  # saved, as a worker does when it starts
    return pikku


def test_authorize_is_told_the_event_and_the_schedule_over_the_api(framework: str) -> None:
    pikku = two_schedules()
    run_id = running_run(pikku)
    web = web_for(framework, pikku, AUTHORIZE=named_rule)
    told.clear()
    events = PREFIX + f"/runs/{run_id}/events/"
    assert web.call("POST", events + "paid", {"payload": 12})[0] == 200
    status, payload = web.call("POST", events + "shipped", {"payload": 1})
    assert (status, payload["error"]) == (403, "PermissionDenied")
    assert ("send_event", {"event": "shipped"}) in told
    assert [e.name for e in pikku.list_events(run_id)] == ["paid"]
    assert web.call("POST", PREFIX + "/schedules/nightly/pause", {})[0] == 200
    assert web.call("POST", PREFIX + "/schedules/daily/pause", {})[0] == 403
    assert web.call("POST", PREFIX + "/schedules/daily/trigger", {})[0] == 403
    assert ("pause_schedule", {"schedule": "daily"}) in told
    assert ("trigger_schedule", {"schedule": "daily"}) in told
    assert pikku.get_schedule("nightly").paused and not pikku.get_schedule("daily").paused
    assert [r.run_id for r in pikku.list_runs()] == [run_id]


def test_authorize_is_told_the_event_and_the_schedule_on_the_dashboard(framework: str
                                                                        ) -> None:
    pikku = two_schedules()
    run_id = running_run(pikku)
    site = site_for(framework, pikku, AUTHORIZE=named_rule)
    page = site.get(SCHEDULES)
    assert page.status == 200, page.text
    nightly, daily = row(page.text, "nightly"), row(page.text, "daily")
    assert "/pause" in nightly and "/trigger" in nightly
    assert "<form" not in daily
    field, token = page.form_token()
    assert site.post(action("daily", "pause"), {field: token}).status == 403
    assert site.post(action("daily", "trigger"), {field: token}).status == 403
    assert site.post(action("nightly", "trigger"), {field: token}).status == 303
    assert not pikku.get_schedule("daily").paused
    assert [r.schedule for r in pikku.list_runs()] == ["nightly", None]

    run_page = site.get(f"{BASE}runs/{run_id}")
    assert 'id="send-event-form"' in run_page.text  # it may send some event
    send = f"{BASE}runs/{run_id}/events"
    refused = site.post(send, {field: token, "name": "shipped", "payload": "1"})
    assert refused.status == 403
    assert "not allowed to send_event" in block(refused.text, "event-refused", "p")
    assert 'value="shipped"' in block(refused.text, "send-event-form", "form")
    assert site.post(send, {field: token, "name": "paid", "payload": "12"}).status == 303
    assert [e.name for e in pikku.list_events(run_id)] == ["paid"]


# --- item 5: the Schedules page names no hidden schedule ----------------------------------


def test_the_schedules_page_names_no_schedule_the_filter_hides(framework: str) -> None:
    pikku = two_schedules()  # nightly: {"a": 1, ...}, daily: {"a": 5, ...}, both saved
    pikku.schedule("weekly", "sum", cron="0 0 * * 0", data={"a": 5, "b": 0})  # not saved
    pikku.schedule("hourly", "sum", every="1h", data={"a": 1, "b": 0})  # not saved
    site = site_for(framework, pikku, RUN_FILTER=lambda request: {"input.a": 5})
    page = site.get(SCHEDULES)
    assert page.status == 200, page.text
    assert 'id="schedule-daily"' in page.text
    assert "nightly" not in page.text and "hourly" not in page.text
    unsaved = block(page.text, "unsaved", "p")
    assert unsaved.endswith("(a worker saves them when it starts): weekly</p>")


# --- item 5: a percent-encoded token is not logged in clear ----------------------------------


@pytest.mark.parametrize("key", ["%74oken", "%74%6F%6B%65%6E", "t%6fken"])
def test_a_percent_encoded_token_is_not_logged(key: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    token = "s3cr3t-" + "q" * 20
    app = standalone.make_app(make_pikku(), token=token, plain_http=True)
    client = Client(standalone.AccessLog(app))
    with caplog.at_level(logging.INFO, logger="pikku_celery.dashboard.access"):
        login = client.get(f"/?a=1&{key}={token}&b=2")
        assert login.status_code == 303  # the app reads it as the token: it logs in
    assert token not in caplog.text
    assert f"/?a=1&{key}=***&b=2" in caplog.text
    record = logging.LogRecord("gunicorn.access", logging.INFO, "", 0,
                               '"GET /?%s=%s HTTP/1.1" 303', (key, token), None)
    standalone.RedactTokens().filter(record)
    assert token not in record.getMessage() and f"{key}=***" in record.getMessage()


def test_redact_query_masks_only_what_reads_as_token() -> None:
    assert standalone.redact_query("a=1&%2574oken=x;+token+=y&tokens=z&b=%74oken") == (
        "a=1&%2574oken=***;+token+=***&tokens=z&b=%74oken")
    assert standalone.redact_query("") == ""
