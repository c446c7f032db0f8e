"""The ``redact_value`` hook (issue 35 item 5): every user value the web surface shows (a
run's input, output and state, a step's input and result, an event's payload, a schedule's
data) goes through ``PikkuCelery(redact_value=...)`` / ``pikku_redact_value``, told what it
shows, in the JSON API and on the dashboard, Flask and Django alike; what is stored is never
changed; a hook that raises or returns what JSON cannot hold shows ``[redaction failed]``,
never the value, and is logged once by name, never with the value."""

from __future__ import annotations

import html
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowContext,
)
from pikku_celery.model.redaction import REDACTION_FAILED, VALUE_KINDS, redact_value
from tests.unit.test_contrib import PREFIX, Web, django_web, flask_web
from tests.unit.test_dashboard import BASE, Site, django_site, flask_site
from tests.unit.test_dashboard_events import block
from tests.unit.test_engine import Recorder

CARD = "4111-1111-1111-1111"
Hook = Callable[[Any, str], Any]
seen: list[str] = []


def mask(value: Any, where: str) -> Any:
    """Every value shown as ``{"masked": where}``."""
    seen.append(where)
    return {"masked": where}


def scrub(value: Any, where: str) -> Any:
    """Changes the value it is given in place (a copy: nothing stored changes)."""
    if isinstance(value, dict) and "card" in value:
        value["card"] = "****"
    return value


def fails_on_input(value: Any, where: str) -> Any:
    if where == "input":
        raise RuntimeError(f"cannot redact {value!r}")  # quotes the value: never logged
    return value


def returns_a_set(value: Any, where: str) -> Any:
    return {CARD} if where == "output" else value


def make(hook: Hook | str | None) -> PikkuCelery:
    """A ``PikkuCelery`` on in-memory services (its dispatcher only records) whose
    workflows put ``CARD`` in every kind of value."""
    pikku = PikkuCelery(Celery("redacting", broker="memory://", set_as_current=False),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False, redact_value=hook)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="redact.charge")
    def charge(data: dict[str, Any]) -> dict[str, Any]:
        return {"receipt": data["card"]}

    @pikku.step(name="redact.boom", retries=0)
    def boom(data: Any) -> None:
        raise RuntimeError("declined")

    @pikku.step(name="redact.undo", retries=0)
    def undo(failure: Any) -> dict[str, Any]:
        return {"card": failure["data"]["card"]}

    @pikku.workflow("pay")
    def pay(wf: WorkflowContext, data: Any) -> Any:
        receipt = wf.do("charge", charge, data)
        wf.set_state("charged", {"card": data["card"]})
        wf.set_event("stage", {"card": data["card"]})
        decision = wf.approval("manager")
        return {"card": data["card"], "receipt": receipt, "decision": decision}

    @pikku.workflow("refund")
    def refund(wf: WorkflowContext, data: Any) -> Any:
        return wf.do("boom", boom, data, on_error=undo)

    @pikku.workflow("paid")
    def paid(wf: WorkflowContext, data: Any) -> Any:
        return {"card": data["card"]}

    pikku.schedule("nightly", "paid", every="1h", data={"card": CARD})
    pikku.get_schedule("nightly")  # saved, as a worker does when it starts
    return pikku


def paid_run(pikku: PikkuCelery) -> str:
    """A completed ``pay`` run: charged, published, sent an event, approved."""
    run_id = pikku.start("pay", {"card": CARD}, inline=True, run_id="pay-1")
    pikku.send_event(run_id, "note", {"card": CARD})
    pikku.approve(run_id, "manager", {"card": CARD}, by="admin")
    pikku.engine.advance(run_id)
    assert pikku.get_run(run_id).status == "completed"
    return run_id


def stored_unchanged(pikku: PikkuCelery, run_id: str) -> None:
    run = pikku.get_run(run_id)
    assert run.input == {"card": CARD} and run.output["card"] == CARD
    assert run.state == {"card": CARD}
    charge = next(s for s in pikku.get_steps(run_id) if s.step_name == "charge")
    assert (charge.data, charge.result) == ({"card": CARD}, {"receipt": CARD})
    assert [e.payload for e in pikku.list_events(run_id)] == [{"card": CARD}]
    assert pikku.get_schedule("nightly").data == {"card": CARD}


# --- the hook itself ----------------------------------------------------------------------


def test_without_a_hook_a_value_is_shown_as_it_is() -> None:
    value = {"card": CARD}
    assert redact_value(value, "input", None) is value


def test_a_failing_hook_shows_the_placeholder_and_logs_once_without_the_value(
        caplog: pytest.LogCaptureFixture) -> None:
    for hook, where in ((fails_on_input, "input"), (returns_a_set, "output")):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="pikku_celery.redaction"):
            assert redact_value({"card": CARD}, where, hook) == REDACTION_FAILED
        [record] = caplog.records
        text = record.getMessage()
        assert record.levelno == logging.ERROR
        assert f"{__name__}.{hook.__name__}" in text and repr(where) in text
        assert CARD not in text and "cannot redact" not in text


def test_the_setting_takes_a_dotted_path_and_refuses_what_is_not_callable() -> None:
    app = Celery("redacting-conf", broker="memory://", set_as_current=False)
    app.conf.pikku_redact_value = f"{__name__}:mask"
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    assert pikku.settings.redact_value is mask
    with pytest.raises(ValueError, match=r"invalid redact_value: .*\(value, where: str\)"):
        PikkuCelery(Celery("bad", broker="memory://", set_as_current=False),
                    worker_reaper=False, redact_value=5)  # type: ignore[arg-type]
    bad = Celery("bad-conf", broker="memory://", set_as_current=False)
    bad.conf.pikku_redact_value = "no.such.module:hook"
    with pytest.raises(ValueError, match="invalid pikku_redact_value: cannot import"):
        _ = PikkuCelery(bad, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False).settings


# --- the JSON API -------------------------------------------------------------------------


def web_of(framework: str, hook: Hook) -> Web:
    pikku = make(hook)
    return flask_web(pikku) if framework == "flask" else django_web(pikku)


@pytest.fixture(params=["flask", "django"])
def framework(request: pytest.FixtureRequest) -> Iterator[str]:
    seen.clear()
    yield request.param


def test_the_api_shows_every_value_redacted(framework: str) -> None:
    web = web_of(framework, mask)
    pikku, call = web.pikku, web.call
    run_id = paid_run(pikku)
    status, run = call("GET", PREFIX + f"/runs/{run_id}")
    assert status == 200, run
    assert [run[k] for k in ("input", "output", "state")] == [
        {"masked": "input"}, {"masked": "output"}, {"masked": "state"}]
    [listed] = call("GET", PREFIX + "/runs")[1]["runs"]
    assert (listed["input"], listed["output"]) == ({"masked": "input"}, {"masked": "output"})
    status, charge = call("GET", PREFIX + f"/runs/{run_id}/steps/charge")
    assert status == 200, charge
    assert (charge["data"], charge["result"]) == (
        {"masked": "step_input"}, {"masked": "step_result"})
    status, gate = call("GET", PREFIX + f"/runs/{run_id}/steps/__approval:manager")
    assert status == 200 and gate["result"] == {"masked": "step_result"}, gate
    seen.clear()  # the pages without values call no hook
    for path in ("steps", "history", "events"):
        assert call("GET", PREFIX + f"/runs/{run_id}/{path}")[0] == 200
    assert seen == []
    status, event = call("GET", PREFIX + f"/runs/{run_id}/events/1/payload")
    assert (status, event["payload"]) == (200, {"masked": "event_payload"}), event
    [schedule] = call("GET", PREFIX + "/schedules")[1]["schedules"]
    assert schedule["data"] == {"masked": "schedule_data"}
    status, paused = call("POST", PREFIX + "/schedules/nightly/pause", {})
    assert (status, paused["schedule"]["data"]) == (200, {"masked": "schedule_data"})
    assert CARD not in web.body.decode()
    assert set(seen) <= set(VALUE_KINDS)
    stored_unchanged(pikku, run_id)


def test_the_api_shows_a_sent_event_and_a_decided_step_redacted(framework: str) -> None:
    web = web_of(framework, mask)
    pikku, call = web.pikku, web.call
    run_id = pikku.start("pay", {"card": CARD}, inline=True)
    status, sent = call("POST", PREFIX + f"/runs/{run_id}/events/note", {"payload": CARD})
    assert (status, sent["event"]["payload"]) == (200, {"masked": "event_payload"}), sent
    status, approved = call("POST", PREFIX + f"/runs/{run_id}/approvals/manager",
                            {"decision": {"card": CARD}})
    assert status == 200, approved
    assert (approved["step"]["data"], approved["step"]["result"]) == (
        {"masked": "step_input"}, {"masked": "step_result"})
    assert CARD not in web.body.decode()
    assert pikku.list_events(run_id)[-1].payload == CARD


def test_a_hook_that_changes_its_value_changes_nothing_stored(framework: str) -> None:
    web = web_of(framework, scrub)
    run_id = paid_run(web.pikku)
    run = web.call("GET", PREFIX + f"/runs/{run_id}")[1]
    assert run["input"] == {"card": "****"} and run["state"] == {"card": "****"}
    assert web.call("GET", PREFIX + f"/runs/{run_id}/events/1/payload")[1]["payload"] == {
        "card": "****"}
    assert web.call("GET", PREFIX + "/schedules")[1]["schedules"][0]["data"] == {
        "card": "****"}
    stored_unchanged(web.pikku, run_id)


def test_a_failing_hook_shows_the_placeholder_over_the_api(
        framework: str, caplog: pytest.LogCaptureFixture) -> None:
    web = web_of(framework, fails_on_input)
    run_id = paid_run(web.pikku)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.redaction"):
        status, run = web.call("GET", PREFIX + f"/runs/{run_id}")
    assert status == 200, run
    assert run["input"] == REDACTION_FAILED and run["output"]["card"] == CARD
    [record] = [r for r in caplog.records if r.name == "pikku_celery.redaction"]
    assert "fails_on_input" in record.getMessage() and CARD not in record.getMessage()
    stored_unchanged(web.pikku, run_id)


def test_a_hook_returning_what_is_not_json_shows_the_placeholder(
        framework: str, caplog: pytest.LogCaptureFixture) -> None:
    web = web_of(framework, returns_a_set)
    run_id = paid_run(web.pikku)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.redaction"):
        status, run = web.call("GET", PREFIX + f"/runs/{run_id}")
    assert (status, run["output"]) == (200, REDACTION_FAILED), run
    [record] = [r for r in caplog.records if r.name == "pikku_celery.redaction"]
    assert "returns_a_set" in record.getMessage() and CARD not in record.getMessage()


# --- the dashboard ------------------------------------------------------------------------


def site_of(framework: str, hook: Hook) -> Site:
    pikku = make(hook)
    return flask_site(pikku) if framework == "flask" else django_site(pikku)


def masked(text: str, where: str) -> bool:
    return f'"masked": "{where}"' in html.unescape(text)


def test_the_run_page_shows_every_value_redacted(framework: str) -> None:
    site = site_of(framework, mask)
    run_id = paid_run(site.pikku)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200, page.text
    assert masked(block(page.text, "input", "pre"), "input")
    assert masked(block(page.text, "output", "pre"), "output")
    assert masked(block(page.text, "approvals", "div"), "step_result")  # the decision
    assert masked(block(page.text, "event-waits", "table"), "step_result")  # published
    assert CARD not in html.unescape(page.text)
    stored_unchanged(site.pikku, run_id)


def test_the_run_page_shows_a_compensation_redacted(framework: str) -> None:
    site = site_of(framework, mask)
    run_id = site.pikku.start("refund", {"card": CARD}, inline=True)
    page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200, page.text
    assert masked(block(page.text, "compensations", "table"), "step_result")
    assert CARD not in html.unescape(page.text)
    [undo] = [s for s in site.pikku.get_steps(run_id) if s.step_name.endswith(":on_error")]
    assert undo.result == {"card": CARD}


def test_the_schedules_page_shows_data_redacted(framework: str) -> None:
    site = site_of(framework, mask)
    page = site.get(f"{BASE}schedules")
    assert page.status == 200, page.text
    assert masked(block(page.text, "schedule-nightly", "tr"), "schedule_data")
    assert CARD not in html.unescape(page.text)
    assert site.pikku.get_schedule("nightly").data == {"card": CARD}


def test_a_failing_hook_shows_the_placeholder_on_the_run_page(
        framework: str, caplog: pytest.LogCaptureFixture) -> None:
    site = site_of(framework, fails_on_input)
    run_id = paid_run(site.pikku)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.redaction"):
        page = site.get(f"{BASE}runs/{run_id}")
    assert page.status == 200, page.text
    assert REDACTION_FAILED in html.unescape(block(page.text, "input", "pre"))
    assert CARD in html.unescape(block(page.text, "output", "pre"))  # the hook kept it
    [record] = [r for r in caplog.records if r.name == "pikku_celery.redaction"]
    assert "fails_on_input" in record.getMessage() and CARD not in record.getMessage()
