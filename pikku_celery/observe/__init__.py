"""What pikku reports to the tools a Celery shop already watches: traces, metrics, Celery's task events, error trackers, logs."""  # noqa: E501

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

#: Told every event the engine reports (``engine.protocols.Emit``): ``(event, sender,
#: fields)``, in the thread that did the work, after the store recorded it.
Observer = Callable[[str, str, dict[str, Any]], None]

#: Each part is a module of this package with ``install(pikku) -> Observer | None`` (None when
#: its optional dependency is not installed or it is turned off).
PARTS = ("tracing", "metrics", "celery_events", "errors", "logs")

log = logging.getLogger("pikku_celery")


def install(pikku: Any) -> list[Observer]:
    """The observers of one ``PikkuCelery``, built when its engine is (in each process)."""
    observers = []
    for part in PARTS:
        module = importlib.import_module(f"{__name__}.{part}")
        observer = module.install(pikku)
        if observer is not None:
            observers.append(observer)
    return observers


def tell(observers: list[Observer], event: str, sender: str, fields: dict[str, Any]) -> None:
    """Tell each observer; one that raises is logged and never stops the engine (nor the
    observers after it)."""
    for observer in observers:
        try:
            observer(event, sender, fields)
        except Exception:
            log.exception("pikku: the observer %r failed on %s", observer, event)
