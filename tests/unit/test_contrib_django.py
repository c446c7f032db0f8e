"""The Django app on the test project of ``tests/djangoproject``: workflows autodiscovered
in every process, ``start_on_commit`` against real sqlite transactions, the default access
rule (staff only), ``PIKKU_AUTHORIZE``, CSRF without the middleware, finding the
``PikkuCelery``, system checks and ``manage.py pikku``.

The runs live in an in-memory store (the API pointed at it with ``PIKKU_CELERY_APP``);
``tests/integration/test_web_projects.py`` runs the same project on a real worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from pikku_celery import (
    InvalidInputError,
    PikkuCelery,
    WorkflowContext,
    WorkflowNotFoundError,
)
from tests.support import django_project
from tests.unit.test_contrib import (
    PREFIX,
    check_unidentified_approvals,
    django_web,
    make_pikku,
    with_an_open_gate,
)


@pytest.fixture(autouse=True)
def _django() -> None:
    django_project.setup()


@pytest.fixture
def pikku() -> PikkuCelery:
    return make_pikku()


class Rollback(Exception):
    pass


def orders() -> list[Any]:
    from orders.models import Order

    return list(Order.objects.values_list("sku", flat=True))


@pytest.fixture(autouse=True)
def _no_orders() -> Iterator[None]:
    from orders.models import Order

    Order.objects.all().delete()
    yield
    Order.objects.all().delete()


# --- the app: autodiscovery ---------------------------------------------------------------


def test_every_installed_apps_workflows_module_is_imported_at_setup() -> None:
    from djproj.celery import pikku

    # Nothing in the project imports orders.workflows: only the app's ready() does.
    assert "orders.workflows" in sys.modules
    assert "order" in pikku.registry.workflows
    assert {"orders.price", "orders.confirm"} <= set(pikku.registry.steps)


def test_a_management_command_process_has_the_workflows_too() -> None:
    out = subprocess.run(
        [sys.executable, "manage.py", "shell", "--verbosity", "0", "-c",
         "from djproj.celery import app, pikku; "
         "print(sorted(pikku.registry.workflows), 'orders.price' in app.tasks)"],
        cwd=django_project.PROJECT, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['order']", "True"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.PROJECT.parents[1]),
                                         env.get("PYTHONPATH", "")])
    return env


# --- start_on_commit ---------------------------------------------------------------------


def test_a_rolled_back_transaction_starts_no_run(pikku: PikkuCelery) -> None:
    from django.db import transaction
    from orders.models import Order

    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(sku="tea", quantity=1)
        run_id = pikku.start_on_commit("sum", {"a": 1, "b": 2}, run_id="oc-1")
        assert run_id == "oc-1"
        assert pikku.list_runs() == []  # not before the commit
        raise Rollback
    assert orders() == []
    assert pikku.list_runs() == []
    assert pikku.engine.dispatcher.wakes == []  # type: ignore[attr-defined]


def test_a_committed_transaction_starts_the_run_after_the_commit(pikku: PikkuCelery) -> None:
    from django.db import transaction
    from orders.models import Order

    with transaction.atomic():
        Order.objects.create(sku="tea", quantity=1)
        run_id = pikku.start_on_commit("sum", {"a": 1, "b": 2})
        assert pikku.list_runs() == []
    assert orders() == ["tea"]
    run = pikku.get_run(run_id)
    assert (run.workflow, run.input, run.status) == ("sum", {"a": 1, "b": 2}, "running")
    assert pikku.engine.dispatcher.wakes == [(run_id, 0.0)]  # type: ignore[attr-defined]


def test_a_rolled_back_savepoint_drops_its_run_only(pikku: PikkuCelery) -> None:
    from django.db import transaction

    with transaction.atomic():
        kept = pikku.start_on_commit("sum", {"a": 1, "b": 1}, using="default")
        with pytest.raises(Rollback), transaction.atomic():
            pikku.start_on_commit("sum", {"a": 2, "b": 2}, run_id="dropped")
            raise Rollback
    assert [r.run_id for r in pikku.list_runs()] == [kept]


def test_outside_a_transaction_the_run_starts_at_once(pikku: PikkuCelery) -> None:
    run_id = pikku.start_on_commit("sum", {"a": 1, "b": 2})
    assert pikku.get_run(run_id).status == "running"


@pytest.mark.parametrize(("workflow", "data", "run_id", "error"), [
    ("nope", {}, None, WorkflowNotFoundError),
    ("sum", {"at": object()}, None, InvalidInputError),
    ("sum", {"$where": 1}, None, InvalidInputError),
    ("sum", {}, "$bad", InvalidInputError),
])
def test_a_bad_start_fails_inside_the_transaction(pikku: PikkuCelery, workflow: str,
                                                 data: Any, run_id: str | None,
                                                 error: type[Exception]) -> None:
    """Not after the commit, when the order would exist without its run (the bug)."""
    from django.db import transaction
    from orders.models import Order

    with pytest.raises(error), transaction.atomic():
        Order.objects.create(sku="tea", quantity=1)
        pikku.start_on_commit(workflow, data, run_id=run_id)
    assert orders() == []
    assert pikku.list_runs() == []


def test_the_projects_view_starts_the_order_run_on_commit(
        pikku: PikkuCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.test import Client
    from orders import views

    @pikku.workflow("order")
    def order(wf: WorkflowContext, data: Any) -> Any:
        return data

    monkeypatch.setattr(views, "pikku", pikku)
    client = Client(raise_request_exception=False)
    ok = client.post("/orders/", {"sku": "tea", "quantity": 2}, content_type="application/json")
    assert ok.status_code == 201
    assert pikku.get_run(ok.json()["run_id"]).input["sku"] == "tea"
    failed = client.post("/orders/", {"sku": "cake", "quantity": 1, "fail": True},
                         content_type="application/json")
    assert failed.status_code == 500
    assert orders() == ["tea"]
    assert [r.run_id for r in pikku.list_runs()] == [ok.json()["run_id"]]


# --- access ------------------------------------------------------------------------------


def test_by_default_only_active_staff_users_get_in(pikku: PikkuCelery) -> None:
    from django.contrib.auth.models import User

    web = django_web(pikku, PIKKU_AUTHORIZE=None)  # None: the default
    assert web.call("GET", PREFIX + "/runs", user="admin")[0] == 200
    assert web.call("GET", PREFIX + "/runs", user="reader")[0] == 403
    assert web.call("GET", PREFIX + "/runs", user=None)[0] == 401
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {}}, user="reader")[0] \
        == 403
    User.objects.get_or_create(username="gone", defaults={"is_staff": True, "is_active": False})
    assert web.call("GET", PREFIX + "/runs", user="gone")[0] == 401  # not logged in
    assert pikku.list_runs() == []


def test_an_anonymous_caller_authorize_lets_in_cannot_approve_in_anyones_name() -> None:
    """``PIKKU_AUTHORIZE`` may let in callers who are not signed in (a token checked in
    it): no user to record, so a body's ``by`` is refused."""
    web = django_web(with_an_open_gate(make_pikku()),
                     PIKKU_AUTHORIZE=lambda request, action, run_id: True)
    signed_in = web.call
    web.call = lambda *args, **kwargs: signed_in(*args, **{**kwargs, "user": None})
    check_unidentified_approvals(web)


def test_pikku_authorize_may_be_a_dotted_path(pikku: PikkuCelery) -> None:
    web = django_web(pikku, PIKKU_AUTHORIZE="tests.unit.test_contrib.authorize")
    assert web.call("GET", PREFIX + "/runs", user="reader")[0] == 200
    assert web.call("GET", PREFIX + "/runs", user="nobody")[0] == 403


@pytest.mark.parametrize("middleware", ["with", "without"])
def test_csrf_is_checked_with_or_without_the_middleware(pikku: PikkuCelery,
                                                        middleware: str) -> None:
    from django.conf import settings

    chain = [m for m in settings.MIDDLEWARE if middleware == "with" or "Csrf" not in m]
    web = django_web(pikku, MIDDLEWARE=chain)
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1}},
                    csrf=False)[0] == 403
    assert pikku.list_runs() == []
    assert web.call("POST", PREFIX + "/workflows/sum/runs", {"input": {"a": 1}})[0] == 202


def test_every_get_hands_out_the_csrf_cookie(pikku: PikkuCelery) -> None:
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    with override_settings(PIKKU_CELERY_APP=pikku.app, PIKKU_AUTHORIZE=None):
        client = Client(enforce_csrf_checks=True)
        client.force_login(User.objects.get(username="admin"))
        client.get(PREFIX + "/runs")
        token = client.cookies["csrftoken"].value
        response = client.post(PREFIX + "/workflows/sum/runs", {"input": {"a": 1}},
                               content_type="application/json", HTTP_X_CSRFTOKEN=token)
        assert response.status_code == 202


# --- finding the PikkuCelery --------------------------------------------------------------


def test_the_api_finds_the_current_celery_apps_pikku_without_the_setting() -> None:
    from celery import _state
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from pikku_celery.contrib.django import project_pikku

    before = _state.get_current_app()
    try:
        with override_settings(PIKKU_CELERY_APP=None):
            Celery("bare-current")  # set as current, as proj/celery.py's app is
            with pytest.raises(ImproperlyConfigured, match="PIKKU_CELERY_APP"):
                project_pikku()
            pikku = make_pikku()
            pikku.app.set_current()
            assert project_pikku() is pikku
    finally:
        before.set_current()
    with override_settings(PIKKU_CELERY_APP="djproj.celery.app"):
        from djproj.celery import pikku as project

        assert project_pikku() is project


# --- system checks -----------------------------------------------------------------------


def test_checks_report_an_unusable_authorize_and_a_missing_auth_app() -> None:
    from django.test import override_settings

    from pikku_celery.contrib.django.apps import check_settings

    assert check_settings() == []
    with override_settings(PIKKU_AUTHORIZE="tests.nowhere.allow"):
        assert [m.id for m in check_settings()] == ["pikku.E001"]
    with override_settings(PIKKU_AUTHORIZE=42):
        assert [m.id for m in check_settings()] == ["pikku.E001"]
    with override_settings(MIDDLEWARE=[]):
        assert [m.id for m in check_settings()] == ["pikku.W001"]


# --- manage.py pikku ---------------------------------------------------------------------


def test_manage_py_pikku_lists_and_shows_runs(pikku: PikkuCelery) -> None:
    import io

    from django.core.management import CommandError, call_command
    from django.test import override_settings

    run_id = pikku.start("sum", {"a": 1, "b": 2}, inline=True)
    out = io.StringIO()
    with override_settings(PIKKU_CELERY_APP=pikku.app):
        call_command("pikku", "runs", stdout=out)
        assert run_id in out.getvalue() and "completed" in out.getvalue()
        out = io.StringIO()
        call_command("pikku", "show", run_id, "--json", stdout=out)
        shown = json.loads(out.getvalue())
        assert shown["run"]["output"] == 3 and shown["steps"][0]["step_name"] == "add"
        with pytest.raises(CommandError, match="WorkflowRunNotFoundError"):
            call_command("pikku", "show", "ghost")


@pytest.mark.parametrize("length", ["abc", "-1", "12x"])
def test_an_api_post_whose_content_length_is_not_a_number_is_a_400(
        pikku: PikkuCelery, length: str) -> None:
    from django.test import Client, override_settings

    with override_settings(PIKKU_CELERY_APP=pikku.app,
                           PIKKU_AUTHORIZE=lambda request, action, run_id: True):
        answer = Client(REMOTE_ADDR="127.0.0.1", HTTP_HOST="localhost").generic(
            "POST", PREFIX + "/workflows/sum/runs", b'{"input": {"a": 1}}',
            content_type="application/json", CONTENT_LENGTH=length)
    assert answer.status_code == 400, answer.content
    assert answer.json()["message"] == "the Content-Length header is not a number"
    assert pikku.list_runs() == []
