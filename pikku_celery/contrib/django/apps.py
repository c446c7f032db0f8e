"""The Django app: registers every installed app's workflows when Django sets up."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.utils.module_loading import autodiscover_modules

from pikku_celery.contrib.django import WORKFLOWS_MODULE


class PikkuConfig(AppConfig):
    """``ready()`` runs in every process that calls ``django.setup()``: ``runserver`` and
    WSGI/ASGI servers, ``shell`` and every management command, and Celery workers (Celery's
    Django fix-up calls it when the worker imports its modules, before it consumes). So
    ``<app>/workflows.py`` is imported, and its workflows and steps registered, before
    anything can start or run them, as Celery's ``autodiscover_tasks`` does for
    ``tasks.py``. An import error in one of them is raised, not skipped."""

    name = "pikku_celery.contrib.django"
    label = "pikku"
    verbose_name = "pikku workflows"
    default_auto_field = "django.db.models.BigAutoField"  # whatever the project's default

    def ready(self) -> None:
        autodiscover_modules(WORKFLOWS_MODULE)
        checks.register(check_settings)
        checks.register(check_services)


def check_settings(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """``manage.py check``: the API's access settings can work."""
    from pikku_celery.contrib._access import import_authorize, import_run_filter
    from pikku_celery.model.errors import PikkuConfigurationError

    found: list[checks.CheckMessage] = []
    authorize = getattr(settings, "PIKKU_AUTHORIZE", None)
    try:
        import_run_filter(getattr(settings, "PIKKU_RUN_FILTER", None), "PIKKU_RUN_FILTER")
    except (ImportError, TypeError) as exc:
        found.append(checks.Error(str(exc), id="pikku.E001"))
    if authorize is not None:
        try:
            import_authorize(authorize, "PIKKU_AUTHORIZE")
        except (ImportError, TypeError, PikkuConfigurationError) as exc:
            found.append(checks.Error(str(exc), id="pikku.E001"))
    elif ("django.contrib.auth" not in settings.INSTALLED_APPS
          or "django.contrib.auth.middleware.AuthenticationMiddleware"
          not in settings.MIDDLEWARE):
        found.append(checks.Warning(
            "the pikku API lets staff users in by default, which needs django.contrib.auth "
            "and its AuthenticationMiddleware; without them every request is refused",
            hint="add them, or set PIKKU_AUTHORIZE to a callable (request, action, run_id)",
            id="pikku.W001"))
    return found


def check_services(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """``manage.py check``: the project's ``PikkuCelery`` can be found and has a MongoDB
    and a Redis URL (``CELERY_PIKKU_MONGO_URL``, ``CELERY_PIKKU_REDIS_URL``) unless it was
    given ``store=``/``leases=``. Warnings, not errors: nothing connects before the first
    use, and ``migrate`` and friends need neither; but a worker or a start would fail."""
    from django.core.exceptions import ImproperlyConfigured

    from pikku_celery.contrib.django import project_pikku
    from pikku_celery.worker.config import conf_value, setting_names

    try:
        pikku = project_pikku()
    except (ImproperlyConfigured, ImportError) as exc:
        return [checks.Warning(str(exc), id="pikku.W003")]
    found: list[checks.CheckMessage] = []
    for name, service, argument in (("mongo_url", "MongoDB", "store"),
                                    ("redis_url", "Redis", "leases")):
        given, _what = pikku._config.raw(argument)  # PikkuCelery(app, store=...)
        if given is None and conf_value(pikku.app, name) in (None, ""):
            found.append(checks.Warning(
                f"pikku has no {service} URL for Celery app {pikku.app.main!r}: workers "
                f"and pikku.start will fail with PikkuConfigurationError",
                hint=f"set {setting_names(pikku.app, name)}, or pass {argument}= to "
                     "PikkuCelery",
                id="pikku.W002"))
    return found
