"""Events over the JSON API, the same for Flask and Django (issue 26 item 1): ``POST
api/runs/<run_id>/events/<name>`` sends one (``{"payload": ..., "key": ...}``, both
optional) under its own ``PIKKU_AUTHORIZE`` action, ``send_event``; ``GET
api/runs/<run_id>/events`` and the run's own JSON list the run's events with the wait that
took each; a resume of a run waiting only at an event wait is a 409 naming the event.
Who may call each route (anonymous, without the action, CSRF, cross-site) is in
``test_contrib``'s endpoint tables, which list these routes too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pikku_celery import PikkuCelery, WorkflowContext
from tests.unit.test_contrib import (
    PREFIX,
    Web,
    calls,
    django_web,
    flask_web,
    make_pikku,
    reconfigured,
)


def with_events(pikku: PikkuCelery) -> PikkuCelery:
    """``checkout``: publishes ``stage``, waits for ``paid``, publishes again and returns
    the payment."""
    @pikku.workflow("checkout")
    def checkout(wf: WorkflowContext, data: Any) -> Any:
        wf.set_event("stage", "waiting for payment")
        paid = wf.wait_for_event("paid", timeout="1d")
        wf.set_event("stage", "paid")
        return {"paid": paid}

    return pikku


@pytest.fixture(params=["flask", "django"])
def web(request: pytest.FixtureRequest) -> Iterator[Web]:
    calls.clear()
    pikku = with_events(make_pikku())
    yield flask_web(pikku) if request.param == "flask" else django_web(pikku)


def events_path(run_id: str, name: str | None = None) -> str:
    return PREFIX + f"/runs/{run_id}/events" + (f"/{name}" if name else "")


def test_an_event_is_sent_listed_and_taken(web: Web) -> None:
    pikku, call = web.pikku, web.call
    run_id = pikku.start("checkout", None, inline=True, run_id="co-1")
    assert pikku.get_run(run_id).status == "suspended"
    status, sent = call("POST", events_path(run_id, "shipped"),
                        {"payload": {"carrier": "ups"}, "key": "ship-1"})
    assert status == 200, sent
    assert sent["sent"] is True
    assert {k: sent["event"][k] for k in ("run_id", "name", "seq", "payload", "key")} == {
        "run_id": run_id, "name": "shipped", "seq": 1, "payload": {"carrier": "ups"},
        "key": "ship-1"}
    # The same key again: the first send's event, nothing more kept.
    again = call("POST", events_path(run_id, "shipped"), {"payload": "other", "key": "ship-1"})
    assert again[0] == 200 and again[1]["event"]["seq"] == 1
    status, paid = call("POST", events_path(run_id, "paid"), {"payload": 12})
    assert (status, paid["event"]["seq"], paid["event"]["key"]) == (200, 2, None)
    assert pikku.engine.dispatcher.wakes[-1][0] == run_id  # type: ignore[attr-defined]
    pikku.engine.advance(run_id)  # the wake the send asked for
    assert pikku.get_run(run_id).output == {"paid": 12}

    status, listed = call("GET", events_path(run_id))
    assert status == 200
    assert [(e["name"], e["seq"], e["key"], e["taken_by"], e["taken_by_step"])
            for e in listed["events"]] == [
        ("shipped", 1, "ship-1", None, None), ("paid", 2, None, "event paid", "__event:paid")]
    assert listed["events"][1]["sent_at"].endswith("+00:00")
    first = call("GET", events_path(run_id) + "?limit=1")[1]["events"]
    assert [e["seq"] for e in first] == [1]
    status, run = call("GET", PREFIX + f"/runs/{run_id}")
    assert status == 200 and run["events"] == listed["events"]
    assert run["status"] == "completed"


def test_a_body_without_a_payload_sends_null(web: Web) -> None:
    run_id = web.pikku.start("checkout", None, inline=True)
    status, sent = web.call("POST", events_path(run_id, "note"), {})
    assert status == 200 and sent["event"]["payload"] is None, sent
    assert [e.payload for e in web.pikku.list_events(run_id)] == [None]


def test_unknown_and_ended_runs_and_bad_input_are_refused(web: Web) -> None:
    pikku, call = web.pikku, web.call
    status, payload = call("POST", events_path("ghost", "paid"), {"payload": 1})
    assert (status, payload["error"]) == (404, "WorkflowRunNotFoundError")
    assert call("GET", events_path("ghost"))[0] == 404
    ended = pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    status, payload = call("POST", events_path(ended, "paid"), {"payload": 1})
    assert (status, payload["error"]) == (409, "WorkflowEventError")
    assert "has ended" in payload["message"]
    assert pikku.list_events(ended) == []
    live = pikku.start("checkout", None, inline=True)
    for body in ({"payload": 1, "by": "x"}, [1], {"key": 5}, {"key": ""}):
        status, payload = call("POST", events_path(live, "paid"), body)
        assert (status, payload["error"]) == (400, "InvalidInputError"), body
    # '#' is not allowed in a name (the reach suffix of a wait's step name).
    status, payload = call("POST", events_path(live, "pa%23id"), {"payload": 1})
    assert (status, payload["error"]) == (400, "InvalidInputError")
    assert "'#'" in payload["message"]
    status, payload = call("POST", events_path(live, "paid"), raw="{not json")
    assert (status, payload["error"]) == (400, "InvalidJSON")
    assert call("GET", events_path(live) + "?limit=0")[0] == 400
    assert pikku.list_events(live) == []
    assert pikku.get_run(live).status == "suspended"


def test_a_body_over_the_size_limit_is_413_and_sends_nothing(web: Web) -> None:
    run_id = web.pikku.start("checkout", None, inline=True)
    with reconfigured(web, MAX_BODY_BYTES=100):
        status, payload = web.call("POST", events_path(run_id, "paid"),
                                   {"payload": "x" * 200})
        assert (status, payload["error"]) == (413, "RequestTooLarge")
        assert web.call("POST", events_path(run_id, "paid"), {"payload": 1})[0] == 200
    assert [e.payload for e in web.pikku.list_events(run_id)] == [1]


def authorize_no_events(request: Any, action: str, run_id: str | None) -> bool:
    """``admin`` may do everything but send events; ``sender`` only read and send."""
    from tests.unit.test_contrib import authorize

    if hasattr(request, "user"):
        name = request.user.username if request.user.is_authenticated else None
    else:
        from flask import session

        name = session.get("user")
    if name == "reader" and action == "send_event":
        return True  # a sender who may read and send, nothing else
    return authorize(request, action, run_id) and action != "send_event"


def test_send_event_is_its_own_action(web: Web) -> None:
    pikku = web.pikku
    run_id = pikku.start("checkout", None, inline=True)
    with reconfigured(web, AUTHORIZE=authorize_no_events):
        call = web.call  # the reconfigured app's
        status, payload = call("POST", events_path(run_id, "paid"), {"payload": 1})
        assert (status, payload["error"]) == (403, "PermissionDenied")
        assert "send_event" in payload["message"]
        assert pikku.list_events(run_id) == []
        # Approving, cancelling... does not let one send; sending lets nothing else.
        status, _ = call("POST", events_path(run_id, "paid"), {"payload": 2}, user="reader")
        assert status == 200
        assert call("POST", PREFIX + f"/runs/{run_id}/cancel", {}, user="reader")[0] == 403
    assert [e.payload for e in pikku.list_events(run_id)] == [2]


def test_resume_of_a_run_waiting_at_an_event_is_a_409_naming_it(web: Web) -> None:
    run_id = web.pikku.start("checkout", None, inline=True)
    status, payload = web.call("POST", PREFIX + f"/runs/{run_id}/resume", {})
    assert (status, payload["error"]) == (409, "WorkflowWaitsForEvent")
    assert "'paid'" in payload["message"]
    assert f"api/runs/{run_id}/events/paid" in payload["message"]
    assert web.pikku.get_run(run_id).status == "suspended"
    assert web.pikku.engine.dispatcher.wakes == []  # type: ignore[attr-defined]


def test_a_tracebacks_shape_in_a_payload_is_not_served() -> None:
    """An event's payload is user data served as is, but for an error-shaped value's
    traceback (as everywhere in the API without ``PIKKU_SHOW_TRACEBACKS``)."""
    web = flask_web(with_events(make_pikku()))
    run_id = web.pikku.start("checkout", None, inline=True)
    error = {"type": "E", "message": "m", "traceback": "File secret.py"}
    assert web.call("POST", events_path(run_id, "note"), {"payload": error})[0] == 200
    served = json.dumps(web.call("GET", events_path(run_id) + "/1/payload")[1])
    assert "secret.py" not in served and '"message": "m"' in served
