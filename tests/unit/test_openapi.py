"""The JSON API's OpenAPI document (``contrib._openapi``): a valid OpenAPI 3.1 document,
checked against the routes (every route documented, every documented path served by
Flask and Django alike), served at ``<prefix>/api/openapi.json`` to whoever may read, and
published in the docs site as written. Schemathesis fuzzes both apps with it in
``tests/integration/test_openapi_fuzz.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import schemathesis

from pikku_celery.contrib import _openapi
from pikku_celery.contrib._api import ROUTES
from tests.support import django_project
from tests.unit.test_contrib import PREFIX, Web, authorize, make_pikku, web

__all__ = ["web"]  # the fixture, both frameworks

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "guide" / "web-api-openapi.json"


def documented() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, operations in _openapi.PATHS.items()
            for method in operations}


def as_openapi(route_path: str) -> str:
    """``api/runs/<run_id>`` as the document writes it: ``/runs/{run_id}``."""
    return re.sub(r"<(\w+)>", r"{\1}", route_path.removeprefix("api"))


def example_path(path: str) -> str:
    """A documented path with each parameter's example in it."""
    operation = next(iter(_openapi.PATHS[path].values()))
    for parameter in operation["parameters"]:
        if parameter["in"] == "path":
            path = path.replace("{" + parameter["name"] + "}", str(parameter["example"]))
    return path


def test_the_document_is_valid_openapi_3_1() -> None:
    schema = schemathesis.openapi.from_dict(_openapi.document())
    schema.validate()
    assert _openapi.document()["openapi"].startswith("3.1")


def test_every_route_is_documented_and_every_documented_route_is_a_route() -> None:
    routes = {(r.method, as_openapi(r.path)) for r in ROUTES}
    assert routes == documented()
    operation_ids = {op["operationId"] for ops in _openapi.PATHS.values()
                     for op in ops.values()}
    assert operation_ids == {r.name for r in ROUTES}
    for route in ROUTES:  # the document's path parameters are the route's
        operation = _openapi.PATHS[as_openapi(route.path)][route.method.lower()]
        assert {p["name"] for p in operation["parameters"] if p["in"] == "path"} == set(
            re.findall(r"<(\w+)>", route.path)), route.name
        assert operation["description"] == f"``authorize`` is asked about ``{route.action}``."
        assert ("requestBody" in operation) == (route.method == "POST"), route.name


def test_flask_serves_every_documented_path() -> None:
    from flask import Flask

    from pikku_celery.contrib.flask import PikkuFlask

    app = Flask("openapi-test")
    app.config.update({"SECRET_KEY": "tests", "PIKKU_AUTHORIZE": authorize})
    PikkuFlask(make_pikku()).init_app(app)
    urls = app.url_map.bind("localhost")
    for method, path in sorted(documented()):
        endpoint, _ = urls.match(PREFIX + example_path(path), method=method)
        assert endpoint == "pikku." + _openapi.PATHS[path][method.lower()]["operationId"]


def test_django_serves_every_documented_path() -> None:
    django_project.setup()
    from django.urls import resolve

    for _method, path in sorted(documented()):
        match = resolve(PREFIX + example_path(path))
        operation = next(iter(_openapi.PATHS[path].values()))
        assert match.url_name == operation["operationId"], path
        assert match.namespace == "pikku"


def test_the_document_is_served_to_readers_only(web: Web) -> None:
    status, served = web.call("GET", PREFIX + "/openapi.json", user="reader")
    assert (status, served) == (200, _openapi.document())
    assert web.call("GET", PREFIX + "/openapi.json", user=None)[0] == 401
    assert web.call("GET", PREFIX + "/openapi.json", user="nobody")[0] == 403


def test_its_servers_url_resolves_to_the_mount_point() -> None:
    from urllib.parse import urljoin

    [server] = _openapi.document()["servers"]
    assert urljoin("https://x.example/ops/pikku/api/openapi.json", server["url"]) == (
        "https://x.example/ops/pikku/api")


def test_the_docs_site_publishes_the_document_as_written() -> None:
    # python -m pikku_celery.contrib._openapi > docs/guide/web-api-openapi.json
    assert PUBLISHED.read_text() == _openapi.dumps()
    page = (ROOT / "docs" / "guide" / "web-api-openapi.md").read_text()
    assert '--8<-- "docs/guide/web-api-openapi.json"' in page


@pytest.mark.parametrize("name", sorted(_openapi.SCHEMAS))
def test_every_schema_is_used(name: str) -> None:
    text = _openapi.dumps()
    assert f'"#/components/schemas/{name}"' in text


def documented_statuses(method: str, path: str) -> set[int]:
    return {int(code) for code in _openapi.PATHS[path][method.lower()]["responses"]}


BODIES = {"fork": {"from_step": "add"}, "approve": {"decision": True}}


@pytest.mark.parametrize("route", [r for r in ROUTES if "<run_id>" in r.path],
                         ids=lambda r: r.name)
def test_a_run_id_that_cannot_be_one_is_a_documented_400(web: Web, route: Any) -> None:
    # Found by schemathesis: GET api/runs/%C2%85f (a leading U+0085, a space to Python)
    # answered 400, which the document did not list for that route.
    path = PREFIX + example_path(as_openapi(route.path)).replace("order-1042", "%C2%85f")
    status, payload = web.call(route.method, path, BODIES.get(route.name, {}))
    assert status == 400, payload
    assert payload["error"] == "InvalidInputError"
    assert 400 in documented_statuses(route.method, as_openapi(route.path))


def test_an_empty_query_parameter_is_an_absent_one(web: Web) -> None:
    # Found by schemathesis: ?limit= and ?before= were taken as absent but ?status= was a
    # 400 and ?workflow= matched no run; the document now says every optional query
    # parameter may be sent empty (allowEmptyValue), meaning absent.
    running = web.pikku.start("sum", {"a": 1, "b": 2}, run_id="r-1")
    status, payload = web.call("GET", PREFIX + "/runs?workflow=&status=&limit=&before=")
    assert status == 200, payload
    assert [r["run_id"] for r in payload["runs"]] == [running]
    for path in ("/runs/r-1/steps?limit=&after=", "/runs/r-1/history?limit=&after=",
                 "/runs/r-1/events?limit=&after="):
        assert web.call("GET", PREFIX + path)[0] == 200, path
    for operations in _openapi.PATHS.values():
        for operation in operations.values():
            for parameter in operation["parameters"]:
                if parameter["in"] == "query":
                    assert parameter["allowEmptyValue"] is True, parameter


@pytest.mark.parametrize("path", ["/runs?limit=5&limit=x", "/runs?workflow=sum&workflow=",
                                  "/runs/r-1/events?after=&after=1",
                                  "/schedules?x=1&x=2"])
def test_a_repeated_query_parameter_is_a_400_in_both_frameworks(web: Web, path: str) -> None:
    # Found by schemathesis: Flask read the first of ?limit=5&limit=x (200, five runs) and
    # Django the last (400): one request, two meanings, and a third to a proxy that
    # checked either. Both now refuse a repeat, as the document says.
    web.pikku.start("sum", {"a": 1, "b": 2}, run_id="r-1")
    status, payload = web.call("GET", PREFIX + path)
    assert (status, payload["error"]) == (400, "InvalidQuery"), payload
    documented_path = "/" + path.split("?")[0].strip("/").replace("r-1", "{run_id}")
    assert 400 in documented_statuses("GET", documented_path)


def test_a_query_parameter_given_once_is_read_as_before(web: Web) -> None:
    for i in range(3):
        web.pikku.start("sum", {"a": 1, "b": i}, run_id=f"r-{i}")
    status, payload = web.call("GET", PREFIX + "/runs?limit=2&workflow=sum")
    assert status == 200, payload
    assert [r["run_id"] for r in payload["runs"]] == ["r-2", "r-1"]
