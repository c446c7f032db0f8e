"""Argument checks shared by both stores' ``count_runs`` and ``purge_runs``.

Both are operators' tools (``pikku purge``, the dashboard's counts): each call is bounded
(a count stops at its limit, a purge deletes one batch), and a purge can only ever name
ended statuses, so no argument can reach a live run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.keys import RunField as R
from pikku_celery.model.records import RUN_STATUSES, RUN_TERMINAL
from pikku_celery.model.validate import check_name

MAX_PURGE_BATCH = 1000
MAX_COUNT = 1_000_000


def check_count(status: object, workflow: object, updated_before_ms: object,
                limit: object) -> None:
    if status not in RUN_STATUSES:
        raise InvalidInputError(f"unknown run status {status!r}; one of {list(RUN_STATUSES)}")
    if workflow is not None:
        check_name("workflow name", workflow)
        if updated_before_ms is not None:
            # No index has both: the count would scan every run of the status.
            raise InvalidInputError("count_runs takes a workflow or updated_before_ms, "
                                    "not both")
    if updated_before_ms is not None:
        _check_ms("updated_before_ms", updated_before_ms)
    _check_limit(limit, MAX_COUNT)


def check_purge(ended_before_ms: object, statuses: Iterable[str], limit: object) -> list[str]:
    """The statuses to purge, in a stable order; each must be an ended one."""
    _check_ms("ended_before_ms", ended_before_ms)
    if isinstance(statuses, str):
        statuses = [statuses]
    chosen = sorted(set(statuses))
    live = [s for s in chosen if s not in RUN_TERMINAL]
    if live or not chosen:
        raise InvalidInputError(
            f"purge_runs deletes ended runs only: statuses must be among "
            f"{sorted(RUN_TERMINAL)}, got {chosen!r}")
    _check_limit(limit, MAX_PURGE_BATCH)
    return chosen


def _check_ms(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{what} must be an int of epoch milliseconds, got {value!r}")


def _check_limit(limit: object, most: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise InvalidInputError(f"limit must be an int from 1 to {most}, got {limit!r}")


def parked_steps(runs: Iterable[dict[str, Any]]) -> dict[str, str]:
    """``{parent step invocation id: child run id}`` for the child runs among ``runs`` (run
    documents with their parent fields).

    A purge keeps a child run whose parent's step is still parked on it (``running``, its
    ``child_run_id`` the child's): the parent has not heard the child's outcome yet (its
    notification was lost, say, and its next pass will look). Deleted, the child would be
    created again by that pass and run every step a second time. Such a child is purged by
    a later purge, once its parent's step has settled."""
    return {keys.invocation_id(d[R.PARENT_RUN], d[R.PARENT_STEP]): d[R.ID] for d in runs
            if d.get(R.PARENT_RUN) is not None and d.get(R.PARENT_STEP) is not None}
