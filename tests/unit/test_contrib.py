"""The Flask and Django integrations: the same JSON API, the same error statuses."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from tests.unit.test_engine import Recorder

Call = Callable[[str, str, Any], tuple[int, Any]]


def _pikku() -> PikkuCelery:
    pikku = PikkuCelery(Celery("contrib", broker="memory://"), store=InMemoryWorkflowStore(),
                        leases=InMemoryLeaseService(), worker_reaper=False)
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="contrib.add")
    def add(data: dict[str, int]) -> int:
        return data["a"] + data["b"]

    @pikku.workflow("sum")
    def total(wf: Any, data: Any) -> Any:
        return wf.do("add", add, data)

    return pikku


def _flask() -> tuple[PikkuCelery, Call]:
    from flask import Flask

    from pikku_celery.contrib.flask import current_pikku, init_app

    pikku = _pikku()
    app = Flask("contrib-test")
    init_app(app, pikku, url_prefix="/workflows")
    with app.app_context():
        assert current_pikku() is pikku
    client = app.test_client()

    def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
        response = client.open(url, method=method, json=body)
        return response.status_code, response.get_json()

    return pikku, call


def _django() -> tuple[PikkuCelery, Call]:
    import django
    from django.conf import settings

    pikku = _pikku()
    from django.urls import include, path

    from pikku_celery.contrib.django import pikku_urls

    urls = types.ModuleType("pikku_test_urls")
    urls.urlpatterns = [path("workflows/", include(pikku_urls(pikku)))]  # type: ignore[attr-defined]
    sys.modules["pikku_test_urls"] = urls
    if not settings.configured:
        settings.configure(ROOT_URLCONF="pikku_test_urls", ALLOWED_HOSTS=["*"], DEBUG=True,
                           SECRET_KEY="tests", INSTALLED_APPS=[])
        django.setup()
    from django.test import Client
    from django.urls import clear_url_caches

    clear_url_caches()
    client = Client()

    def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body) if body is not None else ""
        response = client.generic(method, url, data, content_type="application/json")
        return response.status_code, json.loads(response.content)

    return pikku, call


@pytest.fixture(params=["flask", "django"])
def api(request: pytest.FixtureRequest) -> Iterator[tuple[PikkuCelery, Call]]:
    yield _flask() if request.param == "flask" else _django()


def test_start_read_and_cancel_a_run_over_http(api: tuple[PikkuCelery, Call]) -> None:
    pikku, call = api
    status, body = call("POST", "/workflows/sum/runs", {"input": {"a": 1, "b": 2},
                                                        "run_id": "http-1"})
    assert (status, body) == (202, {"run_id": "http-1"})
    pikku.engine.advance("http-1")
    pikku.engine.execute_step(pikku.registry.steps["contrib.add"], "http-1", "add")
    pikku.engine.advance("http-1")
    status, run = call("GET", "/workflows/runs/http-1", None)
    assert status == 200 and run["status"] == "completed" and run["output"] == 3
    assert call("GET", "/workflows/runs/http-1/history", None)[1]["attempts"][0]["status"] \
        == "succeeded"
    assert call("GET", "/workflows/runs/http-1/steps", None)[1]["steps"][0]["result"] == 3
    assert [r["run_id"] for r in call("GET", "/workflows/runs?workflow=sum", None)[1]["runs"]] \
        == ["http-1"]
    assert call("POST", "/workflows/runs/http-1/cancel", {"reason": "late"}) == (
        200, {"cancelled": False})  # it had already completed


@pytest.mark.parametrize(("method", "url", "body", "status", "error"), [
    ("GET", "/workflows/runs/ghost", None, 404, "WorkflowRunNotFoundError"),
    ("POST", "/workflows/nope/runs", {"input": {}}, 404, "WorkflowNotFoundError"),
    ("POST", "/workflows/sum/runs", {"input": {"$where": "1"}}, 400, "InvalidInputError"),
    ("POST", "/workflows/sum/runs", ["not", "an", "object"], 400, "InvalidInputError"),
    ("GET", "/workflows/runs?status=runing", None, 400, "InvalidInputError"),
    ("GET", "/workflows/runs?limit=lots", None, 400, "InvalidInputError"),
])
def test_bad_requests_get_clear_errors(api: tuple[PikkuCelery, Call], method: str, url: str,
                                       body: Any, status: int, error: str) -> None:
    pikku, call = api
    got_status, payload = call(method, url, body)
    assert (got_status, payload["error"]) == (status, error)
    assert pikku.list_runs() == []
