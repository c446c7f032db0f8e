"""Approval gates on the dashboard's run page, the same for Flask and Django (issue 25 item
3): a gate is shown as a gate (name, approvers, expiry, schema, decision), a waiting one
gets a decision form that goes through ``pikku.approve`` (schema and approvers checked
server-side, authorized as ``approve`` told the gate, CSRF-checked), and a run waiting at
an approval is not offered Resume, which would change nothing.
``tests/integration/test_dashboard_approvals_browser.py`` drives the form in Chromium."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery import PikkuCelery, WorkflowContext
from tests.unit.test_contrib import authorize, identify, make_pikku
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site


def with_gates(pikku: PikkuCelery) -> PikkuCelery:
    @pikku.workflow("expiring")
    def expiring(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("finance", expiry="1d")

    return pikku


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    pikku = with_gates(make_pikku())
    # Flask names the signed-in user (PIKKU_IDENTIFY), as Django does by itself.
    yield (flask_site(pikku, PIKKU_IDENTIFY=identify) if request.param == "flask"
           else django_site(pikku))


def gate_block(text: str, name: str) -> str:
    found = re.search(rf'<div class="gate" data-gate="{name}".*?\n</div>', text, re.S)
    assert found is not None, f"no gate {name!r} on the page"
    return found.group(0)


def decide_path(run_id: str, gate: str = "manager") -> str:
    return f"{BASE}runs/{run_id}/approvals/{gate}"


def test_a_waiting_gate_is_shown_as_a_gate_with_a_form_and_no_resume(site: Site) -> None:
    run_id = site.pikku.start("gated", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200
    gate = gate_block(page.text, "manager")
    assert 'data-status="waiting"' in gate
    assert '<dd class="gate-approvers">admin</dd>' in gate
    assert "never" in gate  # no expiry
    assert html.escape('"type": "boolean"', quote=True) in gate or \
        '&#34;type&#34;: &#34;boolean&#34;' in gate
    # A boolean schema is two buttons (test_dashboard_decision_forms.py: every shape).
    assert f'action="{decide_path(run_id)}"' in gate and 'name="verdict" value="true"' in gate
    assert 'name="decision"' not in gate
    # The timeline and the attempts name the gate, never its stored step or "sleep".
    assert 'data-kind="approval"' in page.text
    assert re.search(r'class="step-label"[^>]*><title>manager \(waiting\)</title>manager',
                     page.text)
    assert 'data-kind="sleep"' not in page.text
    assert 'id="resume"' not in page.text and 'id="cancel"' in page.text


def test_an_expiring_gate_shows_its_expiry(site: Site) -> None:
    run_id = site.pikku.start("expiring", None, inline=True)
    gate = gate_block(site.get(f"{BASE}runs/{run_id}").text, "finance")
    assert "anyone" in gate and "any decision" in gate
    assert re.search(r'gate-expires">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z<', gate)


def test_a_decision_is_checked_against_the_schema_then_recorded(site: Site) -> None:
    run_id = site.pikku.start("gated", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()

    refused = site.post(decide_path(run_id), {field: token, "decision": '"yes"'})
    assert refused.status == 409
    assert "does not match its schema" in html.unescape(refused.text)
    not_json = site.post(decide_path(run_id), {field: token, "decision": "yes please"})
    assert not_json.status == 400 and "not JSON" in not_json.text
    empty = site.post(decide_path(run_id), {field: token, "decision": " "})
    assert empty.status == 400 and "no decision was given" in empty.text
    assert site.pikku.get_run(run_id).status == "suspended"

    done = site.post(decide_path(run_id), {field: token, "decision": "true"})
    assert done.status == 303, done.text
    assert done.headers["Location"].endswith(f"{BASE}runs/{run_id}?notice=decided")
    assert site.pikku.get_run(run_id).status == "running"
    after = site.get(done.headers["Location"])
    assert "decision recorded" in after.text
    gate = gate_block(after.text, "manager")
    assert 'data-status="decided"' in gate and 'name="verdict"' not in gate
    assert "by <span class=\"mono\">admin</span>" in gate  # the signed-in user, recorded
    [decided] = [a for a in site.pikku.get_history(run_id)
                 if a.step_name == "__approval:manager"]
    assert decided.worker == "admin" and decided.status == "succeeded"

    again = site.post(decide_path(run_id), {field: token, "decision": "true"})
    assert again.status == 409 and "already decided" in again.text


def test_a_decision_needs_the_token_and_the_approve_action(site: Site) -> None:
    run_id = site.pikku.start("gated", None, inline=True)
    site.get(f"{BASE}runs/{run_id}")
    refused = site.post(decide_path(run_id), {"decision": "true"})
    assert refused.status == 403 and "CSRF" in refused.text
    reader_page = site.get(f"{BASE}runs/{run_id}", user="reader")
    assert 'name="verdict"' not in reader_page.text
    assert "you may not decide this approval" in reader_page.text
    field, token = site.token("reader")
    as_reader = site.post(decide_path(run_id), {field: token, "decision": "true"},
                          user="reader")
    assert as_reader.status == 403 and "not allowed to" in as_reader.text
    assert site.pikku.get_run(run_id).status == "suspended"


def test_resume_of_a_run_waiting_at_an_approval_changes_nothing_and_says_so(
        site: Site) -> None:
    run_id = site.pikku.start("gated", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    answer = site.post(f"{BASE}runs/{run_id}/resume", {field: token})
    assert answer.status == 303
    assert answer.headers["Location"].endswith("notice=not-resumed-approval")
    assert "resume does not open" in site.get(answer.headers["Location"]).text
    assert site.pikku.get_run(run_id).status == "suspended"
    # A wf.suspend() run is still offered Resume.
    suspended = site.pikku.start("waits", None, inline=True)
    assert 'id="resume"' in site.get(f"{BASE}runs/{suspended}").text


def authorize_one_gate(request: Any, action: str, run_id: str | None, *,
                       gate: str | None = None) -> bool:
    """``admin`` may do everything but decide ``manager``."""
    return authorize(request, action, run_id) and not (action == "approve"
                                                      and gate == "manager")


def test_the_authorize_callable_is_told_the_gate() -> None:
    site = flask_site(with_gates(make_pikku()), PIKKU_IDENTIFY=identify,
                      PIKKU_AUTHORIZE=authorize_one_gate)
    gated = site.pikku.start("gated", None, inline=True)
    page = site.get(f"{BASE}runs/{gated}")
    assert 'name="verdict"' not in page.text and "you may not decide" in page.text
    field, token = page.form_token()  # the cancel button's
    refused = site.post(decide_path(gated), {field: token, "decision": "true"})
    assert refused.status == 403
    other = site.pikku.start("expiring", None, inline=True)
    assert 'name="decision"' in site.get(f"{BASE}runs/{other}").text
    assert site.post(decide_path(other, "finance"),
                     {field: token, "decision": '{"ok": 1}'}).status == 303


def test_a_gate_with_approvers_is_not_decidable_by_an_unnamed_caller() -> None:
    site = flask_site(make_pikku())  # no PIKKU_IDENTIFY: the server cannot tell who
    run_id = site.pikku.start("gated", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert 'name="verdict"' not in page.text
    assert "cannot tell who you are" in page.text and "--identity-header" in page.text
    field, token = page.form_token()
    refused = site.post(decide_path(run_id), {field: token, "decision": "true"})
    assert refused.status == 409 and "no approver" in refused.text
    assert site.pikku.get_run(run_id).status == "suspended"
