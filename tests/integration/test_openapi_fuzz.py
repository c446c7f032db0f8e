"""Schemathesis fuzzes the JSON API through its OpenAPI document (``contrib._openapi``), on a
live Flask app and a live Django app (each a real HTTP server in a thread) whose
``PikkuCelery`` keeps its runs in the session's real ``mongod``.

Every operation, for every generated input:

- signed in (a session cookie: Flask's signed one, Django's ``sessionid``; a POST with
  Django's CSRF token), the response passes schemathesis's checks: no 5xx, a status the
  document lists, a JSON body matching its schema;
- the same request without the cookie is a 401 (authentication holds);
- a POST signed in but cross-site (Flask: ``Sec-Fetch-Site: cross-site`` and another
  ``Origin``; Django: no CSRF token, or the token but another site's ``Origin``) is a 403.

The in-suite run is short: ``PIKKU_FUZZ_EXAMPLES`` examples per operation and framework
(default 8). The longer profile (tests/README.md, "The API contract, fuzzed")::

    PIKKU_FUZZ_EXAMPLES=300 .venv/bin/pytest -q -p no:randomly \
        tests/integration/test_openapi_fuzz.py
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pymongo
import pytest
import requests
import schemathesis
from celery import Celery
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import AcceptedNegativeData, FailureGroup
from werkzeug.serving import make_server

from pikku_celery import (
    InMemoryLeaseService,
    MongoWorkflowStore,
    PikkuCelery,
    WorkflowContext,
)
from pikku_celery.contrib import _openapi
from tests.support import django_project
from tests.support.mongod import MongoTarget
from tests.unit.test_engine import Recorder

#: Examples per operation and framework; the short profile is derandomized (the same
#: inputs every run), a longer one (``PIKKU_FUZZ_EXAMPLES`` set) explores afresh.
EXAMPLES = int(os.environ.get("PIKKU_FUZZ_EXAMPLES", "8"))
PREFIX = "/pikku/api"
EVIL = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                         derandomize="PIKKU_FUZZ_EXAMPLES" not in os.environ,
                         suppress_health_check=list(HealthCheck), print_blob=True)

#: Unknown query parameters are ignored, as most HTTP APIs do (a cache-buster), so none are
#: generated (nor unknown body fields, which the unit tests refuse: test_contrib); a value
#: the schema allows may still be refused with 400 when it means nothing here (a step the
#: run never recorded, an input the workflow's own schema refuses).
CONFIG = SchemathesisConfig.from_dict({
    "generation": {"allow-extra-parameters": False},
    "checks": {"positive_data_acceptance": {
        "expected-statuses": ["2xx", "400", "401", "403", "404", "409"]}}})
schema = schemathesis.openapi.from_dict(_openapi.document(), config=CONFIG)
DOCUMENTED = [checks.status_code_conformance, checks.content_type_conformance,
              checks.response_schema_conformance]


def fuzz_pikku(db: Any) -> PikkuCelery:
    """Workflows, a schedule and runs named as the document's examples, so that generated
    requests reach real records and not only 404s."""
    pikku = PikkuCelery(Celery("fuzz", broker="memory://", set_as_current=False),
                        store=MongoWorkflowStore(db), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="fuzz.charge")
    def charge(data: Any) -> Any:
        return data

    @pikku.workflow("orders")
    def orders(wf: WorkflowContext, data: Any) -> Any:
        wf.do("charge", charge, data)
        wf.approval("manager")
        return wf.wait_for_event("paid")

    pikku.schedule("nightly", "orders", every="1h", data={"owner": "ops"})
    pikku.start("orders", {"owner": "ann"}, run_id="order-1042")
    pikku.send_event("order-1042", "paid", {"amount": 12}, key="k1")
    return pikku


@dataclass
class Live:
    """A live app: its base URL, and the cookies and headers of a signed-in caller."""

    framework: str
    base_url: str
    cookies: dict[str, str]
    headers: dict[str, str] = field(default_factory=dict)
    session: requests.Session = field(default_factory=requests.Session)


@pytest.fixture(scope="module")
def fuzz_db(mongo_server: MongoTarget) -> Iterator[Any]:
    name = f"pikku_fuzz_{uuid.uuid4().hex[:12]}"
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(mongo_server.url)
    yield client[name]
    for db in (name, name + "_f"):
        client.drop_database(db)
    client.close()


def _serve(app: Any) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}{PREFIX}"
    finally:
        server.shutdown()
        thread.join(10)


def flask_authorize(request: Any, action: str, run_id: str | None) -> bool:
    from flask import abort, session

    if session.get("user") is None:
        abort(401)
    return session.get("user") == "admin"


@pytest.fixture(scope="module")
def flask_live(fuzz_db: Any) -> Iterator[Live]:
    from flask import Flask

    from pikku_celery.contrib.flask import PikkuFlask

    pikku = fuzz_pikku(fuzz_db.client[fuzz_db.name + "_f"])
    app = Flask("fuzz")
    app.config.update({"SECRET_KEY": "fuzz-tests", "PIKKU_AUTHORIZE": flask_authorize,
                       "PIKKU_IDENTIFY": lambda request: "admin"})
    PikkuFlask(pikku).init_app(app)
    cookie = app.session_interface.get_signing_serializer(app).dumps({"user": "admin"})
    for base_url in _serve(app):
        yield Live("flask", base_url, {"session": cookie})


@pytest.fixture(scope="module")
def django_live(fuzz_db: Any) -> Iterator[Live]:
    django_project.setup()
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import Client, override_settings

    pikku = fuzz_pikku(fuzz_db)
    admin, _ = User.objects.get_or_create(username="fuzz-admin",
                                          defaults={"is_staff": True})
    client = Client()
    client.force_login(admin)
    token = "f" * 32
    with override_settings(PIKKU_CELERY_APP=pikku.app, PIKKU_AUTHORIZE=None):
        for base_url in _serve(WSGIHandler()):
            yield Live("django", base_url,
                       {"sessionid": client.cookies["sessionid"].value, "csrftoken": token},
                       {"X-CSRFToken": token})


@pytest.fixture(params=["flask", "django"])
def live(request: pytest.FixtureRequest) -> Live:
    found: Live = request.getfixturevalue(f"{request.param}_live")
    return found


@schema.parametrize()
@FUZZ_SETTINGS
def test_the_api_keeps_its_contract(case: Any, live: Live) -> None:
    post = case.method.upper() == "POST"
    headers = live.headers
    response = case.call(base_url=live.base_url, session=live.session,
                         cookies=live.cookies, headers=dict(headers))
    try:
        case.validate_response(response)
    except FailureGroup as group:
        if not all(empty_value_taken(failure, response) for failure in group.exceptions):
            raise
    if case.method.upper() != case.operation.method.upper():
        return  # the coverage phase's other methods: schemathesis checks their 405
    anonymous = case.call(base_url=live.base_url, headers=dict(headers),
                          cookies={k: v for k, v in live.cookies.items() if k == "csrftoken"})
    assert_refused(live, case, anonymous, 401)
    if anonymous.status_code == 401:
        assert anonymous.json()["error"] == "NotAuthenticated", anonymous.text
    if post:
        if live.framework == "flask":
            cross = case.call(base_url=live.base_url, cookies=live.cookies, headers=EVIL)
        else:  # the session cookie without the CSRF token
            cross = case.call(base_url=live.base_url,
                              cookies={"sessionid": live.cookies["sessionid"]})
            assert_refused(live, case, cross, 403)
            # with it, but from another site's page
            cross = case.call(base_url=live.base_url, cookies=live.cookies,
                              headers={**live.headers, "Origin": EVIL["Origin"]})
        assert_refused(live, case, cross, 403)


def empty_value_taken(failure: Exception, response: Any) -> bool:
    """Schemathesis serializes some of its invalid values (a ``null``) as an empty query
    value (``?workflow=``), which the document allows (``allowEmptyValue``: as if absent):
    accepting it is the contract, not a failure."""
    query = urlsplit(response.request.url).query
    return isinstance(failure, AcceptedNegativeData) and any(
        value == "" for _, value in parse_qsl(query, keep_blank_values=True))


def assert_refused(live: Live, case: Any, response: Any, status: int) -> None:
    """``status``, or Django's own 400 for a multipart body it cannot parse: its CSRF
    middleware reads the form before any view runs, and refuses it whoever sends it."""
    unparsable = (live.framework == "django" and response.status_code == 400
                  and "multipart/" in response.request.headers.get("Content-Type", ""))
    assert response.status_code == status or unparsable, (
        case.as_curl_command(), response.status_code, response.text[:500])
    if not unparsable:  # the refusal is as documented too
        case.validate_response(response, checks=DOCUMENTED)
