"""Issue 35, item 3: a run's events are read in pages and without their payloads, each
payload on its own route, and every run has a limit on its events and on an event's size.

Over the JSON API (Flask and Django alike): ``GET api/runs/<run_id>`` carries the first
page of the run's events without payloads (``events``, ``events_next``); ``GET
api/runs/<run_id>/events?after=`` pages on to the run's last event (past the 1,000th:
before, a run's events past it could not be read); ``GET
api/runs/<run_id>/events/<seq>/payload`` serves one event whole, as a read of the run
(a run the caller's filter hides is a 404). A send past the run's limits is a 413 (size)
or a 409 (count), naming the setting, and keeps nothing. The dashboard's run page lists
events ``EVENTS_PER_PAGE`` at a time and carries no payload, neither an event's nor a
received wait's: each is read when its ``<details>`` is opened; ``pikku events --after``
pages on too. The limits are settings
(``pikku_max_events_per_run``, ``pikku_max_event_bytes``) with documented defaults. The
store's part, concurrent sends among them, is ``tests/contract/test_store_event_limits``.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowEventLimitError,
)
from pikku_celery.dashboard._events import EVENTS_PER_PAGE
from pikku_celery.store.base import NewRun
from tests.unit.test_cli import run_cli
from tests.unit.test_contrib import PREFIX, Web, make_pikku
from tests.unit.test_contrib_events import events_path, web, with_events
from tests.unit.test_dashboard import BASE, Site
from tests.unit.test_dashboard_events import block, event_rows, send_path, site
from tests.unit.test_web_security import framework, my_runs, site_for, web_for

__all__ = ["framework", "site", "web"]  # the fixtures: Flask and Django


def size_of(payload: Any) -> int:
    return len(json.dumps(payload, separators=(",", ":")).encode())


def limited(pikku: PikkuCelery, **limits: int) -> PikkuCelery:
    """``pikku`` with its engine's limits on events replaced."""
    pikku.engine.settings = dataclasses.replace(pikku.engine.settings, **limits)
    return pikku


def note(i: int) -> dict[str, Any]:
    return {"secret": f"SECRET-{i}", "pad": "x" * 500}


# --- the JSON API ---------------------------------------------------------------------------


def test_the_run_read_carries_no_payload_and_events_are_paged(web: Web) -> None:
    pikku, call = web.pikku, web.call
    run_id = pikku.start("checkout", None, inline=True)
    for i in range(1, 4):
        pikku.send_event(run_id, "note", note(i), key=f"n{i}")
    status, run = call("GET", PREFIX + f"/runs/{run_id}")
    assert status == 200 and b"SECRET" not in web.body
    assert [(e["seq"], e["name"], e["key"], e["size"]) for e in run["events"]] == [
        (i, "note", f"n{i}", size_of(note(i))) for i in range(1, 4)]
    assert all("payload" not in e for e in run["events"]) and run["events_next"] is None
    status, first = call("GET", events_path(run_id) + "?limit=2")
    assert status == 200 and b"SECRET" not in web.body
    assert [e["seq"] for e in first["events"]] == [1, 2] and first["next"] == 2
    assert first["events"] == run["events"][:2]
    status, rest = call("GET", events_path(run_id) + "?limit=2&after=2")
    assert [e["seq"] for e in rest["events"]] == [3] and rest["next"] is None
    assert call("GET", events_path(run_id) + "?after=3")[1] == {"events": [], "next": None}
    # One event whole, with the wait that took it.
    status, one = call("GET", events_path(run_id) + "/2/payload")
    assert status == 200
    assert (one["seq"], one["name"], one["payload"], one["size"], one["taken_by"]) == (
        2, "note", note(2), size_of(note(2)), None)
    call("POST", events_path(run_id, "paid"), {"payload": 12})
    pikku.engine.advance(run_id)
    status, paid = call("GET", events_path(run_id) + "/4/payload")
    assert (status, paid["payload"], paid["taken_by"]) == (200, 12, "event paid")
    assert call("GET", events_path(run_id) + "?after=3")[1]["events"][0]["taken_by"] == \
        "event paid"


@pytest.mark.parametrize(("query", "status"), [
    ("/0/payload", 400), ("/abc/payload", 400), ("/-1/payload", 400), ("/1.0/payload", 400),
    ("/99/payload", 404), ("?after=-1", 400), ("?after=x", 400), ("?limit=0", 400),
    ("?limit=501", 400), ("?limit=500&after=0", 200), ("?after=99999", 200),
])
def test_bad_cursors_and_seqs_are_refused(web: Web, query: str, status: int) -> None:
    run_id = web.pikku.start("checkout", None, inline=True)
    web.pikku.send_event(run_id, "note", 1)
    answer, payload = web.call("GET", events_path(run_id) + query)
    assert answer == status, payload
    if status == 404:
        assert payload["error"] == "WorkflowEventNotFound"
    if status == 400:
        assert payload["error"] == "InvalidInputError"


def test_events_past_the_1000th_are_read_to_the_last(web: Web) -> None:
    pikku, call = web.pikku, web.call
    run_id = pikku.start("checkout", None, inline=True)
    for i in range(1005):
        pikku.send_event(run_id, "tick", i)
    run = call("GET", PREFIX + f"/runs/{run_id}")[1]
    assert len(run["events"]) == 100 and run["events_next"] == 100
    seen: list[int] = []
    after: int | None = 0
    while after is not None:
        status, page = call("GET", events_path(run_id) + f"?limit=500&after={after}")
        assert status == 200 and len(page["events"]) <= 500
        seen += [e["seq"] for e in page["events"]]
        after = page["next"]
    assert seen == list(range(1, 1006))
    assert call("GET", events_path(run_id) + "/1005/payload")[1]["payload"] == 1004


def test_event_reads_are_reads_of_the_run_under_its_filter(framework: str) -> None:
    pikku = with_events(make_pikku())
    pikku.engine.store.create_run(NewRun("bobs", "checkout", {"owner": "bob"}), 1000)
    pikku.send_event("bobs", "note", {"card": "bob's"})
    web = web_for(framework, pikku, AUTHORIZE=lambda request, action, run_id: True,
                  RUN_FILTER=my_runs)
    for path in (events_path("bobs"), events_path("bobs") + "/1/payload"):
        status, payload = web.call("GET", path, user="ann")
        assert (status, payload["error"]) == (404, "WorkflowRunNotFoundError"), path
        assert b"bob's" not in web.body
        assert web.call("GET", path, user="bob")[0] == 200


def test_a_send_past_the_limits_is_413_or_409_and_keeps_nothing(web: Web) -> None:
    pikku = limited(web.pikku, max_event_bytes=64, max_events_per_run=2)
    run_id = pikku.start("checkout", None, inline=True)
    status, refused = web.call("POST", events_path(run_id, "note"), {"payload": "x" * 63})
    assert (status, refused["error"]) == (413, "WorkflowEventLimitError")
    assert (refused["limit"], refused["maximum"]) == ("max_event_bytes", 64)
    assert "65 bytes as JSON, over the 64-byte limit" in refused["message"]
    assert "pikku_max_event_bytes" in refused["message"]
    for key in ("a", "b"):
        assert web.call("POST", events_path(run_id, "note"), {"payload": 1, "key": key}
                        )[0] == 200
    status, refused = web.call("POST", events_path(run_id, "note"), {"payload": 1})
    assert (status, refused["error"], refused["limit"]) == (
        409, "WorkflowEventLimitError", "max_events_per_run")
    assert "has kept 2 events" in refused["message"]
    assert "pikku_max_events_per_run" in refused["message"]
    status, again = web.call("POST", events_path(run_id, "note"), {"payload": 1, "key": "a"})
    assert (status, again["event"]["seq"]) == (200, 1)  # a key sent: its first event
    assert [e.seq for e in pikku.list_events(run_id)] == [1, 2]
    assert pikku.get_run(run_id).status == "suspended"


# --- the dashboard --------------------------------------------------------------------------


def test_the_run_page_pages_its_events_and_carries_no_payload(site: Site) -> None:
    pikku = site.pikku
    run_id = pikku.start("checkout", None, inline=True)
    for i in range(1, EVENTS_PER_PAGE + 6):
        pikku.send_event(run_id, "note", note(i))
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200 and "SECRET" not in page.text
    rows = event_rows(page.text)
    assert [int(seq) for seq, _, _ in rows] == list(range(1, EVENTS_PER_PAGE + 1))
    table = block(page.text, "events", "table")
    url = f"{BASE}api/runs/{run_id}/events/3/payload"
    assert f'<details class="payload" id="event-payload-3" data-url="{url}">' in table
    assert f"<summary>{size_of(note(3))} bytes</summary>" in table
    assert 'id="first-events"' not in page.text
    later = re.search(r'<a href="([^"]+)" id="later-events">', page.text)
    assert later is not None
    more = site.get(html.unescape(later.group(1)))
    assert more.status == 200 and "SECRET" not in more.text
    assert [int(s) for s, _, _ in event_rows(more.text)] == list(
        range(EVENTS_PER_PAGE + 1, EVENTS_PER_PAGE + 6))
    assert 'id="later-events"' not in more.text and 'id="first-events"' in more.text
    # What the page's <details> reads when opened: the event, whole.
    read = site.get(url)
    assert read.status == 200 and json.loads(read.text)["payload"] == note(3)
    assert site.get(f"{BASE}runs/{run_id}?events_after=abc").status == 400


def test_a_received_waits_payload_is_read_on_demand_too(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    site.pikku.send_event(run_id, "paid", {"card": "SECRET-PAID"})
    site.pikku.engine.advance(run_id)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200  # (the run's output, shown whole, is the payload it took)
    waits = block(page.text, "event-waits", "table")
    assert "SECRET-PAID" not in waits + block(page.text, "events", "table")
    url = f"{BASE}api/runs/{run_id}/events/1/payload"
    assert f'<details class="payload" id="wait-payload-1" data-url="{url}">' in waits
    assert "published stage" in waits  # a publish's value is still shown as it is


def test_the_live_pages_refresh_keeps_a_payload_read(site: Site) -> None:
    run_id = site.pikku.start("checkout", None, inline=True)
    site.pikku.send_event(run_id, "note", 1)
    page = site.get(f"{BASE}runs/{run_id}")
    assert 'id="autorefresh"' in page.text  # live: the page reads itself again
    # The refresh moves each open payload into the fresh part instead of reading it.
    assert 'querySelectorAll("details.payload[open]")' in page.text
    assert "slot.replaceWith(box)" in page.text
    # And the loader that reads a payload when its row opens (opened.html).
    assert "payload: function (box, body)" in page.text
    assert "box.classList.contains(kind)" in page.text


def test_a_send_over_a_limit_from_the_form_is_refused_with_its_reason(site: Site) -> None:
    pikku = limited(site.pikku, max_event_bytes=64, max_events_per_run=1)
    run_id = pikku.start("checkout", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    big = site.post(send_path(run_id), {field: token, "name": "note",
                                        "payload": json.dumps("x" * 100)})
    assert big.status == 413
    assert "pikku_max_event_bytes" in block(big.text, "event-refused", "p")
    assert site.post(send_path(run_id), {field: token, "name": "note", "payload": "1"}
                     ).status == 303
    full = site.post(send_path(run_id), {field: token, "name": "note", "payload": "2"})
    assert full.status == 409
    assert "pikku_max_events_per_run" in block(full.text, "event-refused", "p")
    assert [e.payload for e in pikku.list_events(run_id)] == [1]


def test_the_run_page_under_a_filter_hides_the_payload_route_too(framework: str) -> None:
    pikku = with_events(make_pikku())
    pikku.engine.store.create_run(NewRun("bobs", "checkout", {"owner": "bob"}), 1000)
    pikku.send_event("bobs", "note", {"card": "bob's"})
    site = site_for(framework, pikku, AUTHORIZE=lambda request, action, run_id: True,
                    RUN_FILTER=my_runs)
    assert site.get(f"{BASE}api/runs/bobs/events/1/payload", user="ann").status == 404
    assert site.get(f"{BASE}runs/bobs", user="ann").status == 404
    assert site.get(f"{BASE}api/runs/bobs/events/1/payload", user="bob").status == 200


# --- the commands --------------------------------------------------------------------------


def test_pikku_events_pages_on_and_pikku_send_names_the_limit() -> None:
    pikku = limited(with_events(make_pikku()), max_event_bytes=64)
    run_id = pikku.start("checkout", None, inline=True)
    for i in range(1003):
        pikku.send_event(run_id, "tick", i)
    listed = run_cli(pikku, "events", run_id, "--after", "1000", "--json")
    assert listed.exit_code == 0, listed.output
    assert [e["seq"] for e in json.loads(listed.output)["events"]] == [1001, 1002, 1003]
    assert run_cli(pikku, "events", run_id, "--after", "-1").exit_code == 2
    refused = run_cli(pikku, "send", run_id, "note", json.dumps("x" * 100))
    assert refused.exit_code == 1 and "pikku_max_event_bytes" in refused.output


# --- the settings ---------------------------------------------------------------------------


def _pikku(**explicit: Any) -> PikkuCelery:
    app = Celery("limits", broker="memory://", set_as_current=False)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False, **explicit)
    return with_events(pikku)


def test_the_limits_default_to_the_documented_values() -> None:
    pikku = _pikku()
    assert (pikku.settings.max_events_per_run, pikku.settings.max_event_bytes) == (
        10_000, 256 * 1024)
    assert (pikku.engine.settings.max_events_per_run,
            pikku.engine.settings.max_event_bytes) == (10_000, 262_144)
    run_id = pikku.start("checkout", None, inline=True)
    fits = "x" * (256 * 1024 - 2)  # the quotes make it 256 KiB as JSON
    assert pikku.send_event(run_id, "note", fits).size == 256 * 1024
    with pytest.raises(WorkflowEventLimitError, match="pikku_max_event_bytes"):
        pikku.send_event(run_id, "note", fits + "x")
    assert [e.seq for e in pikku.list_events(run_id, payloads=False)] == [1]


def test_the_limits_are_read_from_the_app_and_an_argument_wins() -> None:
    pikku = _pikku(max_event_bytes=10)
    pikku.app.conf.update(pikku_max_events_per_run="2", pikku_max_event_bytes=1000)
    assert (pikku.settings.max_events_per_run, pikku.settings.max_event_bytes) == (2, 10)
    run_id = pikku.start("checkout", None, inline=True)
    with pytest.raises(WorkflowEventLimitError) as refused:
        pikku.send_event(run_id, "note", "x" * 9)
    assert refused.value.too_large and refused.value.maximum == 10
    pikku.send_event(run_id, "note", 1)
    pikku.send_event(run_id, "note", 2)
    with pytest.raises(WorkflowEventLimitError, match="pikku_max_events_per_run"):
        pikku.send_event(run_id, "note", 3)
    assert [e.payload for e in pikku.list_events(run_id)] == [1, 2]


def test_zero_is_no_limit() -> None:
    pikku = _pikku(max_events_per_run=0, max_event_bytes=0)
    run_id = pikku.start("checkout", None, inline=True)
    pikku.send_event(run_id, "note", "x" * (300 * 1024))
    assert pikku.list_events(run_id, payloads=False)[0].size == 300 * 1024 + 2


@pytest.mark.parametrize("value", [-1, "many", True, 1.5])
def test_a_bad_limit_is_a_value_error_naming_it(value: Any) -> None:
    with pytest.raises(ValueError, match="max_events_per_run"):
        _pikku(max_events_per_run=value)
    pikku = _pikku()  # settings are read at first use: after this
    pikku.app.conf["pikku_max_event_bytes"] = value
    with pytest.raises(ValueError, match="pikku_max_event_bytes"):
        pikku.settings  # noqa: B018
