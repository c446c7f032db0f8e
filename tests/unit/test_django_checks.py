"""``manage.py check`` flags a project whose ``PikkuCelery`` has no MongoDB or Redis URL
(``pikku.W002``) or cannot be found (``pikku.W003``), issue 25 item 6: before, the first
start or worker failed instead."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from tests.support import django_project


@pytest.fixture(autouse=True)
def _django() -> None:
    django_project.setup()


def _app(**settings: str) -> Celery:
    """A Celery app configured Django's way: ``CELERY_*`` settings, namespace CELERY."""
    app = Celery("checked", set_as_current=False)
    app.config_from_object(SimpleNamespace(**settings), namespace="CELERY")
    return app


def _checked(pikku_or_app: object) -> list[tuple[str, str, str]]:
    from django.test import override_settings

    from pikku_celery.contrib.django.apps import check_services

    with override_settings(PIKKU_CELERY_APP=pikku_or_app):
        return [(m.id or "", m.msg, m.hint or "") for m in check_services()]


def test_a_missing_mongo_url_is_flagged_with_the_setting_to_set() -> None:
    app = _app(CELERY_PIKKU_REDIS_URL="redis://127.0.0.1:6379/0")
    PikkuCelery(app)
    [(check_id, message, hint)] = _checked(app)
    assert check_id == "pikku.W002" and "no MongoDB URL" in message
    assert "CELERY_PIKKU_MONGO_URL" in hint


def test_both_urls_missing_are_two_warnings_and_given_ones_none() -> None:
    bare = _app()
    PikkuCelery(bare)
    found = _checked(bare)
    assert [m[0] for m in found] == ["pikku.W002", "pikku.W002"]
    assert "CELERY_PIKKU_REDIS_URL" in found[1][2]
    configured = _app(CELERY_PIKKU_MONGO_URL="mongodb://127.0.0.1:27017/x",
                      CELERY_PIKKU_REDIS_URL="redis://127.0.0.1:6379/0")
    PikkuCelery(configured)
    assert _checked(configured) == []
    explicit = _app()  # store= and leases= given: no URL needed
    PikkuCelery(explicit, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService())
    assert _checked(explicit) == []


def test_a_celery_app_without_pikku_is_flagged() -> None:
    [(check_id, message, _)] = _checked(_app())
    assert check_id == "pikku.W003" and "no PikkuCelery is bound" in message


def test_manage_py_check_reports_it() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DJANGO_SETTINGS_MODULE", "DJPROJ_MONGO_URL")}
    env["PYTHONPATH"] = os.pathsep.join([str(django_project.PROJECT.parents[1]),
                                         env.get("PYTHONPATH", "")])
    checked = subprocess.run([sys.executable, "manage.py", "check"],
                             cwd=django_project.PROJECT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr  # a warning: migrate etc. still run
    assert "(pikku.W002) pikku has no MongoDB URL for Celery app 'djproj'" in checked.stderr
    assert "CELERY_PIKKU_MONGO_URL" in checked.stderr
