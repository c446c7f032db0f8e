"""How a pass's write is run: the library's own errors are the workflow's, anything else
interrupts the pass (``replay.PassInterrupted``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pikku_celery.model.errors import PikkuError
from pikku_celery.workflow.replay import PassInterrupted

T = TypeVar("T")


def guarded(operation: Callable[[], T]) -> T:
    """Run a pass's write. The library's own errors (bad input, an unknown child workflow)
    are the workflow's and fail the run; anything else is the broker's, MongoDB's or Redis's
    and only interrupts the pass (see ``PassInterrupted``)."""
    try:
        return operation()
    except PikkuError:
        raise
    except Exception as exc:
        raise PassInterrupted() from exc
