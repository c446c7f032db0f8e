"""Retention: runs and their history otherwise grow forever.

``purge`` deletes ended runs (completed, failed, cancelled) that ended more than
``older_than`` ago, with their steps and history, one bounded batch per store call (each
an index-served read of at most ``batch`` run ids and three deletes by id), until a batch
comes back short. The age is measured on the lease service's clock, the clock every run's
times are written with. A live run is never deleted: the store refuses live statuses, and
its delete repeats the ended status in its own filter (``WorkflowStore.purge_runs``).
"""

from __future__ import annotations

from collections.abc import Iterable

from pikku_celery.engine.facade import Engine
from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.records import RUN_TERMINAL
from pikku_celery.store._retention import MAX_COUNT, check_purge

DEFAULT_BATCH = 500


def purge(engine: Engine, older_than: Duration, *, statuses: Iterable[str] = RUN_TERMINAL,
          dry_run: bool = False, batch: int = DEFAULT_BATCH) -> int:
    """Delete (or with ``dry_run`` count) the ended runs older than ``older_than``;
    returns how many."""
    cutoff_ms = engine.now_ms() - to_ms(older_than, what="older_than")
    chosen = check_purge(cutoff_ms, statuses, batch)
    store = engine.store
    if dry_run:
        return sum(store.count_runs(status=status, updated_before_ms=cutoff_ms,
                                    limit=MAX_COUNT) for status in chosen)
    total = 0
    while True:
        deleted = store.purge_runs(cutoff_ms, statuses=chosen, limit=batch)
        total += len(deleted)
        if len(deleted) < batch:
            return total
