"""The run page's lineage and the Fork form's "keep decisions" (issue 31), the same for
Flask and Django: a fork's page links to its source (step, who, when), the source's page
links to its forks, a retry shows who retried and when, "keep decisions" needs the right
to approve each approval copied, and each attempt shows the total it ran under."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery import PikkuCelery
from pikku_celery.store.base import NewRun, NewStep
from tests.support.operate import ADD, LEASE_MS, now_ms
from tests.unit.test_contrib import identify, make_pikku
from tests.unit.test_contrib_forks import _approved_source, fork_but_not_approve
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site


def _site(framework: str, pikku: PikkuCelery, **settings: Any) -> Site:
    # Flask names the signed-in user (PIKKU_IDENTIFY), as Django does by itself.
    if framework == "flask":
        return flask_site(pikku, PIKKU_IDENTIFY=identify, **settings)
    return django_site(pikku, **settings)


@pytest.fixture(params=["flask", "django"])
def framework(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_a_fork_and_its_source_link_to_each_other_with_who_and_when(framework: str) -> None:
    site = _site(framework, make_pikku())
    source = _approved_source(site.pikku)
    field, token = site.get(f"{BASE}runs/{source}").form_token()
    done = site.post(f"{BASE}runs/{source}/fork", {field: token, "from_step": "add",
                                                   "run_id": "dash-fork",
                                                   "keep_decisions": "on"})
    assert done.headers["Location"].endswith(f"{BASE}runs/dash-fork?notice=forked")
    assert [s.forked_from for s in site.pikku.get_steps("dash-fork")] == [source]  # kept
    assert site.pikku.cancel("dash-fork")
    field, token = site.get(f"{BASE}runs/dash-fork").form_token()
    assert site.post(f"{BASE}runs/dash-fork/retry", {field: token}).status == 303

    page = html.unescape(site.get(f"{BASE}runs/dash-fork").text)
    made = re.search(r'<dd class="lineage-fork">(.*?)</dd>', page)
    assert made is not None and f'href="{BASE}runs/{source}"' in made.group(1)
    assert "at step <span class=\"mono\">add</span>" in made.group(1)
    assert "by admin" in made.group(1) and "decisions kept" in made.group(1)
    retried = re.search(r'<dd class="lineage-retry">(.*?)</dd>', page)
    assert retried is not None and "by admin" in retried.group(1)
    forks = re.search(r'<dd id="forks">(.*?)</dd>', site.get(f"{BASE}runs/{source}").text)
    assert forks is not None and f'href="{BASE}runs/dash-fork"' in forks.group(1)


def test_keep_decisions_needs_the_right_to_approve(framework: str) -> None:
    site = _site(framework, make_pikku(), PIKKU_AUTHORIZE=fork_but_not_approve)
    source = _approved_source(site.pikku)
    page = site.get(f"{BASE}runs/{source}", user="reader")
    assert 'id="fork-keep-decisions"' in page.text
    field, token = page.form_token()
    refused = site.post(f"{BASE}runs/{source}/fork", {field: token, "from_step": "add",
                                                      "keep_decisions": "on"}, user="reader")
    assert refused.headers["Location"].endswith("?notice=fork-keep-refused")
    assert "needs the right to approve" in html.unescape(
        site.get(refused.headers["Location"], user="reader").text)
    assert site.pikku.list_forks(source) == []
    asked = site.post(f"{BASE}runs/{source}/fork", {field: token, "from_step": "add"},
                      user="reader")
    assert asked.headers["Location"].endswith("?notice=forked")
    [fork] = site.pikku.list_forks(source)
    assert fork.lineage[0].by == "reader" and fork.lineage[0].keep_decisions is False


def test_each_attempt_shows_the_total_it_ran_under(framework: str) -> None:
    site = _site(framework, make_pikku())
    store = site.pikku.engine.store
    t0 = now_ms() - 60_000
    store.create_run(NewRun("dash-totals", "sum", {"a": 2, "b": 3}), t0)
    store.insert_step(NewStep("dash-totals", "add", ADD, {"a": 2, "b": 3}, max_attempts=1), t0)
    assert store.claim_step("dash-totals", "add", ADD, t0 + 1_000, LEASE_MS).state is not None
    store.set_error("dash-totals", "add", 1, {"type": "E", "message": "no"}, t0 + 1_001)
    assert store.transition_run("dash-totals", ["running"], "failed", t0 + 2_000)
    assert store.retry_run("dash-totals", t0 + 3_000) is not None
    assert store.claim_step("dash-totals", "add", ADD, t0 + 4_000, LEASE_MS).state is not None

    page = site.get(f"{BASE}runs/dash-totals").text
    cells = re.findall(r'<tr data-step="add" data-attempt="\d+"[^>]*>\s*<td[^>]*>[^<]*</td>'
                       r"\s*<td>([^<]*)</td>", page)
    assert cells == ["1/1", "2/2"]
