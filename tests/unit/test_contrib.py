"""The JSON API over HTTP, the same for Flask and Django: who may call each endpoint (every
endpoint: anonymous, an action the caller lacks, CSRF, a cross-site text/plain POST), what
a body must be, how errors are served.

Both frameworks run on a ``PikkuCelery`` with in-memory store and leases whose dispatcher
only records (no broker). Django uses the test project of ``tests/djangoproject`` (its
settings, URLconf and sqlite database) with the API pointed at this test's instance; Flask
a small app with the same users: ``admin`` may do everything, ``reader`` may only read,
``nobody`` is logged in and may do nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    PikkuCelery,
    WorkflowContext,
)
from pikku_celery.contrib._api import ROUTES
from tests.support import django_project
from tests.unit.test_engine import Recorder

PREFIX = "/pikku/api"
CSRF_TOKEN = "t" * 32  # a valid CSRF secret: the cookie and the header carry the same
USERS = ("admin", "reader", "nobody")
EVIL = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}


def authorize(request: Any, action: str, run_id: str | None) -> bool:
    """``PIKKU_AUTHORIZE`` of both test apps (Django passes its request, Flask its own)."""
    if hasattr(request, "user"):  # Django
        name = request.user.username if request.user.is_authenticated else None
    else:
        from flask import abort, session

        name = session.get("user")
        if name is None:
            abort(401)
    calls.append((action, run_id))
    return name == "admin" or (name == "reader" and action == "read")


calls: list[tuple[str, str | None]] = []


def identify(request: Any) -> str | None:
    """``PIKKU_IDENTIFY`` of the Flask test app: the signed-in user, as Django's."""
    from flask import session

    name = session.get("user")
    return None if name is None else str(name)


# --- the app under test -------------------------------------------------------------------


def make_pikku() -> PikkuCelery:
    pikku = PikkuCelery(Celery("contrib", broker="memory://", set_as_current=False),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="contrib.add")
    def add(data: dict[str, int]) -> int:
        return data["a"] + data["b"]

    @pikku.step(name="contrib.boom", retries=0)
    def boom(data: Any) -> None:
        raise RuntimeError("cannot reach mongodb://app:hunter2@db:27017")

    @pikku.step(name="contrib.undo", retries=0)
    def undo(failure: Any) -> str:
        return "undone"

    @pikku.workflow("sum")
    def total(wf: WorkflowContext, data: Any) -> Any:
        return wf.do("add", add, data)

    @pikku.workflow("fails")
    def fails(wf: WorkflowContext, data: Any) -> Any:
        return wf.do("boom", boom, data, on_error=undo)

    @pikku.workflow("waits")
    def waits(wf: WorkflowContext, data: Any) -> Any:
        wf.suspend("approval")
        return "approved"

    @pikku.workflow("gated")
    def gated(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("manager", schema={"type": "boolean"}, approvers=["admin"])

    return pikku


Call = Callable[..., tuple[int, Any]]


@dataclass
class Web:
    """One framework's app: ``call(method, path, body, user=..., ...)``."""

    framework: str
    pikku: PikkuCelery
    call: Call
    settings: dict[str, Any] = field(default_factory=dict)  # Django's, per request
    body: bytes = b""  # the last response's body, byte for byte


def flask_web(pikku: PikkuCelery, **config: Any) -> Web:
    """Signed-in users are identified (``PIKKU_IDENTIFY``) unless ``config`` says else."""
    from flask import Flask

    from pikku_celery.contrib.flask import PikkuFlask

    app = Flask("contrib-test")
    app.config.update({"SECRET_KEY": "tests", "PIKKU_AUTHORIZE": authorize,
                       "PIKKU_IDENTIFY": identify, **config})
    PikkuFlask(pikku).init_app(app)

    def call(method: str, path: str, body: Any = None, *, user: str | None = "admin",
             raw: str | bytes | None = None, content_type: str = "application/json",
             headers: dict[str, str] | None = None, csrf: bool = True) -> tuple[int, Any]:
        client = app.test_client()
        if user is not None:
            with client.session_transaction() as session:
                session["user"] = user
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        response = client.open(path, method=method, data=data, headers=headers or {},
                               content_type=content_type if method == "POST" else None)
        web.body = response.get_data()
        return response.status_code, response.get_json(silent=True)

    web = Web("flask", pikku, call)
    return web


def django_web(pikku: PikkuCelery, **overrides: Any) -> Web:
    """Every request runs under ``override_settings`` of ``web.settings``."""
    django_project.setup()
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    for name in USERS:
        User.objects.get_or_create(username=name, defaults={"is_staff": name == "admin"})
    settings = {"PIKKU_CELERY_APP": pikku.app, "PIKKU_AUTHORIZE": authorize, **overrides}

    def call(method: str, path: str, body: Any = None, *, user: str | None = "admin",
             raw: str | bytes | None = None, content_type: str = "application/json",
             headers: dict[str, str] | None = None, csrf: bool = True) -> tuple[int, Any]:
        client = Client(enforce_csrf_checks=True)
        if user is not None:
            client.force_login(User.objects.get(username=user))
        extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in (headers or {}).items()}
        if csrf:
            client.cookies["csrftoken"] = CSRF_TOKEN
            extra["HTTP_X_CSRFTOKEN"] = CSRF_TOKEN
        data = raw if raw is not None else (json.dumps(body) if body is not None else "")
        with override_settings(**settings):
            response = client.generic(method, path, data, content_type=content_type, **extra)
        web.body = response.content
        try:
            payload = json.loads(response.content)
        except ValueError:
            payload = None  # Django's own pages (CSRF failure, 405)
        return response.status_code, payload

    web = Web("django", pikku, call, settings)
    return web


def with_schedule(pikku: PikkuCelery) -> PikkuCelery:
    """``pikku`` with the schedule ``nightly`` (of ``sum``, every hour) declared."""
    pikku.schedule("nightly", "sum", every="1h", data={"a": 1, "b": 2})
    return pikku


@pytest.fixture(params=["flask", "django"])
def web(request: pytest.FixtureRequest) -> Iterator[Web]:
    calls.clear()
    pikku = with_schedule(make_pikku())
    yield flask_web(pikku) if request.param == "flask" else django_web(pikku)


@contextlib.contextmanager
def reconfigured(web: Web, **settings: Any) -> Iterator[None]:
    """``web`` with more ``PIKKU_*`` settings: a new Flask app, or more Django settings."""
    named = {f"PIKKU_{k}": v for k, v in settings.items()}
    if web.framework == "flask":
        web.call = flask_web(web.pikku, **named).call
        yield
        return
    saved = dict(web.settings)
    web.settings.update(named)
    try:
        yield
    finally:
        web.settings.clear()
        web.settings.update(saved)


def running_run(pikku: PikkuCelery, run_id: str = "r-live") -> str:
    return pikku.start("sum", {"a": 1, "b": 2}, run_id=run_id)  # stays running: no broker


# --- access, endpoint by endpoint -------------------------------------------------------

ENDPOINTS = [
    ("GET", "/openapi.json", "read"),
    ("GET", "/runs", "read"),
    ("GET", "/runs/r-live", "read"),
    ("GET", "/runs/r-live/steps", "read"),
    ("GET", "/runs/r-live/steps/add", "read"),
    ("GET", "/runs/r-live/history", "read"),
    ("GET", "/runs/r-live/events", "read"),
    ("GET", "/runs/r-live/events/1/payload", "read"),
    ("POST", "/runs/r-live/cancel", "cancel"),
    ("POST", "/runs/r-live/resume", "resume"),
    ("POST", "/runs/r-live/retry", "retry"),
    ("POST", "/runs/r-live/fork", "fork"),
    ("POST", "/runs/r-live/approvals/manager", "approve"),
    ("POST", "/runs/r-live/events/paid", "send_event"),
    ("POST", "/workflows/sum/runs", "start"),
    ("GET", "/schedules", "read"),
    ("POST", "/schedules/nightly/pause", "pause_schedule"),
    ("POST", "/schedules/nightly/resume", "resume_schedule"),
    ("POST", "/schedules/nightly/trigger", "trigger_schedule"),
]
POSTS = [e for e in ENDPOINTS if e[0] == "POST"]
BODIES = {"cancel": {"reason": "x"}, "resume": {}, "start": {"input": {"a": 1, "b": 1}},
          "approve": {"decision": True}, "retry": {}, "fork": {"from_step": "add"},
          "send_event": {"payload": {"amount": 12}, "key": "k"}, "pause_schedule": {},
          "resume_schedule": {}, "trigger_schedule": {}}


def test_every_route_is_in_the_access_tests() -> None:
    assert sorted((r.method, r.action) for r in ROUTES) == sorted(
        (method, action) for method, _, action in ENDPOINTS)


def unchanged(pikku: PikkuCelery) -> bool:
    """Nothing a refused request could have done: no new run (a schedule's trigger
    included), the live run untouched and sent no event, no schedule paused."""
    runs = pikku.list_runs()
    return ([r.run_id for r in runs] == ["r-live"] and runs[0].status == "running"
            and pikku.list_events("r-live") == []
            and not any(s.paused for s in pikku.list_schedules()))


@pytest.mark.parametrize(("method", "path", "action"), ENDPOINTS)
def test_an_anonymous_caller_gets_401(web: Web, method: str, path: str, action: str) -> None:
    running_run(web.pikku)
    status, payload = web.call(method, PREFIX + path, BODIES.get(action), user=None)
    assert (status, payload["error"]) == (401, "NotAuthenticated")
    assert unchanged(web.pikku)


@pytest.mark.parametrize(("method", "path", "action"), ENDPOINTS)
def test_a_caller_without_the_action_gets_403(web: Web, method: str, path: str,
                                              action: str) -> None:
    running_run(web.pikku)
    user = "nobody" if action == "read" else "reader"
    status, payload = web.call(method, PREFIX + path, BODIES.get(action), user=user)
    assert (status, payload["error"]) == (403, "PermissionDenied")
    assert action in payload["message"]
    assert unchanged(web.pikku)
    assert calls[-1] == (action, "r-live" if "/runs/r-live" in path else None)


@pytest.mark.parametrize(("method", "path", "action"), POSTS)
def test_django_refuses_a_post_without_the_csrf_token(method: str, path: str,
                                                      action: str) -> None:
    pikku = with_schedule(make_pikku())
    running_run(pikku)
    web = django_web(pikku)
    status, _ = web.call(method, PREFIX + path, BODIES[action], csrf=False)
    assert status == 403
    assert unchanged(pikku)
    # the same request with the token goes through
    status, payload = web.call(method, PREFIX + path, BODIES[action])
    # Through the CSRF check, to the handler: r-live has no gate, is running (nothing to
    # retry) and recorded no step yet (nothing to fork from).
    if action == "approve":
        assert (status, payload["error"]) == (409, "WorkflowApprovalError")
    elif action == "retry":
        assert (status, payload["error"]) == (409, "WorkflowRunNotRetryable")
    elif action == "fork":
        assert (status, payload["error"]) == (400, "InvalidInputError")
    else:
        assert status in (200, 202)


@pytest.mark.parametrize(("method", "path", "action"), POSTS)
def test_a_cross_site_text_plain_post_is_refused(web: Web, method: str, path: str,
                                                 action: str) -> None:
    """What a form on another site can send with the admin's cookies: a ``text/plain`` body
    that is JSON. Django: no CSRF token (403). Flask: the browser's cross-site marks
    (403); without them (an old browser), not JSON (415)."""
    running_run(web.pikku)
    raw = json.dumps(BODIES[action] or {})
    status, _ = web.call(method, PREFIX + path, raw=raw, content_type="text/plain",
                         headers=EVIL, csrf=False)
    assert status == 403
    status, _ = web.call(method, PREFIX + path, raw=raw, content_type="text/plain",
                         csrf=False)
    assert status in (403, 415)
    # a form's own encodings are refused as well
    status, _ = web.call(method, PREFIX + path, raw="input=1",
                         content_type="application/x-www-form-urlencoded", csrf=False)
    assert status in (403, 415)
    assert unchanged(web.pikku)


def test_an_authorized_text_plain_post_is_415_even_with_csrf(web: Web) -> None:
    running_run(web.pikku)
    status, payload = web.call("POST", PREFIX + "/runs/r-live/cancel", raw="{}",
                               content_type="text/plain")
    assert (status, payload["error"]) == (415, "UnsupportedMediaType")
    assert unchanged(web.pikku)


def test_flask_accepts_same_origin_and_trusted_origin_posts() -> None:
    pikku = make_pikku()
    web = flask_web(pikku, PIKKU_TRUSTED_ORIGINS=["https://admin.example"])
    same = {"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"}
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 1}},
                    headers=same)[0] == 202
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 2}},
                    headers={"Origin": "http://localhost"})[0] == 202
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 3}},
                    headers={"Origin": "https://admin.example",
                             "Sec-Fetch-Site": "cross-site"})[0] == 202
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 4}},
                    headers={"Origin": "https://evil.example"})[0] == 403
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 5}},
                    headers={"Origin": "null"})[0] == 403
    assert len(pikku.list_runs()) == 3


# --- what authorized callers get --------------------------------------------------------


def test_start_read_cancel_and_resume_over_http(web: Web) -> None:
    pikku, call = web.pikku, web.call
    assert call("POST", PREFIX + "/workflows/sum/runs",
                {"input": {"a": 1, "b": 2}, "run_id": "http-1"}) == (202, {"run_id": "http-1"})
    pikku.engine.advance("http-1")
    pikku.engine.execute_step(pikku.registry.steps["contrib.add"], "http-1", "add")
    pikku.engine.advance("http-1")
    status, run = call("GET", PREFIX + "/runs/http-1", user="reader")
    assert status == 200 and run["status"] == "completed" and run["output"] == 3
    assert call("GET", PREFIX + "/runs/http-1/history")[1]["attempts"][0]["status"] \
        == "succeeded"
    listed_steps = call("GET", PREFIX + "/runs/http-1/steps")[1]
    assert listed_steps["next"] is None and "result" not in listed_steps["steps"][0]
    assert call("GET", PREFIX + "/runs/http-1/steps/add")[1]["result"] == 3
    assert call("GET", PREFIX + "/runs/http-1/steps/nope")[0] == 404
    listed = call("GET", PREFIX + "/runs?workflow=sum")[1]
    assert [r["run_id"] for r in listed["runs"]] == ["http-1"] and listed["next"] is None
    assert call("POST", PREFIX + "/runs/http-1/cancel", {"reason": "late"}) == (
        200, {"cancelled": False})  # it had already completed
    # the same id and input again is the same run; another input under it is a conflict
    assert call("POST", PREFIX + "/workflows/sum/runs",
                {"input": {"a": 1, "b": 2}, "run_id": "http-1"})[0] == 202
    status, payload = call("POST", PREFIX + "/workflows/sum/runs",
                           {"input": {"a": 5, "b": 2}, "run_id": "http-1"})
    assert (status, payload["error"]) == (409, "WorkflowRunConflictError")
    assert "'sum'" not in payload["message"]  # who owns it is not told to a starter
    status, payload = call("POST", PREFIX + "/workflows/waits/runs",
                           {"input": None, "run_id": "http-1"})
    assert status == 409 and "'sum'" not in payload["message"]

    waiting = pikku.start("waits", None, inline=True)
    assert pikku.get_run(waiting).status == "suspended"
    assert call("POST", PREFIX + f"/runs/{waiting}/resume", {}) == (200, {"resumed": True})
    assert call("POST", PREFIX + "/runs/r-none/cancel", {})[0] == 404


def test_approve_over_http(web: Web) -> None:
    """A refused decision is a 409 and leaves the run suspended; the approver recorded is
    the caller the server identified (Django: the signed-in user; Flask: PIKKU_IDENTIFY),
    and a body naming someone else is refused."""
    pikku, call = web.pikku, web.call
    run_id = pikku.start("gated", None, inline=True)
    path = PREFIX + f"/runs/{run_id}/approvals/manager"
    status, payload = call("POST", path, {"decision": "yes", "by": "admin"})
    assert (status, payload["error"]) == (409, "WorkflowApprovalError")
    assert "does not match its schema" in payload["message"]
    status, payload = call("POST", path, {"decision": True, "by": "bob"})
    assert (status, payload["error"]) == (403, "Forbidden")
    assert "you are 'admin'" in payload["message"]
    assert call("POST", path, {"by": "admin"})[0] == 400  # no decision
    assert pikku.get_run(run_id).status == "suspended"
    status, payload = call("POST", path, {"decision": True})
    assert status == 200 and payload["approved"] and payload["step"]["result"] is True
    assert pikku.get_run(run_id).status == "running"
    status, payload = call("POST", path, {"decision": True, "by": "admin"})
    assert (status, payload["error"]) == (409, "WorkflowApprovalError")


def with_an_open_gate(pikku: PikkuCelery) -> PikkuCelery:
    """``open``: an approval gate without approvers (anyone allowed to approve decides)."""
    @pikku.workflow("open")
    def open_gate(wf: WorkflowContext, data: Any) -> Any:
        return wf.approval("go", schema={"type": "boolean"})

    return pikku


@pytest.mark.parametrize("identify", [None, lambda request: None])
def test_flask_without_an_identity_cannot_approve_in_anyones_name(identify: Any) -> None:
    """No ``PIKKU_IDENTIFY``, or one that cannot tell: whoever may ``approve`` could
    otherwise name any approver in the body. Django: ``test_contrib_django``."""
    check_unidentified_approvals(flask_web(with_an_open_gate(make_pikku()),
                                           PIKKU_IDENTIFY=identify))


def check_unidentified_approvals(web: Web) -> None:
    """``web`` lets its caller approve but cannot name them: a body naming ``by`` is
    refused, saying how to fix it; without ``by``, only a gate without approvers takes
    the decision (``web.pikku`` has ``with_an_open_gate``)."""
    pikku, call = web.pikku, web.call
    gated = pikku.start("gated", None, inline=True)
    path = PREFIX + f"/runs/{gated}/approvals/manager"
    status, payload = call("POST", path, {"decision": True, "by": "admin"})
    assert (status, payload["error"]) == (403, "Forbidden")
    message = payload["message"]
    assert "cannot tell who you are" in message and "'admin'" in message
    assert "PIKKU_IDENTIFY" in message and "sign in" in message
    assert pikku.get_run(gated).status == "suspended"
    # without 'by': a gate with approvers refuses it (pikku.approve with by=None) ...
    status, payload = call("POST", path, {"decision": True})
    assert (status, payload["error"]) == (409, "WorkflowApprovalError")
    assert "no approver (by=) was given" in payload["message"]
    assert pikku.get_run(gated).status == "suspended"
    # ... and a gate without approvers takes it
    opened = pikku.start("open", None, inline=True)
    status, payload = call("POST", PREFIX + f"/runs/{opened}/approvals/go", {"decision": True})
    assert status == 200 and payload["step"]["result"] is True
    assert pikku.get_run(opened).status == "running"


def test_runs_are_paged(web: Web) -> None:
    for i in range(5):
        web.pikku.start("sum", {"a": i, "b": 0}, run_id=f"p-{i}")
    first = web.call("GET", PREFIX + "/runs?limit=2")[1]
    second = web.call("GET", PREFIX + f"/runs?limit=2&before={first['next']}")[1]
    third = web.call("GET", PREFIX + f"/runs?limit=2&before={second['next']}")[1]
    seen = [r["run_id"] for page in (first, second, third) for r in page["runs"]]
    assert sorted(seen) == [f"p-{i}" for i in range(5)] and len(set(seen)) == 5
    assert third["next"] is None


@pytest.mark.parametrize(("method", "path", "body", "status", "error"), [
    ("GET", "/runs/ghost", None, 404, "WorkflowRunNotFoundError"),
    ("POST", "/workflows/nope/runs", {"input": {}}, 404, "WorkflowNotFoundError"),
    ("POST", "/workflows/sum/runs", {"input": {"$where": "1"}}, 400, "InvalidInputError"),
    ("POST", "/workflows/sum/runs", ["not", "an", "object"], 400, "InvalidInputError"),
    ("POST", "/workflows/sum/runs", {"data": {}}, 400, "InvalidInputError"),
    ("POST", "/workflows/sum/runs", {"input": {}, "run_id": 7}, 400, "InvalidInputError"),
    ("POST", "/runs/r-live/cancel", {"reason": ["x"]}, 400, "InvalidInputError"),
    ("POST", "/runs/r-live/resume", {"now": True}, 400, "InvalidInputError"),
    ("GET", "/runs?status=runing", None, 400, "InvalidInputError"),
    ("GET", "/runs?limit=lots", None, 400, "InvalidInputError"),
    ("GET", "/runs?limit=0", None, 400, "InvalidInputError"),
    ("GET", "/runs?limit=201", None, 400, "InvalidInputError"),
    ("GET", "/runs?before=ghost", None, 404, "WorkflowRunNotFoundError"),
])
def test_bad_requests_get_clear_errors(web: Web, method: str, path: str, body: Any,
                                       status: int, error: str) -> None:
    running_run(web.pikku)
    got_status, payload = web.call(method, PREFIX + path, body)
    assert (got_status, payload["error"]) == (status, error)
    assert set(payload) == {"error", "message"}
    assert unchanged(web.pikku)


def test_a_body_that_is_not_json_is_400(web: Web) -> None:
    status, payload = web.call("POST", PREFIX + "/workflows/sum/runs", raw="{input: 1")
    assert (status, payload["error"]) == (400, "InvalidJSON")


@pytest.mark.parametrize("levels", [150, 100_000])
def test_a_deep_body_is_400(web: Web, levels: int) -> None:
    status, payload = web.call("POST", PREFIX + "/workflows/sum/runs",
                               raw='{"input": ' + "[" * levels + "]" * levels + "}")
    assert (status, payload["error"]) == (400, "InvalidInputError")
    assert "nested too deeply" in payload["message"]
    assert web.pikku.list_runs() == []


def test_a_body_over_the_limit_is_413(web: Web) -> None:
    big = json.dumps({"input": {"text": "x" * (1024 * 1024)}})
    status, payload = web.call("POST", PREFIX + "/workflows/sum/runs", raw=big)
    assert (status, payload["error"]) == (413, "RequestTooLarge")
    with reconfigured(web, MAX_BODY_BYTES=100):
        small = json.dumps({"input": {"text": "x" * 100}})
        assert web.call("POST", PREFIX + "/workflows/sum/runs", raw=small)[0] == 413
        assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1}})[0] == 202
    assert len(web.pikku.list_runs()) == 1


# --- errors, tracebacks and 500s ----------------------------------------------------------


def test_errors_are_served_as_type_and_message_only(web: Web) -> None:
    run_id = web.pikku.start("fails", {"x": 1}, inline=True)
    stored = web.pikku.get_run(run_id)
    assert stored.status == "failed"
    run = web.call("GET", PREFIX + f"/runs/{run_id}")[1]
    steps = web.call("GET", PREFIX + f"/runs/{run_id}/steps")[1]["steps"]
    history = web.call("GET", PREFIX + f"/runs/{run_id}/history")[1]["attempts"]
    assert set(run["error"]) == {"type", "message"}
    boom = next(s for s in steps if s["step_name"] == "boom")
    assert set(boom["error"]) == {"type", "message"} and boom["error"]["type"] == "RuntimeError"
    assert boom["error"]["message"].startswith("cannot reach mongodb://app:")
    assert all(set(h["error"] or {}) <= {"type", "message"} for h in history)
    served = json.dumps([run, steps, history])
    assert "traceback" not in served.lower()  # nor in the compensation's input
    assert "Traceback" in json.dumps(web.pikku.get_steps(run_id)[0].error)  # it is stored


def test_tracebacks_are_served_when_the_setting_is_on(web: Web) -> None:
    run_id = web.pikku.start("fails", {"x": 1}, inline=True)
    with reconfigured(web, SHOW_TRACEBACKS=True):
        steps = web.call("GET", PREFIX + f"/runs/{run_id}/steps")[1]["steps"]
        assert "Traceback" in next(s for s in steps if s["step_name"] == "boom")[
            "error"]["traceback"]
        assert web.call("GET", PREFIX + f"/runs/{run_id}", user="nobody")[0] == 403


def test_an_unexpected_error_is_a_500_without_detail(web: Web, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def broken(run_id: str) -> None:
        raise ConnectionError("mongodb://app:hunter2@db:27017 refused the connection")

    monkeypatch.setattr(web.pikku, "get_run", broken)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.contrib"):
        status, payload = web.call("GET", PREFIX + "/runs/r-1")
    assert (status, payload["error"]) == (500, "InternalError")
    assert "hunter2" not in json.dumps(payload) and "mongodb" not in json.dumps(payload)
    assert "hunter2" in caplog.text  # the operator finds it in the log


def test_a_value_error_that_is_not_pikkus_is_a_500_without_detail(
        web: Web, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Only pikku's ``InvalidInputError`` is the caller's bad input (400, with its message);
    any other ``ValueError`` is the server's, and a driver's can quote a password."""
    def broken(run_id: str) -> None:
        raise ValueError("Port could not be cast to integer value as 'Xk9pQ2mZ'")

    monkeypatch.setattr(web.pikku, "get_run", broken)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.contrib"):
        status, payload = web.call("GET", PREFIX + "/runs/r-1")
    assert (status, payload["error"]) == (500, "InternalError")
    assert "Xk9pQ2mZ" not in json.dumps(payload) and "Port" not in json.dumps(payload)
    assert "Xk9pQ2mZ" in caplog.text  # the operator finds it in the log


LEAKY_REDIS_URL = "redis://:Xk9pQ2mZ/7vLr@redis.internal:6379/0"


def misconfigured_pikku() -> PikkuCelery:
    """A ``PikkuCelery`` whose engine is first built by a web request, on a Redis URL whose
    password holds an unescaped '/' (redis-py: 'Port could not be cast to integer value as
    'Xk9pQ2mZ'')."""
    app = Celery("misconfigured", broker="memory://", set_as_current=False)
    app.conf.update(pikku_mongo_url="mongodb://127.0.0.1:1/shop",
                    pikku_redis_url=LEAKY_REDIS_URL)
    return PikkuCelery(app, worker_reaper=False)


@pytest.mark.parametrize("framework", ["flask", "django"])
def test_a_misconfigured_url_is_a_500_and_named_only_in_the_log(
        framework: str, caplog: pytest.LogCaptureFixture) -> None:
    pikku = misconfigured_pikku()
    web = flask_web(pikku) if framework == "flask" else django_web(pikku)
    with caplog.at_level(logging.ERROR, logger="pikku_celery.contrib"):
        status, payload = web.call("GET", PREFIX + "/runs")
    assert (status, payload["error"]) == (500, "InternalError")
    served = json.dumps(payload)
    assert "Xk9pQ2mZ" not in served and "redis" not in served
    # the log names the setting and the URL, its password masked, and nothing of it
    assert "pikku_redis_url" in caplog.text
    assert "redis://:***@redis.internal:6379/0" in caplog.text
    assert "Xk9pQ2mZ" not in caplog.text and "7vLr" not in caplog.text


def test_authorize_is_told_the_action_and_run(web: Web) -> None:
    running_run(web.pikku)
    web.call("GET", PREFIX + "/runs/r-live/history", user="reader")
    web.call("POST", PREFIX + "/runs/r-live/cancel", user="admin")
    web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1, "b": 1}})
    assert calls == [("read", "r-live"), ("cancel", "r-live"), ("start", None)]


# --- used by tests/unit/test_hardening_infra.py -------------------------------------------


def raw_poster(framework: str) -> tuple[PikkuCelery, Callable[[str, str], tuple[int, Any]]]:
    """An authorized caller POSTing a raw JSON body (the test clients' own encoders would
    recurse on a very deep one); paths are relative to the API (``/workflows/sum/runs``)."""
    pikku = make_pikku()
    web = flask_web(pikku) if framework == "flask" else django_web(pikku)

    def post(path: str, body: str) -> tuple[int, Any]:
        return web.call("POST", PREFIX + path, raw=body)

    return pikku, post


def test_retry_over_http_is_its_own_action(web: Web) -> None:
    """``POST api/runs/<id>/retry`` (issue 25 item 2): authorized as ``retry`` (a reader
    may not), 409 for a run that is not failed or cancelled, 200 and the run live again."""
    pikku, call = web.pikku, web.call
    assert call("POST", PREFIX + "/workflows/waits/runs",
                {"input": None, "run_id": "http-retry"})[0] == 202
    status, payload = call("POST", PREFIX + "/runs/http-retry/retry", {})
    assert (status, payload["error"]) == (409, "WorkflowRunNotRetryable")
    assert "running, not failed or cancelled" in payload["message"]
    assert call("POST", PREFIX + "/runs/http-retry/cancel", {})[0] == 200
    assert call("POST", PREFIX + "/runs/http-retry/retry", {}, user="reader")[0] == 403
    calls.clear()
    assert call("POST", PREFIX + "/runs/http-retry/retry", {}) == (200, {"retried": True})
    assert ("retry", "http-retry") in calls
    assert pikku.get_run("http-retry").status == "running"
    assert call("POST", PREFIX + "/runs/http-retry/retry", {"force": True})[0] == 400


def test_fork_over_http_is_its_own_action(web: Web) -> None:
    pikku, call = web.pikku, web.call
    assert call("POST", PREFIX + "/workflows/sum/runs",
                {"input": {"a": 2, "b": 2}, "run_id": "http-src"})[0] == 202
    pikku.engine.advance("http-src")
    assert call("POST", PREFIX + "/runs/http-src/fork", {"from_step": "add"},
                user="reader")[0] == 403
    calls.clear()
    status, payload = call("POST", PREFIX + "/runs/http-src/fork",
                           {"from_step": "add", "run_id": "http-fork"})
    assert (status, payload) == (202, {"run_id": "http-fork"})
    assert ("fork", "http-src") in calls
    assert pikku.get_run("http-fork").input == {"a": 2, "b": 2}
    assert call("POST", PREFIX + "/runs/http-src/fork", {})[0] == 400
    assert call("POST", PREFIX + "/runs/http-src/fork", {"from_step": "nope"})[0] == 400
