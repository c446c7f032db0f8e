"""Issue 25 items 8 and 6 (the dashboard's and the JSON API's parts): a graph workflow's
run page draws its graph (nodes, edges, each node's visits coloured by status); the run
page offers each step's input and result on demand (read from the JSON API's step route);
the runs page filters by creation time and searches by run id prefix; a compensated run
shows its compensation and its result on the run page and in ``pikku show``; the JSON
API's resume of a run waiting only at an approval is a 409 naming it.
``tests/integration/test_dashboard_graph_browser.py`` drives the graph and the values in
Chromium."""

from __future__ import annotations

import html
import json
import re
from datetime import datetime, timezone
from typing import Any

import pytest

from pikku_celery import PikkuCelery
from pikku_celery.contrib import _readable
from pikku_celery.dashboard import graph_view
from pikku_celery.store.base import NewRun
from tests.unit.test_cli import run_cli
from tests.unit.test_contrib import PREFIX, Web, django_web, flask_web, make_pikku
from tests.unit.test_dashboard import BASE, Site, rows

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10


def add_graphs(pikku: PikkuCelery) -> None:
    """``shop``: ``list`` -> ``pack`` for each item -> ``charge``, which fails and is
    handled by ``refund``; ``tries``: ``attempt`` loops back to itself until its third
    visit."""

    @pikku.step(name="g.list")
    def listing(data: Any) -> list[str]:
        return ["tea", "cup"]

    @pikku.step(name="g.pack")
    def pack(data: Any) -> str:
        return f"packed {data['item']}"

    @pikku.step(name="g.charge", retries=0)
    def charge(data: Any) -> None:
        raise RuntimeError("card declined")

    @pikku.step(name="g.refund")
    def refund(data: Any) -> str:
        return "refunded"

    @pikku.step(name="g.attempt")
    def attempt(data: Any) -> int:
        before = data["from"].get("attempt")  # the visit before's result, on a loop
        return 1 if before is None else before + 1

    @pikku.step(name="g.done")
    def done(data: Any) -> str:
        return "done"

    pikku.graph("shop", nodes={"list": listing, "pack": pack, "charge": charge,
                               "refund": refund},
                edges=[("list", "pack"), ("pack", "charge")], for_each={"pack": "list"},
                on_error={"charge": "refund"})
    pikku.graph("tries", nodes={"attempt": attempt, "done": done},
                edges=[("attempt", "attempt"), ("attempt", "done")],
                branch={"attempt": lambda visit: ["attempt"] if visit < 3 else ["done"]})


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Site:
    from tests.unit.test_dashboard import django_site, flask_site

    pikku = make_pikku()
    add_graphs(pikku)
    return flask_site(pikku) if request.param == "flask" else django_site(pikku)


@pytest.fixture(params=["flask", "django"])
def web(request: pytest.FixtureRequest) -> Web:
    pikku = make_pikku()
    return flask_web(pikku) if request.param == "flask" else django_web(pikku)


def _nodes(page: str) -> dict[str, tuple[str, str]]:
    return {name: (status, visits) for name, status, visits in re.findall(
        r'<g class="node [^"]*" data-node="([^"]+)" data-status="([^"]+)" '
        r'data-visits="(\d+)"', page)}


def _chips(page: str) -> list[tuple[str, str]]:
    return re.findall(r'<rect class="visit [^"]*" data-step="([^"]+)" data-status="([^"]+)"',
                      page)


def _edges(page: str) -> set[tuple[str, str, str]]:
    return set(re.findall(r'data-source="([^"]+)" data-target="([^"]+)" data-kind="(\w+)"',
                          page))


# --- the graph -------------------------------------------------------------------------------


def test_a_graph_runs_page_draws_its_nodes_edges_and_visits(site: Site) -> None:
    run_id = site.pikku.start("shop", {"order": 7}, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200 and 'id="graph"' in page.text
    assert _nodes(page.text) == {"list": ("succeeded", "1"), "pack": ("succeeded", "1"),
                                 "charge": ("failed", "1"), "refund": ("succeeded", "1")}
    assert _edges(page.text) == {("list", "pack", "edge"), ("pack", "charge", "edge"),
                                 ("charge", "refund", "error")}
    assert _chips(page.text) == [("list", "succeeded"), ("pack[0]", "succeeded"),
                                 ("pack[1]", "succeeded"), ("charge", "failed"),
                                 ("refund", "succeeded")]
    assert "for each of list" in page.text and "on error of charge" in page.text


def test_a_loops_visits_are_chips_of_one_node_and_its_back_edge_an_arc(site: Site) -> None:
    run_id = site.pikku.start("tries", None, inline=True)
    assert site.pikku.get_run(run_id).status == "completed"
    page = site.get(f"{BASE}runs/{run_id}").text
    assert _nodes(page) == {"attempt": ("succeeded", "3"), "done": ("succeeded", "1")}
    assert [c for c in _chips(page) if c[0].startswith("attempt")] == [
        ("attempt", "succeeded"), ("attempt#2", "succeeded"), ("attempt#3", "succeeded")]
    assert ("attempt", "attempt", "loop") in _edges(page)


def test_a_node_that_did_not_run_and_a_live_visit_are_drawn_so(site: Site) -> None:
    run_id = site.pikku.start("shop", None, run_id="shop-live")  # no broker: stays running
    site.pikku.engine.advance(run_id)
    page = site.get(f"{BASE}runs/{run_id}").text
    nodes = _nodes(page)
    assert nodes["list"][0] in ("pending", "running") and nodes["pack"] == ("not-run", "0")
    assert ">not run</text>" in page


def test_a_plain_workflow_has_no_graph_and_a_graph_of_another_version_says_so(
        site: Site) -> None:
    plain = site.pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    assert 'id="graph"' not in site.get(f"{BASE}runs/{plain}").text
    store = site.pikku.engine.store
    store.create_run(NewRun("shop-old", "shop", None, version="0ld"), _api_now_ms())
    page = site.get(f"{BASE}runs/shop-old").text
    assert 'id="graph-version"' in page and "recorded by version 0ld" in page


def test_node_and_step_names_are_escaped_in_the_drawing() -> None:
    pikku = make_pikku()

    @pikku.step(name="g.x")
    def x(data: Any) -> int:
        return 1

    evil = "<script>alert(1)</script>"
    pikku.graph("evil", nodes={evil: x}, edges=[])
    from tests.unit.test_dashboard import flask_site

    run_id = pikku.start("evil", None, inline=True)
    page = flask_site(pikku).get(f"{BASE}runs/{run_id}").text
    assert "<script>alert(1)" not in page and html.escape(evil) in page


def test_split_visit_reads_every_visit_name() -> None:
    split = graph_view.split_visit
    assert split("pack") == ("pack", 1, None)
    assert split("pack#3") == ("pack", 3, None)
    assert split("pack[2]") == ("pack", 1, 2)
    assert split("pack#2[10]") == ("pack", 2, 10)
    assert split("__approval:x") == ("__approval:x", 1, None)  # no node of that name
    assert split("a#b") is None


# --- a step's values, on demand --------------------------------------------------------------


def test_each_steps_input_and_result_are_offered_from_the_api_route(site: Site) -> None:
    run_id = site.pikku.start("shop", {"order": 7}, inline=True)
    page = site.get(f"{BASE}runs/{run_id}").text
    found = dict(re.findall(r'<details class="values" data-step="([^"]+)" '
                            r'data-url="([^"]+)"', page))
    # Every step offers its values. (Steps recorded within one millisecond are listed by
    # name, so the page's order of charge and the packs depends on the clock.)
    assert sorted(found) == sorted(["list", "pack[0]", "pack[1]", "charge", "refund"])
    assert found["pack[0]"] == f"{BASE}api/runs/{run_id}/steps/pack%5B0%5D"
    assert '<pre class="step-input"></pre>' in page  # read when opened, not inlined
    assert "packed tea" not in page
    served = site.get(html.unescape(found["pack[0]"]))
    assert served.status == 200
    body = json.loads(served.text)
    assert body["result"] == "packed tea" and body["data"]["item"] == "tea"
    assert "nonce" in page and 'details.values' in page  # the script that reads them


def test_values_are_read_under_the_callers_rights(site: Site) -> None:
    run_id = site.pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    url = f"{BASE}api/runs/{run_id}/steps/add"
    assert site.get(url, user="reader").status == 200
    assert site.get(url, user="nobody").status == 403
    assert site.get(url, user=None).status in (401, 302)


# --- the runs page: time range and run id ----------------------------------------------------


def _at(pikku: PikkuCelery, run_id: str, when: str) -> None:
    moment = datetime.fromisoformat(when).replace(tzinfo=UTC)
    pikku.engine.store.create_run(NewRun(run_id, "sum", {"a": 1, "b": 1}),
                                  round(moment.timestamp() * 1000))


@pytest.fixture
def dated(site: Site) -> Site:
    for run_id, when in (("jan-a1", "2026-01-10T08:00:00"), ("feb-b1", "2026-02-10T08:00:00"),
                         ("feb-a2", "2026-02-20T08:00:00"), ("mar-a3", "2026-03-10T08:00:00")):
        _at(site.pikku, run_id, when)
    return site


def test_the_runs_page_filters_by_creation_time(dated: Site) -> None:
    get = dated.get
    assert rows(get(BASE + "?created_after=2026-02-01T00:00")) == ["mar-a3", "feb-a2", "feb-b1"]
    assert rows(get(BASE + "?created_before=2026-02-15T00:00")) == ["feb-b1", "jan-a1"]
    both = get(BASE + "?created_after=2026-02-01T00:00&created_before=2026-03-01T00:00")
    assert rows(both) == ["feb-a2", "feb-b1"]
    assert 'value="2026-02-01T00:00"' in both.text  # the form keeps what was asked
    # paged within the range, the range kept in the link
    first = get(BASE + "?created_after=2026-01-01T00:00&limit=2")
    assert rows(first) == ["mar-a3", "feb-a2"]
    older = re.search(r'<a href="([^"]+)" id="older">', first.text)
    assert older is not None and "created_after=" in older.group(1)
    assert rows(get(html.unescape(older.group(1)))) == ["feb-b1", "jan-a1"]
    # an offset is taken as given; a naive time is UTC
    assert rows(get(BASE + "?created_after=2026-03-10T09:00%2B02:00")) == ["mar-a3"]
    bad = get(BASE + "?created_after=yesterday")
    assert bad.status == 400 and "created_after must be a time" in bad.text


def test_the_runs_page_searches_by_run_id_prefix(dated: Site) -> None:
    get = dated.get
    assert rows(get(BASE + "?run_id=feb-")) == ["feb-a2", "feb-b1"]
    assert rows(get(BASE + "?run_id=feb-&created_before=2026-02-15T00:00")) == ["feb-b1"]
    assert rows(get(BASE + "?run_id=nope")) == []
    assert rows(get(BASE + "?run_id=feb-&limit=1")) == ["feb-a2"]
    whole = get(BASE + "?run_id=jan-a1&created_after=2026-02-01T00:00")
    assert rows(whole) == [] and 'id="exact-run"' in whole.text  # a whole id finds its run


def test_a_long_search_stops_and_offers_to_read_on(dated: Site,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_readable, "SEARCH_BATCH", 1)
    monkeypatch.setattr(_readable, "MAX_SEARCHED", 2)
    page = dated.get(BASE + "?run_id=jan-")
    assert rows(page) == [] and 'id="search-gave-up"' in page.text
    older = re.search(r'<a href="([^"]+)" id="older">', page.text)
    assert older is not None
    assert rows(dated.get(html.unescape(older.group(1)))) == ["jan-a1"]


# --- compensations ---------------------------------------------------------------------------


def test_a_compensated_run_shows_its_compensation_and_result(site: Site) -> None:
    run_id = site.pikku.start("fails", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}").text
    row = re.search(r'<tr data-step="boom:on_error" data-for="boom" data-status="(\w+)">'
                    r'(.*?)</tr>', page, re.S)
    assert row is not None and row.group(1) == "succeeded"
    assert "contrib.undo" in row.group(2) and "&#34;undone&#34;" in row.group(2)
    assert "compensation of &#39;boom&#39; succeeded" in page


def test_show_prints_the_compensation_and_its_result() -> None:
    pikku = make_pikku()
    run_id = pikku.start("fails", None, inline=True)
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    [row] = [line for line in shown.output.splitlines() if line.startswith("boom ")
             and "contrib.undo" in line]
    assert row.split() == ["boom", "contrib.undo", "succeeded", '"undone"']
    assert "compensation of 'boom' succeeded" in shown.output
    data = json.loads(run_cli(pikku, "show", run_id, "--json").output)
    assert data["compensations"] == [{
        "for_step": "boom", "step": "boom:on_error", "function": "contrib.undo",
        "status": "succeeded", "result": "undone", "error": None}]


# --- the JSON API's resume -------------------------------------------------------------------


def test_api_resume_of_a_run_waiting_at_an_approval_is_a_409(web: Web) -> None:
    gated = web.pikku.start("gated", None, inline=True)
    status, payload = web.call("POST", PREFIX + f"/runs/{gated}/resume", {})
    assert status == 409 and payload["error"] == "WorkflowWaitsForApproval"
    assert "'manager'" in payload["message"] and "approvals/manager" in payload["message"]
    assert web.pikku.get_run(gated).status == "suspended"
    waiting = web.pikku.start("waits", None, inline=True)  # a wf.suspend: still resumed
    assert web.call("POST", PREFIX + f"/runs/{waiting}/resume", {}) == (200, {"resumed": True})


def _api_now_ms() -> int:
    return round(datetime.now(UTC).timestamp() * 1000)
