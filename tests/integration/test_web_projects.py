"""The Django project of ``tests/djangoproject`` and the Flask app of
``tests/flaskproject``, each as a user builds it from the README, on one real
``celery -A`` worker subprocess: a run started from the web (Django: by a view, on commit)
completes on the worker, is read through the API by an authorized user and refused to an
anonymous one, and the ``pikku`` command of each framework lists it.

The projects configure pikku only through their settings (``CELERY_PIKKU_*`` in Django,
``PIKKU_*`` in ``app.config``), so the worker finding the workflows proves they were
registered there: Django's by pikku's app autodiscovering ``orders/workflows.py`` when
Celery's Django fix-up sets Django up in the worker; Flask's by ``shared_step`` and
``shared_workflow`` binding to the ``PikkuCelery`` the factory made. Each test has its own
MongoDB database (on the session's mongod), Redis key prefix (broker keys too) and queue.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from celery import _state

from pikku_celery import PikkuCelery
from tests.conftest import REDIS_URL
from tests.integration.test_celery_workers import READY_TIMEOUT_S, Worker, wait_for
from tests.support import django_project
from tests.support.mongod import MongoTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
FLASK_PROJECT = ROOT / "tests" / "flaskproject"
RUN_TIMEOUT_S = 30


@pytest.fixture
def services(mongo_server: MongoTarget, key_prefix: str) -> Iterator[dict[str, str]]:
    """This test's MongoDB database, Redis key prefix and queue (dropped afterwards)."""
    db = f"pikku_web_{uuid.uuid4().hex[:12]}"
    yield {"mongo": mongo_server.url_for(db), "redis": REDIS_URL, "prefix": key_prefix,
           "queue": f"pikku-web-{uuid.uuid4().hex[:10]}"}
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(mongo_server.url)
    with contextlib.suppress(Exception):
        client.drop_database(db)
    client.close()


@pytest.fixture
def celery_state() -> Iterator[None]:
    """The projects make their Celery app current and default, as users' projects do."""
    current, default = _state.get_current_app(), _state.default_app
    yield
    current.set_current()
    _state.default_app = default


@contextlib.contextmanager
def worker(app: str, cwd: Path, env: dict[str, str], queue: str,
           logdir: Path) -> Iterator[Worker]:
    name = f"web-{uuid.uuid4().hex[:6]}"
    log_path = logdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "threads", "-c", "2",
             "-Q", queue, "-n", f"{name}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "--loglevel", "INFO"],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    w = Worker(name, "threads", proc, log_path)
    try:
        def ready() -> bool:
            if not w.alive():
                pytest.fail(f"worker exited with {proc.returncode}:\n{w.log()}")
            return "ready." in w.log()
        wait_for(ready, READY_TIMEOUT_S, "the worker to be ready", w.log)
        yield w
    finally:
        if w.alive():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                w.kill()
        w.signal_group(signal.SIGKILL)


def wait_run(pikku: PikkuCelery, run_id: str, w: Worker) -> Any:
    try:
        return pikku.wait(run_id, RUN_TIMEOUT_S)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\nsteps: {pikku.get_steps(run_id)}\n{w.log()[-6000:]}")


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- Django ------------------------------------------------------------------------------


def test_django_project_on_a_real_worker(services: dict[str, str], celery_state: None,
                                         tmp_path: Path) -> None:
    env = {**base_env(), "DJPROJ_MONGO_URL": services["mongo"],
           "DJPROJ_REDIS_URL": services["redis"], "DJPROJ_BROKER_URL": services["redis"],
           "DJPROJ_KEY_PREFIX": services["prefix"], "DJPROJ_QUEUE": services["queue"]}
    pikku = _django_in_this_process(services)
    from django.contrib.auth.models import User
    from django.test import Client
    from orders.models import Order

    admin = User.objects.get_or_create(username="web-admin", defaults={"is_staff": True})[0]
    clerk = User.objects.get_or_create(username="web-clerk")[0]
    with worker("djproj", django_project.PROJECT, env, services["queue"], tmp_path) as w:
        shop = Client(raise_request_exception=False)
        created = shop.post("/orders/", {"sku": "tea", "quantity": 3},
                            content_type="application/json")
        assert created.status_code == 201, created.content
        run_id = created.json()["run_id"]
        assert Order.objects.get(pk=created.json()["order_id"]).run_id == run_id
        run = wait_run(pikku, run_id, w)
        assert run.status == "completed", run
        assert run.output == {"total": 12,
                              "message": f"order {created.json()['order_id']}: 12 EUR"}

        # a rolled-back order starts nothing
        before = len(pikku.list_runs())
        assert shop.post("/orders/", {"sku": "cake", "quantity": 1, "fail": True},
                         content_type="application/json").status_code == 500
        assert len(pikku.list_runs()) == before

        # the API: staff read and start (CSRF token from the cookie), others are refused
        staff = Client(enforce_csrf_checks=True)
        staff.force_login(admin)
        served = staff.get(f"/pikku/api/runs/{run_id}")
        assert served.status_code == 200 and served.json()["status"] == "completed"
        steps = staff.get(f"/pikku/api/runs/{run_id}/steps").json()["steps"]
        assert [(s["step_name"], s["status"]) for s in steps] == [
            ("price", "succeeded"), ("confirm", "succeeded")]
        started = staff.post("/pikku/api/workflows/order/runs",
                             {"input": {"order_id": 0, "sku": "cake", "quantity": 2}},
                             content_type="application/json",
                             HTTP_X_CSRFTOKEN=staff.cookies["csrftoken"].value)
        assert started.status_code == 202, started.content
        assert wait_run(pikku, started.json()["run_id"], w).output["total"] == 14
        assert Client().get(f"/pikku/api/runs/{run_id}").status_code == 401
        other = Client()
        other.force_login(clerk)
        assert other.get(f"/pikku/api/runs/{run_id}").status_code == 403

        # manage.py pikku, in a process of its own
        listed = subprocess.run([sys.executable, "manage.py", "pikku", "runs"],
                                cwd=django_project.PROJECT, env=env, capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert run_id in listed.stdout and started.json()["run_id"] in listed.stdout
        shown = subprocess.run([sys.executable, "manage.py", "pikku", "show", run_id,
                                "--json"], cwd=django_project.PROJECT, env=env,
                               capture_output=True, text=True, timeout=60)
        assert json.loads(shown.stdout)["run"]["status"] == "completed", shown.stderr
        missing = subprocess.run([sys.executable, "manage.py", "pikku", "show", "ghost"],
                                 cwd=django_project.PROJECT, env=env, capture_output=True,
                                 text=True, timeout=60)
        assert missing.returncode == 1
        assert missing.stderr.strip().splitlines() == [
            "Error: WorkflowRunNotFoundError: no workflow run with id 'ghost'"]


def _django_in_this_process(services: dict[str, str]) -> PikkuCelery:
    """The project's Celery app in this process, configured like the worker. Django is set
    up once per process (maybe by an earlier test, with other ``DJPROJ_*`` values), so the
    app's configuration is updated here, before the lazy ``PikkuCelery`` first reads it."""
    django_project.setup()
    from djproj.celery import app, pikku

    assert pikku._engine is None, "djproj's PikkuCelery was used before this test set it up"
    values = {
        "broker_url": services["redis"],
        "broker_transport_options": {"global_keyprefix": f"{services['prefix']}:kombu:"},
        "task_default_queue": services["queue"], "pikku_queue": services["queue"],
        "pikku_mongo_url": services["mongo"], "pikku_redis_url": services["redis"],
        "pikku_key_prefix": services["prefix"]}
    app.conf.update(values)
    # Celery before 5.7 reads a namespaced app's setting by its namespaced name first
    # (CELERY_PIKKU_MONGO_URL, from Django's settings), whatever conf.update set.
    app.conf.update({f"CELERY_{name.upper()}": value for name, value in values.items()})
    return pikku


# --- Flask -------------------------------------------------------------------------------


def test_flask_app_factory_on_a_real_worker(services: dict[str, str], celery_state: None,
                                            monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    settings = {"FLASKPROJ_MONGO_URL": services["mongo"],
                "FLASKPROJ_REDIS_URL": services["redis"],
                "FLASKPROJ_BROKER_URL": services["redis"],
                "FLASKPROJ_KEY_PREFIX": services["prefix"],
                "FLASKPROJ_QUEUE": services["queue"]}
    env = {**base_env(), **settings}
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(FLASK_PROJECT))
    from flaskproj import create_app

    from pikku_celery.contrib.flask import current_pikku

    app = create_app()
    with app.app_context():
        pikku = current_pikku()
    with worker("flaskproj.make_celery", FLASK_PROJECT, env, services["queue"], tmp_path) as w:
        ada = app.test_client()
        assert ada.post("/login", data={"name": "ada"}).status_code == 204
        started = ada.post("/pikku/api/workflows/greeting/runs", json={"input": {"name": "ada"}})
        assert started.status_code == 202, started.json
        run_id = started.json["run_id"]
        run = wait_run(pikku, run_id, w)
        assert (run.status, run.output) == ("completed", "HELLO ADA!")
        served = ada.get(f"/pikku/api/runs/{run_id}/history")
        assert [(a["step_name"], a["status"]) for a in served.json["attempts"]] == [
            ("greet", "succeeded"), ("shout", "succeeded")]

        bob = app.test_client()
        bob.post("/login", data={"name": "bob"})
        assert bob.get(f"/pikku/api/runs/{run_id}").status_code == 200
        assert bob.post(f"/pikku/api/runs/{run_id}/cancel", json={}).status_code == 403
        assert app.test_client().get(f"/pikku/api/runs/{run_id}").status_code == 401
        # what another site's form can send with ada's cookie
        forged = ada.post("/pikku/api/workflows/greeting/runs",
                          data=json.dumps({"input": {"name": "mallory"}}),
                          content_type="text/plain",
                          headers={"Origin": "https://evil.example",
                                   "Sec-Fetch-Site": "cross-site"})
        assert forged.status_code == 403
        assert [r.run_id for r in pikku.list_runs()] == [run_id]

        listed = subprocess.run([sys.executable, "-m", "flask", "--app", "flaskproj", "pikku",
                                 "runs"], cwd=FLASK_PROJECT, env=env, capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert run_id in listed.stdout and "completed" in listed.stdout
