"""How ``PikkuCelery.start_on_commit`` waits for a transaction to commit: a web
framework's adapter registers it, and the core knows no framework (it never imports
``contrib/``). ``pikku_celery.contrib.django`` registers Django's
``transaction.on_commit`` when it is imported, which ``INSTALLED_APPS`` does in every
process that sets Django up; importing that module does the same elsewhere."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pikku_celery.errors import PikkuConfigurationError

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
