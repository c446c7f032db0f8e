"""Django: ``INSTALLED_APPS += ["pikku_celery.contrib.django"]``.

- ``apps.PikkuConfig`` imports a ``workflows`` module from every installed app when Django
  sets up (web, shell, management commands, and ``celery -A proj worker``, where Celery's
  Django fix-up runs ``django.setup()`` before the worker consumes), so every workflow is
  registered before anything starts or runs one.
- ``path("pikku/", include("pikku_celery.contrib.django.urls"))`` mounts the JSON API
  (``views``): staff users only unless ``PIKKU_AUTHORIZE`` says otherwise, CSRF on every
  POST.
- ``python manage.py pikku ...`` runs the ``pikku`` command group (``pikku_celery.operate.cli``).
- ``pikku.start_on_commit(...)`` starts a run once the current transaction commits: this
  module registers Django's ``transaction.on_commit`` with the core when it is imported
  (``after_commit``; the core never imports Django or ``contrib/``), and the start intent
  written in that transaction (``intents.record_start``, the ``StartIntent`` model), which
  every worker's reaper drains after its sweep (``drain_start_intents``, registered with
  ``pikku_celery.engine.sweep_hooks``) when the start at the commit failed.

The ``PikkuCelery`` is the one bound to the project's Celery app: the app named by the
``PIKKU_CELERY_APP`` setting (a dotted path, ``"proj.celery.app"``), else Celery's current
app, the one ``proj/celery.py`` creates and ``proj/__init__.py`` imports in Celery's Django
guide. Nothing here imports Django until it is used: pikku does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pikku_celery.app import PikkuCelery
from pikku_celery.contrib.django import intents
from pikku_celery.engine import sweep_hooks
from pikku_celery.worker import on_commit

WORKFLOWS_MODULE = "workflows"


def start_on_commit(pikku: PikkuCelery, workflow: str | Callable[..., Any], data: Any = None,
                    *, run_id: str | None = None, using: str | None = None) -> str:
    """``pikku.start_on_commit(...)``: return the run id now; create and dispatch the run
    once the transaction open on database ``using`` commits (at once when none is open),
    like Celery's ``delay_on_commit``. A rolled-back transaction starts nothing.

    The start is a row of your database (``StartIntent``) written in your transaction;
    the input is converted to JSON by ``CELERY_PIKKU_JSON_ENCODER`` (default
    ``DjangoJSONEncoder``). Everything that can be checked before the commit is (the
    workflow is registered, the run id and the input can be stored), so a bad call fails
    inside the transaction and rolls back with it, not after your rows are committed.
    What can still fail after the commit (MongoDB unreachable) is logged and leaves the
    row, which a worker's reaper starts later under the same run id
    (``drain_start_intents``): the run starts once, never twice (see ``intents``)."""
    return pikku.start_on_commit(workflow, data, run_id=run_id, using=using)


def after_commit(start: Callable[[], object], using: str | None) -> None:
    """Django's side of ``PikkuCelery.start_on_commit`` (``pikku_celery.worker.on_commit``):
    ``start`` runs when the transaction on database ``using`` commits."""
    from django.db import transaction

    transaction.on_commit(start, using=using)


on_commit.register(after_commit)
on_commit.register_record_start(intents.record_start)
sweep_hooks.register(intents.drain_after_sweep)
drain_start_intents = intents.drain_start_intents


def project_pikku() -> PikkuCelery:
    """The ``PikkuCelery`` of the project's Celery app (``PIKKU_CELERY_APP``, else Celery's
    current app). Read at every call: settings can change in tests."""
    from celery import current_app
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from pikku_celery.contrib._access import import_dotted

    named = getattr(settings, "PIKKU_CELERY_APP", None)
    if named is None:
        celery_app = current_app._get_current_object()
    else:
        celery_app = import_dotted(named, "PIKKU_CELERY_APP") if isinstance(named, str) \
            else named
    if isinstance(celery_app, PikkuCelery):
        return celery_app
    found = getattr(celery_app, "pikku", None)
    if not isinstance(found, PikkuCelery):
        where = ("PIKKU_CELERY_APP" if named is not None
                 else "Celery's current app (set PIKKU_CELERY_APP = \"proj.celery.app\" to "
                      "name yours, or import it in proj/__init__.py as Celery's Django "
                      "guide does)")
        raise ImproperlyConfigured(
            f"pikku: no PikkuCelery is bound to Celery app {getattr(celery_app, 'main', None)!r}"
            f" from {where}: create PikkuCelery(app) where the Celery app is created")
    return found
