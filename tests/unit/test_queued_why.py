"""Queued runs say why (issue 36 item 5): ``show``, ``runs --status queued`` and the web
API give a queued run's key, its workflow's limit, the runs holding the slots and how many
runs come before it; the API names only the holders the caller may read."""

from __future__ import annotations

import json
import re
from typing import Any

from pikku_celery import PikkuCelery, WorkflowContext
from tests.unit.test_cli import run_cli
from tests.unit.test_contrib import PREFIX, make_pikku
from tests.unit.test_dashboard import BASE, Site, site
from tests.unit.test_web_security import framework, my_runs, user_of, web_for

__all__ = ["framework", "site"]  # the fixtures: Flask and Django


def per_team(pikku: PikkuCelery) -> PikkuCelery:
    """``per_team``: one run at a time per ``team`` of its input (runs are ann's or bob's by
    ``owner``, so one tenant's run can wait on another's)."""
    @pikku.workflow("per_team", concurrency=1, concurrency_key=lambda data: data["team"])
    def per_team(wf: WorkflowContext, data: Any) -> Any:
        return data

    return pikku


def three_queued(pikku: PikkuCelery) -> tuple[str, str, str]:
    """bob's run holds team red's slot; ann's two runs wait behind it, in that order (the
    in-memory store's clock: the second starts a millisecond later)."""
    holder = pikku.start("per_team", {"team": "red", "owner": "bob"}, run_id="bob-1")
    first = pikku.start("per_team", {"team": "red", "owner": "ann"}, run_id="ann-1")
    second = pikku.start("per_team", {"team": "red", "owner": "ann"}, run_id="ann-2")
    ahead = pikku.why_queued(first).ahead  # type: ignore[union-attr]
    return (holder, first, second) if ahead == 0 else (holder, second, first)


def test_show_says_what_a_queued_run_waits_for() -> None:
    pikku = per_team(make_pikku())
    holder, _, later = three_queued(pikku)
    result = run_cli(pikku, "show", later)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich folds long lines
    assert (f"queued waits for a slot: concurrency 1 for key 'red' is held by {holder}; "
            "1 run ahead") in text
    shown = json.loads(run_cli(pikku, "show", later, "--json").output)
    assert shown["queued"] == {"run_id": later, "workflow": "per_team", "key": "red",
                               "limit": 1, "holders": [holder], "ahead": 1}
    assert json.loads(run_cli(pikku, "show", holder, "--json").output)["queued"] is None


def test_runs_status_queued_has_a_column_saying_why() -> None:
    pikku = per_team(make_pikku())
    holder, first, later = three_queued(pikku)
    result = run_cli(pikku, "runs", "--status", "queued")
    assert result.exit_code == 0, result.output
    assert "waits for" in result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()[1:]}
    assert f"held by {holder}; next in line" in lines[first], result.output
    assert f"held by {holder}; 1 run ahead" in lines[later], result.output
    listed = json.loads(run_cli(pikku, "runs", "--status", "queued", "--json").output)
    assert sorted(listed["queued"]) == sorted([first, later])
    assert listed["queued"][later]["holders"] == [holder]
    # A page without queued runs has no such column.
    assert "waits for" not in run_cli(pikku, "runs", "--status", "running").output


def signed_in(request: Any, action: str, run_id: str | None) -> bool:
    return user_of(request) is not None


def test_the_api_names_only_the_holders_the_caller_may_read(framework: str) -> None:
    """ann's runs wait on bob's: she is told a slot is held and by how many, never by
    which run; bob, whose filter keeps his run, would be told its id."""
    pikku = per_team(make_pikku())
    holder, _, later = three_queued(pikku)
    pikku.start("per_team", {"team": "blue", "owner": "ann"}, run_id="ann-blue")
    web = web_for(framework, pikku, AUTHORIZE=signed_in, RUN_FILTER=my_runs)
    status, served = web.call("GET", f"{PREFIX}/runs/{later}", user="ann")
    assert status == 200, served
    assert served["queued"] == {"key": "red", "limit": 1, "ahead": 1, "holders": [],
                                "other_holders": 1}
    assert holder.encode() not in web.body
    status, served = web.call("GET", f"{PREFIX}/runs/ann-blue", user="ann")
    assert (status, served["queued"]) == (200, None)  # running: not queued
    # Without a run filter every holder is named.
    open_web = web_for(framework, pikku, AUTHORIZE=signed_in)
    status, served = open_web.call("GET", f"{PREFIX}/runs/{later}", user="ann")
    assert served["queued"]["holders"] == [holder] and served["queued"]["other_holders"] == 0


def test_the_run_page_says_what_a_queued_run_waits_for(site: Site) -> None:
    per_team(site.pikku)
    holder, _, later = three_queued(site.pikku)
    page = site.get(f"{BASE}runs/{later}")
    assert page.status == 200
    found = re.search(r'<dd id="queued">(.*?)</dd>', page.text)
    assert found is not None, page.text
    line = re.sub(r"<[^>]+>", "", found.group(1))
    assert line == f"waits for a slot: concurrency 1 for key red is held by {holder}; 1 run ahead"
    assert f'href="{BASE}runs/{holder}"' in found.group(1)
    assert 'id="queued"' not in site.get(f"{BASE}runs/{holder}").text
