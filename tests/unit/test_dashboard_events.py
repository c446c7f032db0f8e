"""Events on the dashboard's run page, the same for Flask and Django (issue 26 item 1): the
events sent to the run (seq, name, sent at, key, the wait that took each), event waits and
publishes shown as what they are (an event wait drawn as a gate, not a sleep), and a Send
event form (name, JSON payload, optional key) that goes through ``pikku.send_event``,
authorized as ``send_event`` and CSRF-checked like the other forms; a refused send
re-renders the page with the reason and what was typed. A run waiting only at an event
wait is not offered Resume. ``tests/integration/test_dashboard_events_browser.py`` sends
an event through the form in Chromium."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery.dashboard import _pages
from tests.unit.test_contrib import EVIL, authorize, identify, make_pikku
from tests.unit.test_contrib_events import with_events
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    pikku = with_events(make_pikku())
    yield (flask_site(pikku, PIKKU_IDENTIFY=identify) if request.param == "flask"
           else django_site(pikku))


def send_path(run_id: str) -> str:
    return f"{BASE}runs/{run_id}/events"


def block(text: str, element_id: str, tag: str) -> str:
    found = re.search(rf'<{tag} [^>]*id="{element_id}".*?</{tag}>', text, re.S)
    assert found is not None, f"no #{element_id} on the page"
    return found.group(0)


def event_rows(text: str) -> list[tuple[str, str, str]]:
    """``(seq, name, the step that took it)`` of each row of the events table."""
    return re.findall(r'<tr data-seq="(\d+)" data-event="([^"]*)" data-taken="([^"]*)">',
                      block(text, "events", "table"))


def test_a_waiting_run_shows_its_wait_as_a_gate_and_a_filled_form(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200
    # The chart: the wait is an "event" row, labelled by its event, never "sleep".
    assert '<g class="row" data-step="__event:paid" data-kind="event">' in page.text
    assert 'data-kind="sleep"' not in page.text and 'class="gap gap-event"' in page.text
    assert ">event paid <" not in page.text and "event paid</text>" in page.text
    assert "waiting for event &#39;paid&#39; (times out at" in page.text  # the progress
    waits = block(page.text, "event-waits", "table")
    assert 'data-event="paid" data-status="waiting"' in waits
    assert "published stage" in waits and "waiting for payment" in waits
    assert 'id="events"' not in page.text  # none sent yet
    form = block(page.text, "send-event-form", "form")
    assert f'action="{send_path(run_id)}"' in form
    assert 'name="name" id="event-name" maxlength="200" required value="paid"' in form
    assert 'name="payload"' in form and 'name="key"' in form
    assert 'id="resume"' not in page.text  # it would change nothing


def test_an_event_sent_through_the_form_is_listed_and_taken(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    sent = site.post(send_path(run_id), {field: token, "name": "shipped",
                                         "payload": '{"carrier": "ups"}', "key": "s-1"})
    assert sent.status == 303, sent.text
    assert sent.headers["Location"].endswith(f"{BASE}runs/{run_id}?notice=event-sent")
    again = site.post(send_path(run_id), {field: token, "name": "shipped", "payload": "2",
                                          "key": "s-1"})
    assert again.status == 303  # the key's first send: nothing more kept
    page = site.get(sent.headers["Location"])
    assert 'id="notice">event sent<' in page.text
    assert event_rows(page.text) == [("1", "shipped", "")]
    assert "not taken yet" in block(page.text, "events", "table")
    assert ">s-1<" in block(page.text, "events", "table")

    paid = site.post(send_path(run_id), {field: token, "name": " paid ", "payload": " 12 "})
    assert paid.status == 303
    assert [(e.name, e.payload, e.key) for e in site.pikku.list_events(run_id)] == [
        ("shipped", {"carrier": "ups"}, "s-1"), ("paid", 12, None)]
    site.pikku.engine.advance(run_id)  # the wake the send asked for
    assert site.pikku.get_run(run_id).output == {"paid": 12}
    done = site.get(f"{BASE}runs/{run_id}")
    assert event_rows(done.text) == [("1", "shipped", ""), ("2", "paid", "__event:paid")]
    assert '<span class="mono">event paid</span>' in block(done.text, "events", "table")
    assert 'data-event="paid" data-status="received"' in done.text
    assert 'id="send-event-form"' not in done.text  # the run has ended
    assert 'id="send-event-why-not"' not in done.text


def test_a_refused_send_keeps_what_was_typed(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    bad = site.post(send_path(run_id), {field: token, "name": "paid",
                                        "payload": "{amount: 12}", "key": "k-9"})
    assert bad.status == 400
    refused = block(bad.text, "event-refused", "p")
    assert "event not sent: the payload is not JSON" in refused
    form = block(bad.text, "send-event-form", "form")
    assert "{amount: 12}</textarea>" in form and 'value="k-9"' in form
    for name, reason in (("pa#id", "no &#39;#&#39;"), ("", "1 to 200 characters")):
        answer = site.post(send_path(run_id), {field: token, "name": name, "payload": "1"})
        assert answer.status == 400 and reason in answer.text, name
    assert "Traceback" not in bad.text
    assert site.pikku.list_events(run_id) == []
    assert site.pikku.get_run(run_id).status == "suspended"


def test_an_ended_or_unknown_run_refuses_a_send(site: Site) -> None:
    ended = site.pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    page = site.get(f"{BASE}runs/{ended}")
    assert 'id="send-event-form"' not in page.text
    field, token = page.form_token()  # the fork form's
    refused = site.post(send_path(ended), {field: token, "name": "paid", "payload": "1"})
    assert refused.status == 409
    assert "event not sent:" in refused.text and "the run has ended (completed)" in \
        html.unescape(refused.text)
    missing = site.post(send_path("ghost"), {field: token, "name": "paid"})
    assert missing.status == 404
    assert site.pikku.list_events(ended) == []


def test_a_caller_without_the_action_gets_403_and_no_form(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}", user="reader")
    assert page.status == 200 and 'id="send-event-form"' not in page.text
    assert "you may not send events to this run" in page.text
    field, token = site.token("reader")
    refused = site.post(send_path(run_id), {field: token, "name": "paid", "payload": "1"},
                        user="reader")
    assert refused.status == 403 and "not allowed to send_event runs" in refused.text
    anonymous = site.post(send_path(run_id), {field: token, "name": "paid"}, user=None)
    assert anonymous.status in (401, 403)
    assert site.pikku.list_events(run_id) == []


def authorize_all_but_events(request: Any, action: str, run_id: str | None) -> bool:
    return authorize(request, action, run_id) and action != "send_event"


def test_send_event_is_its_own_action(site: Site) -> None:
    pikku = site.pikku
    other = (flask_site(pikku, PIKKU_AUTHORIZE=authorize_all_but_events,
                        PIKKU_IDENTIFY=identify) if site.framework == "flask"
             else django_site(pikku, PIKKU_AUTHORIZE=authorize_all_but_events))
    run_id = pikku.start("checkout", None, inline=True)
    page = other.get(f"{BASE}runs/{run_id}")
    assert 'id="send-event-form"' not in page.text and 'id="cancel"' in page.text
    field, token = page.form_token()
    refused = other.post(send_path(run_id), {field: token, "name": "paid", "payload": "1"})
    assert refused.status == 403
    assert pikku.list_events(run_id) == []


def test_csrf_size_and_cross_site_are_checked(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    for form in ({"name": "paid", "payload": "1"},
                 {field: "y" * len(token), "name": "paid", "payload": "1"}):
        refused = site.post(send_path(run_id), form)
        assert refused.status == 403 and "CSRF" in refused.text, form
    big = {field: token, "name": "paid", "payload": '"' + "x" * _pages.MAX_FORM_BYTES + '"'}
    assert site.post(send_path(run_id), big).status == 413
    csrf = {"X-CSRFToken": token}
    assert site.post(send_path(run_id), '{"name": "paid"}', content_type="application/json",
                     headers=csrf).status == 415
    if site.framework == "flask":
        assert site.post(send_path(run_id), {field: token, "name": "paid"},
                         headers=EVIL).status == 403
    assert site.pikku.list_events(run_id) == []


def test_resume_from_the_page_is_refused_at_an_event_wait(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    refused = site.post(f"{BASE}runs/{run_id}/resume", {field: token})
    assert refused.status == 303
    assert refused.headers["Location"].endswith("?notice=not-resumed-event")
    back = site.get(refused.headers["Location"])
    assert "the run waits for an event, which resume does not send" in back.text
    assert site.pikku.get_run(run_id).status == "suspended"
    assert site.pikku.engine.dispatcher.wakes == []  # type: ignore[attr-defined]
