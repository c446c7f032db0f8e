"""Work a framework adapter adds to every worker's periodic reaper sweep, as
``on_commit`` lets it add how to wait for a commit: the core knows no framework (it never
imports ``contrib/``). ``pikku_celery.contrib.django`` registers the drain of its start
intents (``drain_start_intents``) when it is imported.

A hook is called with the sweeping worker's ``Engine`` after ``engine.reap()``, in the
process that holds the reaper lease (one on the whole cluster per interval). Its failure
is logged and never stops the sweep nor the other hooks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pikku_celery.reaper")

SweepHook = Callable[[Any], object]

_lock = threading.Lock()
_registered: list[SweepHook] = []


def register(hook: SweepHook) -> None:
    """Call ``hook(engine)`` after every sweep (registering the same one again changes
    nothing)."""
    with _lock:
        if hook not in _registered:
            _registered.append(hook)


def unregister(hook: SweepHook) -> None:
    with _lock:
        if hook in _registered:
            _registered.remove(hook)


def run(engine: Any) -> None:
    """Call every registered hook with ``engine``; log (never raise) what one raises."""
    with _lock:
        hooks = list(_registered)
    for hook in hooks:
        try:
            hook(engine)
        except Exception:
            log.exception("pikku reaper: sweep hook %s failed", getattr(
                hook, "__qualname__", hook))
