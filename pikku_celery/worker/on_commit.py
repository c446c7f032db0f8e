"""How ``PikkuCelery.start_on_commit`` waits for a transaction to commit: a web
framework's adapter registers it, and the core knows no framework (it never imports
``contrib/``). ``pikku_celery.contrib.django`` registers Django's
``transaction.on_commit`` when it is imported, which ``INSTALLED_APPS`` does in every
process that sets Django up; importing that module does the same elsewhere."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.model.validate import check_value

# ``(start, using)``: call ``start`` once the transaction open on database ``using``
# commits (at once when none is open); never when it rolls back.
AfterCommit = Callable[[Callable[[], object], "str | None"], None]

_lock = threading.Lock()
_registered: list[AfterCommit] = []


def register(after_commit: AfterCommit) -> None:
    """Make ``after_commit`` the way ``start_on_commit`` waits for a commit (the last
    registered wins; registering the same one again changes nothing)."""
    with _lock:
        if after_commit in _registered:
            _registered.remove(after_commit)
        _registered.append(after_commit)


def registered() -> AfterCommit:
    """The registered way to wait for a commit. Raises ``PikkuConfigurationError`` when
    no adapter registered one."""
    with _lock:
        if _registered:
            return _registered[-1]
    raise PikkuConfigurationError(
        "start_on_commit needs a web framework's transactions: add "
        "'pikku_celery.contrib.django' to INSTALLED_APPS (or import it)")



# ``(pikku, workflow, data, run_id, using)``: keep the start of ``workflow`` (a registered
# name) with ``data`` under ``run_id`` with the transaction open on database ``using``, and
# start it once that commits. Raises inside the transaction when the start cannot be kept
# (``data`` that cannot be stored). ``pikku_celery.contrib.django`` registers one (its
# start intents, rows written in that transaction); without one, ``start_after_commit``.
RecordStart = Callable[[Any, str, Any, str, "str | None"], None]

_record_start: list[RecordStart] = []


def register_record_start(record: RecordStart) -> None:
    """Make ``record`` the way ``start_on_commit`` keeps a start with the transaction
    (the last registered wins)."""
    with _lock:
        _record_start[:] = [record]


def registered_record_start() -> RecordStart:
    """The registered ``RecordStart``, else ``start_after_commit``. Raises
    ``PikkuConfigurationError`` when no adapter registered a way to wait for a commit."""
    after_commit = registered()
    with _lock:
        if _record_start:
            return _record_start[-1]

    def start_after_commit(pikku: Any, workflow: str, data: Any, run_id: str,
                           using: str | None) -> None:
        """The input checked now; the run started from the ``AfterCommit`` hook alone."""
        check_value("workflow input", data)
        after_commit(lambda: pikku.start(workflow, data, run_id=run_id), using)

    return start_after_commit
