"""The test Django project (``tests/djangoproject``) set up in this process, once.

Its packages (``djproj``, ``orders``) are top-level, as in a real project, so the
project directory goes on ``sys.path``; ``manage.py`` and ``celery -A djproj worker``
subprocesses run from it. Django is set up at most once per process: every in-process
Django test uses these settings (a temporary sqlite file as the database), and
``override_settings`` for the rest.

``DJANGO_SETTINGS_MODULE`` is removed from the environment again once Django is set up:
Celery installs its Django fix-up on every app created while it is set, and subprocesses
of other tests would inherit it. Celery's current and default apps are put back too (the
project's app takes both, as in a real project).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1] / "djangoproject"
SETTINGS = "djproj.settings"
_done = False


def setup() -> None:
    global _done
    if _done:
        return
    import django
    from celery import _state
    from django.core.management import call_command

    if str(PROJECT) not in sys.path:
        sys.path.insert(0, str(PROJECT))
    fd, db = tempfile.mkstemp(prefix="djproj-", suffix=".sqlite3")
    os.close(fd)
    atexit.register(_remove, db)
    current, default = _state.get_current_app(), _state.default_app
    os.environ["DJPROJ_DB"] = db
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    try:
        django.setup()
        call_command("migrate", run_syncdb=True, verbosity=0)
    finally:
        os.environ.pop("DJANGO_SETTINGS_MODULE", None)
        os.environ.pop("DJPROJ_DB", None)
        current.set_current()
        _state.default_app = default
    _done = True


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
