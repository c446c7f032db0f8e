"""The run page's Retry button and Fork form, the same for Flask and Django (issue 25 item
2): Retry (``pikku.retry``, action ``retry``) is offered for a failed or cancelled run and
refuses any other with a notice; Fork (``pikku.fork``, action ``fork`` on the run forked
from) offers the run's recorded steps and an optional new run id, goes to the new run's
page, and refuses an unknown step, a bad or a taken id with a notice. Both are authorized
per action and CSRF-checked like Cancel and Resume.
``tests/integration/test_dashboard_retry_browser.py`` clicks Retry in Chromium."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.test_contrib import authorize, make_pikku
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    pikku = make_pikku()
    yield flask_site(pikku) if request.param == "flask" else django_site(pikku)


def cancelled_run(site: Site) -> str:
    run_id = site.pikku.start("waits", None, inline=True)
    assert site.pikku.cancel(run_id, "by the test")
    return run_id


def fork_options(text: str) -> list[str]:
    form = re.search(r'<form [^>]*id="fork-form">.*?</form>', text, re.S)
    assert form is not None, "no fork form on the page"
    return re.findall(r'<option value="([^"]+)"', form.group(0))


def test_retry_of_a_cancelled_run_runs_it_again(site: Site) -> None:
    run_id = cancelled_run(site)
    page = site.get(f"{BASE}runs/{run_id}")
    assert f'action="{BASE}runs/{run_id}/retry" id="retry-form"' in page.text
    assert 'id="retry"' in page.text and 'id="cancel"' not in page.text
    field, token = page.form_token()
    done = site.post(f"{BASE}runs/{run_id}/retry", {field: token})
    assert done.status == 303, done.text
    assert done.headers["Location"].endswith(f"{BASE}runs/{run_id}?notice=retried")
    assert site.pikku.get_run(run_id).status == "running"
    after = site.get(done.headers["Location"])
    assert "run retried" in after.text and 'id="retry"' not in after.text


def test_a_failed_run_is_offered_retry(site: Site) -> None:
    run_id = site.pikku.start("fails", None, inline=True)
    assert site.pikku.get_run(run_id).status == "failed"
    page = site.get(f"{BASE}runs/{run_id}")
    assert 'id="retry"' in page.text
    field, token = page.form_token()
    assert site.post(f"{BASE}runs/{run_id}/retry", {field: token}).status == 303
    assert site.pikku.get_run(run_id).status == "running"


def test_retry_of_a_completed_run_is_refused_with_a_notice(site: Site) -> None:
    run_id = site.pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert 'id="retry"' not in page.text  # not offered
    field, token = page.form_token()  # the fork form's
    refused = site.post(f"{BASE}runs/{run_id}/retry", {field: token})
    assert refused.status == 303
    assert refused.headers["Location"].endswith(f"{BASE}runs/{run_id}?notice=not-retried")
    back = site.get(refused.headers["Location"])
    assert back.status == 200 and "nothing to retry" in back.text
    assert "Traceback" not in back.text
    assert site.pikku.get_run(run_id).status == "completed"


def test_fork_creates_the_new_run_and_goes_to_its_page(site: Site) -> None:
    source = site.pikku.start("sum", {"a": 2, "b": 3}, inline=True, run_id="fork-src")
    page = site.get(f"{BASE}runs/{source}")
    assert fork_options(page.text) == ["add"]
    field, token = page.form_token()
    done = site.post(f"{BASE}runs/{source}/fork",
                     {field: token, "from_step": "add", "run_id": "fork-new"})
    assert done.status == 303, done.text
    assert done.headers["Location"].endswith(f"{BASE}runs/fork-new?notice=forked")
    forked = site.pikku.get_run("fork-new")
    assert (forked.workflow, forked.input) == ("sum", {"a": 2, "b": 3})
    assert site.pikku.get_run(source).status == "completed"  # untouched
    shown = site.get(done.headers["Location"])
    assert shown.status == 200 and "run forked" in shown.text
    # No id typed: one is generated, and the browser goes to it.
    generated = site.post(f"{BASE}runs/{source}/fork",
                          {field: token, "from_step": "add", "run_id": " "})
    assert generated.status == 303
    location = generated.headers["Location"]
    assert location.endswith("?notice=forked") and f"runs/{source}?" not in location
    new_id = re.search(r"runs/([^?]+)\?", location)
    assert new_id is not None and site.pikku.get_run(new_id.group(1)).workflow == "sum"


def test_fork_refuses_an_unknown_step_a_bad_id_and_a_taken_id(site: Site) -> None:
    source = site.pikku.start("sum", {"a": 2, "b": 3}, inline=True, run_id="src-2")
    site.pikku.start("sum", {"a": 9, "b": 9}, inline=True, run_id="taken")
    field, token = site.get(f"{BASE}runs/{source}").form_token()
    before = len(site.pikku.list_runs(limit=100))
    for form, notice, text in (
            ({"from_step": "nope"}, "fork-unknown-step", "recorded no such step"),
            ({}, "fork-unknown-step", "recorded no such step"),
            ({"from_step": "add", "run_id": "a/b"}, "fork-bad-run-id", "a new run id is"),
            ({"from_step": "add", "run_id": "@child"}, "fork-bad-run-id", "not @ first"),
            ({"from_step": "add", "run_id": "taken"}, "fork-run-id-taken", "is taken")):
        refused = site.post(f"{BASE}runs/{source}/fork", {field: token, **form})
        assert refused.status == 303, (form, refused.text)
        assert refused.headers["Location"].endswith(
            f"{BASE}runs/{source}?notice={notice}"), form
        assert text in html.unescape(site.get(refused.headers["Location"]).text), form
    assert len(site.pikku.list_runs(limit=100)) == before
    assert site.pikku.get_run("taken").input == {"a": 9, "b": 9}


def test_a_caller_without_the_action_gets_403_and_no_button(site: Site) -> None:
    run_id = cancelled_run(site)
    reader = site.get(f"{BASE}runs/{run_id}", user="reader")
    assert reader.status == 200
    assert 'id="retry"' not in reader.text and 'id="fork-form"' not in reader.text
    field, token = site.token("reader")
    for action, form in (("retry", {}), ("fork", {"from_step": "__suspend:approval"})):
        refused = site.post(f"{BASE}runs/{run_id}/{action}", {field: token, **form},
                            user="reader")
        assert refused.status == 403 and "not allowed to" in refused.text, action
    assert site.pikku.get_run(run_id).status == "cancelled"
    assert len(site.pikku.list_runs(limit=100)) == 1


def authorize_no_fork(request: Any, action: str, run_id: str | None) -> bool:
    """``admin`` may do everything but fork."""
    return authorize(request, action, run_id) and action != "fork"


@pytest.mark.parametrize("framework", ["flask", "django"])
def test_each_action_is_authorized_on_its_own(framework: str) -> None:
    make = flask_site if framework == "flask" else django_site
    site = make(make_pikku(), PIKKU_AUTHORIZE=authorize_no_fork)
    run_id = cancelled_run(site)
    page = site.get(f"{BASE}runs/{run_id}")
    assert 'id="retry"' in page.text and 'id="fork-form"' not in page.text
    field, token = page.form_token()
    refused = site.post(f"{BASE}runs/{run_id}/fork",
                        {field: token, "from_step": "__suspend:approval"})
    assert refused.status == 403
    assert site.post(f"{BASE}runs/{run_id}/retry", {field: token}).status == 303


def test_a_post_without_the_token_is_refused(site: Site) -> None:
    run_id = cancelled_run(site)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    for action, form in (("retry", {"x": "1"}),
                         ("fork", {"from_step": "__suspend:approval"}),
                         ("retry", {field: "y" * len(token)})):
        refused = site.post(f"{BASE}runs/{run_id}/{action}", form)
        assert refused.status == 403 and "CSRF" in refused.text, (action, form)
    assert site.pikku.get_run(run_id).status == "cancelled"
    assert len(site.pikku.list_runs(limit=100)) == 1


def test_a_fork_form_too_large_is_refused(site: Site) -> None:
    run_id = cancelled_run(site)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    answer = site.post(f"{BASE}runs/{run_id}/fork",
                       {field: token, "from_step": "x" * 20_000})
    assert answer.status == 413
    assert len(site.pikku.list_runs(limit=100)) == 1
