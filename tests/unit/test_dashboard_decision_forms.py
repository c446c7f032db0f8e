"""Approvals a person can decide (issue 36 item 2): the dashboard shows a gate's schema as a
form (a boolean as Approve / Reject, an enum as a choice, strings and numbers as typed
fields, JSON only for what a form cannot show), the same for Flask and Django, each
decision still checked server-side against the schema by ``pikku.approve``; ``pikku
approve`` says "rejected" for a decision that says no; the standalone dashboard names its
callers from a header the user's proxy sets, when told to, and otherwise says what to do.
``tests/integration/test_dashboard_decision_browser.py`` drives the form in Chromium."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery import PikkuCelery, WorkflowContext
from pikku_celery.dashboard._decision import CHOICE, INTEGER, TEXT, form_of, read
from pikku_celery.dashboard.standalone import header_identity, make_app
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.operate._terminal import decided_verb
from tests.unit.test_cli import run_cli
from tests.unit.test_contrib import identify, make_pikku
from tests.unit.test_dashboard import BASE, Answer, Site, django_site, flask_site
from tests.unit.test_dashboard_approvals import decide_path, gate_block

REVIEW = {"type": "object", "required": ["approved"],
          "properties": {"approved": {"type": "boolean", "title": "Ship it?"},
                         "comment": {"type": "string", "maxLength": 50}}}
ROUTE = {"type": "object", "required": ["team", "priority"],
         "properties": {"team": {"enum": ["ops", "dev"]},
                        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                        "amount": {"type": "number", "default": 2.5},
                        "urgent": {"type": "boolean"}, "later": {"type": "boolean"},
                        "note": {"type": "string"}}}
PLAN = {"type": "object", "properties": {"items": {"type": "array"}}}


def with_decision_gates(pikku: PikkuCelery) -> PikkuCelery:
    @pikku.workflow("review")
    def review(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("review", schema=REVIEW, approvers=["admin"])

    @pikku.workflow("route")
    def route(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("route", schema=ROUTE)

    @pikku.workflow("plan")
    def plan(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("plan", schema=PLAN)

    return pikku


@pytest.fixture(params=["flask", "django"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    pikku = with_decision_gates(make_pikku())
    yield (flask_site(pikku, PIKKU_IDENTIFY=identify) if request.param == "flask"
           else django_site(pikku))


# --- the form a schema makes ---------------------------------------------------------------


def test_a_boolean_is_approve_or_reject_and_an_unshowable_schema_is_json() -> None:
    alone = form_of({"type": "boolean"})
    assert alone.verdict is not None and alone.verdict.name is None and not alone.fields
    assert read(alone, {"verdict": "false"}) is False
    review = form_of(REVIEW)
    assert review.verdict is not None and review.verdict.name == "approved"
    assert review.verdict.label == "Ship it?"
    [comment] = review.fields
    assert (comment.name, comment.kind, comment.required) == ("comment", TEXT, False)
    assert ("maxlength", "50") in comment.attrs
    assert read(review, {"verdict": "true", "field-0": ""}) == {"approved": True}
    assert read(review, {"verdict": "false", "field-0": "no"}) == {
        "approved": False, "comment": "no"}
    with pytest.raises(InvalidInputError, match="press Approve or Reject"):
        read(review, {"field-0": "x"})
    for unshowable in (None, True, {}, PLAN, {"type": ["string", "null"]},
                       {"anyOf": [{"type": "string"}]}, {"type": "object"},
                       {"type": "object", "properties": {"a": {"type": "string"}},
                        "required": ["a", "b"]},
                       {"enum": [[1], [2]]}):
        assert form_of(unshowable).raw, unshowable
    with pytest.raises(InvalidInputError, match="as JSON"):
        read(form_of(PLAN), {})


def test_enums_numbers_and_other_booleans_are_fields_of_their_type() -> None:
    route = form_of(ROUTE)
    assert route.verdict is None  # two booleans: each a yes / no choice, no buttons
    kinds = {f.name: (f.kind, f.required) for f in route.fields}
    assert kinds == {"team": (CHOICE, True), "priority": (INTEGER, True),
                     "amount": ("number", False), "urgent": (CHOICE, False),
                     "later": (CHOICE, False), "note": (TEXT, False)}
    by_name = {f.name: f for f in route.fields}
    assert by_name["team"].choices == ("ops", "dev")
    assert ("min", "1") in by_name["priority"].attrs and ("step", "1") in by_name[
        "priority"].attrs
    assert by_name["amount"].default == "2.5"
    k = {f.name: f.key for f in route.fields}
    posted = {k["team"]: "1", k["priority"]: "3", k["amount"]: "1e1", k["urgent"]: "1",
              k["later"]: "", k["note"]: "<b>"}
    assert read(route, posted) == {"team": "dev", "priority": 3, "amount": 10.0,
                                   "urgent": False, "note": "<b>"}
    for name, bad, why in (("priority", "2.5", "not a whole number"),
                           ("priority", "three", "not a number"),
                           ("amount", "NaN", "not a number"),
                           ("team", "7", "choose one"), ("team", "²", "choose one")):
        with pytest.raises(InvalidInputError, match=why):
            read(route, {**posted, k[name]: bad})
    assert read(form_of({"enum": ["a", 1, None]}), {"field-0": "2"}) is None
    assert read(form_of({"type": "string"}), {"field-0": ""}) == ""


# --- the run page and its POST ---------------------------------------------------------------


def test_a_yes_no_gate_is_two_buttons_and_reject_records_false(site: Site) -> None:
    run_id = site.pikku.start("review", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    gate = gate_block(page.text, "review")
    assert 'name="verdict" value="true"' in gate and ">Approve</button>" in gate
    assert 'name="verdict" value="false"' in gate and ">Reject</button>" in gate
    assert 'name="decision"' not in gate  # no JSON to type
    assert 'name="field-0" type="text" maxlength="50"' in gate
    # Enter in a field submits nothing: the form's first submit button is disabled.
    assert re.search(r'class="decide decide-fields">\s*<input type="hidden"[^>]*>\s*'
                     r'<button type="submit" disabled hidden', gate)
    field, token = page.form_token()

    unpressed = site.post(decide_path(run_id, "review"), {field: token, "field-0": "hm"})
    assert unpressed.status == 400 and "press Approve or Reject" in unpressed.text
    kept = gate_block(unpressed.text, "review")
    assert 'value="hm"' in kept  # what was typed, shown again
    assert site.pikku.get_run(run_id).status == "suspended"

    done = site.post(decide_path(run_id, "review"),
                     {field: token, "field-0": "not <yet>", "verdict": "false"})
    assert done.status == 303, done.text
    [gate_step] = site.pikku.get_steps(run_id)
    assert gate_step.result == {"approved": False, "comment": "not <yet>"}
    after = gate_block(site.get(done.headers["Location"]).text, "review")
    assert 'data-status="decided"' in after and 'name="verdict"' not in after
    assert "by <span class=\"mono\">admin</span>" in after


def keys_of(gate: str) -> dict[str, str]:
    """Each property's form field on a gate's form: ``{"team": "field-0", ...}``."""
    return dict(re.findall(r'data-field="([^"]+)">[^<]*<(?:input|select) name="([^"]+)"',
                           gate))


def test_field_forms_are_checked_by_the_schema_and_keep_what_was_typed(site: Site) -> None:
    run_id = site.pikku.start("route", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    gate = gate_block(page.text, "route")
    k = keys_of(gate)
    assert sorted(k) == ["amount", "later", "note", "priority", "team", "urgent"]
    assert list(k)[:2] == ["priority", "team"]  # the required fields first
    assert f'<select name="{k["team"]}" required>' in gate and ">ops</option>" in gate
    assert (f'name="{k["priority"]}" type="number" step="1" min="1" max="5" value="" '
            'required') in gate
    assert f'name="{k["amount"]}" type="number" step="any" value="2.5"' in gate
    assert 'name="verdict"' not in gate and ">Record decision</button>" in gate
    field, token = page.form_token()
    path = decide_path(run_id, "route")

    # Past the browser's own checks (a form posted by hand): the server refuses.
    too_big = site.post(path, {field: token, k["team"]: "0", k["priority"]: "9",
                               k["note"]: "<i>kept</i>"})
    assert too_big.status == 409 and "does not match its schema" in too_big.text
    kept = gate_block(too_big.text, "route")
    assert f'name="{k["priority"]}" type="number" step="1" min="1" max="5" value="9"' in kept
    assert 'value="&lt;i&gt;kept&lt;/i&gt;"' in kept  # escaped, as typed
    assert '<option value="0" selected>ops</option>' in kept
    missing = site.post(path, {field: token, k["priority"]: "2"})
    assert missing.status == 409 and "'team' is a required property" in html.unescape(
        missing.text)
    not_a_number = site.post(path, {field: token, k["team"]: "0", k["priority"]: "two"})
    assert not_a_number.status == 400 and "not a number" in not_a_number.text
    assert site.pikku.get_run(run_id).status == "suspended"

    no_token = site.post(path, {k["team"]: "0", k["priority"]: "2"})
    assert no_token.status == 403 and "CSRF" in no_token.text
    assert "you may not decide" in site.get(f"{BASE}runs/{run_id}", user="reader").text
    field_r, token_r = site.token("reader")
    as_reader = site.post(path, {field_r: token_r, k["team"]: "0", k["priority"]: "2"},
                          user="reader")
    assert as_reader.status == 403
    assert site.pikku.get_run(run_id).status == "suspended"

    done = site.post(path, {field: token, k["team"]: "1", k["priority"]: "2",
                            k["amount"]: "2.5", k["urgent"]: "0", k["later"]: ""})
    assert done.status == 303, done.text
    [gate_step] = site.pikku.get_steps(run_id)
    assert gate_step.result == {"team": "dev", "priority": 2, "amount": 2.5, "urgent": True}


def test_what_a_form_cannot_show_is_typed_as_json(site: Site) -> None:
    run_id = site.pikku.start("plan", None, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    gate = gate_block(page.text, "plan")
    assert 'textarea name="decision"' in gate and 'name="verdict"' not in gate
    field, token = page.form_token()
    refused = site.post(decide_path(run_id, "plan"),
                        {field: token, "decision": '{"items": "x"}'})
    assert refused.status == 409 and "does not match its schema" in refused.text
    assert "&#34;items&#34;: &#34;x&#34;}</textarea>" in refused.text  # kept, escaped
    unposted = site.post(decide_path(run_id, "plan"), {field: token})
    assert unposted.status == 400 and "no decision was given" in unposted.text
    done = site.post(decide_path(run_id, "plan"),
                     {field: token, "decision": '{"items": [1, 2]}'})
    assert done.status == 303
    assert site.pikku.get_steps(run_id)[0].result == {"items": [1, 2]}


def test_a_form_post_to_a_gate_the_run_has_not_reached_is_refused(site: Site) -> None:
    run_id = site.pikku.start("route", None, inline=True)
    field, token = site.get(f"{BASE}runs/{run_id}").form_token()
    answer = site.post(decide_path(run_id, "elsewhere"), {field: token, "verdict": "true"})
    assert answer.status == 409 and "has not reached it" in answer.text


# --- the standalone dashboard: who decides ---------------------------------------------------

TOKEN = "t" * 24


def standalone(pikku: PikkuCelery, **options: Any) -> Any:
    """A browser of the standalone app, logged in with its token."""
    client = make_app(pikku, token=TOKEN, **options).test_client()
    assert client.get("/?token=" + TOKEN).status_code == 303
    return client


def page_of(response: Any) -> Answer:
    return Answer(response.status_code, response.get_data(as_text=True),
                  dict(response.headers))


def test_standalone_names_the_caller_from_the_configured_header() -> None:
    pikku = with_decision_gates(make_pikku())
    run_id = pikku.start("review", None, inline=True)
    client = standalone(pikku, identity_header="X-Forwarded-User")
    as_admin = {"X-Forwarded-User": "admin"}
    page = page_of(client.get(f"/runs/{run_id}", headers=as_admin))
    assert 'name="verdict" value="false"' in gate_block(page.text, "review")
    field, token = page.form_token()

    # The header names someone else, or no one: no form, and a POST is refused.
    other = page_of(client.get(f"/runs/{run_id}", headers={"X-Forwarded-User": "eve"}))
    assert "only its approvers may decide it; you are eve" in other.text
    assert 'name="verdict"' not in other.text
    as_eve = client.post(f"/runs/{run_id}/approvals/review",
                         data={field: token, "verdict": "true"},
                         headers={"X-Forwarded-User": "eve"})
    assert as_eve.status_code == 409
    assert "'eve' is not one of its approvers" in html.unescape(as_eve.get_data(as_text=True))
    bare = page_of(client.get(f"/runs/{run_id}"))
    assert "cannot tell who you are" in bare.text and "--identity-header" in bare.text
    doubled = page_of(client.get(f"/runs/{run_id}",
                                 headers={"X-Forwarded-User": "eve, admin"}))
    assert "cannot tell who you are" in doubled.text
    assert pikku.get_run(run_id).status == "suspended"

    done = client.post(f"/runs/{run_id}/approvals/review",
                       data={field: token, "verdict": "false"}, headers=as_admin)
    assert done.status_code == 303
    [gate_step] = pikku.get_steps(run_id)
    assert gate_step.result == {"approved": False}
    [decided] = [a for a in pikku.get_history(run_id) if a.step_name == "__approval:review"]
    assert decided.worker == "admin"
    # The JSON API takes the header's name as the approver too.
    again = pikku.start("review", None, inline=True)
    api = client.post(f"/api/runs/{again}/approvals/review", json={"decision": {
        "approved": True}}, headers={**as_admin, "Authorization": "Bearer " + TOKEN})
    assert api.status_code == 200, api.get_data(as_text=True)


def test_standalone_without_the_header_option_says_what_to_do() -> None:
    pikku = with_decision_gates(make_pikku())
    run_id = pikku.start("review", None, inline=True)
    client = standalone(pikku)  # the header is not trusted unless configured
    page = page_of(client.get(f"/runs/{run_id}", headers={"X-Forwarded-User": "admin"}))
    gate = gate_block(page.text, "review")
    assert 'name="verdict"' not in gate
    why = html.unescape(gate)
    assert "cannot tell who you are" in why and "--identity-header" in why
    assert "PIKKU_IDENTIFY" in why
    field, token = page.form_token()
    refused = client.post(f"/runs/{run_id}/approvals/review",
                          data={field: token, "verdict": "true"},
                          headers={"X-Forwarded-User": "admin"})
    assert refused.status_code == 409 and "no approver" in refused.get_data(as_text=True)
    api = client.post(f"/api/runs/{run_id}/approvals/review",
                      json={"decision": {"approved": True}, "by": "admin"},
                      headers={"Authorization": "Bearer " + TOKEN})
    assert api.status_code == 403 and "--identity-header" in api.json["message"]
    assert pikku.get_run(run_id).status == "suspended"


@pytest.mark.parametrize("name", ["X_User", "Authorization", "x-forwarded-for", "",
                                  "X User", "Cookie"])
def test_an_identity_header_must_be_one_a_proxy_can_set(name: str) -> None:
    with pytest.raises(ValueError, match="cannot be the identity header"):
        header_identity(name)
    with pytest.raises(ValueError, match="cannot be the identity header"):
        make_app(make_pikku(), token=TOKEN, identity_header=name)


def test_pikku_dashboard_takes_the_identity_header(monkeypatch: pytest.MonkeyPatch) -> None:
    from pikku_celery.dashboard import standalone as module

    made: dict[str, Any] = {}

    def fake_server(app: Any, host: str, port: int) -> Any:
        made["app"] = app
        raise RuntimeError("not serving in a test")

    monkeypatch.setattr(module, "create_server", fake_server)
    monkeypatch.setenv("PIKKU_DASHBOARD_TOKEN", TOKEN)
    pikku = make_pikku()
    answer = run_cli(pikku, "dashboard", "--identity-header", "X-Remote-User")
    assert "not serving in a test" in answer.output
    rules = made["app"].extensions["pikku"].rules
    with made["app"].test_request_context("/", headers={"X-Remote-User": "ann"}):
        from flask import request
        assert rules.identify(request) == "ann"
    bad = run_cli(pikku, "dashboard", "--identity-header", "X_User")
    assert bad.exit_code != 0 and "cannot be the identity header" in bad.output


# --- pikku approve: approved or rejected ----------------------------------------------------


def test_decided_verb_says_rejected_for_a_no() -> None:
    assert decided_verb(False) == "rejected"
    assert decided_verb({"approved": False}) == "rejected"
    assert decided_verb({"approved": False, "comment": "x"}, REVIEW) == "rejected"
    assert decided_verb({"ship": False}, {"properties": {"ship": {"type": "boolean"}}}) \
        == "rejected"
    assert decided_verb({"ship": False}) == "approved"  # no schema saying it is the answer
    assert decided_verb({"urgent": False, "later": True}, ROUTE) == "approved"  # two
    for yes in (True, {"approved": True}, "yes", 0, None, [False]):
        assert decided_verb(yes) == "approved"


def test_pikku_approve_prints_rejected_for_a_no() -> None:
    pikku = with_decision_gates(make_pikku())
    gated = pikku.start("gated", None, inline=True)
    no = run_cli(pikku, "approve", gated, "manager", "--decision", "false", "--by", "admin")
    assert no.exit_code == 0, no.output
    assert no.output == f"rejected 'manager' of run {gated}: false\n"
    review = pikku.start("review", None, inline=True)
    said = run_cli(pikku, "approve", review, "review", "--decision", '{"approved": false}',
                   "--by", "admin")
    assert said.output == f'rejected \'review\' of run {review}: {{"approved": false}}\n'
    yes = pikku.start("review", None, inline=True)
    assert run_cli(pikku, "approve", yes, "review", "--decision", '{"approved": true}',
                   "--by", "admin").output.startswith("approved 'review'")
