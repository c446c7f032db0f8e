"""Reads of runs for callers: a run, its steps, its history, and waiting for its end.
Each checks the run id and raises ``WorkflowRunNotFoundError`` for an unknown run; no
writes."""

from __future__ import annotations

import time

from pikku_celery.leases.base import LeaseService
from pikku_celery.model import keys
from pikku_celery.model.errors import WorkflowRunNotFoundError
from pikku_celery.model.records import StepAttempt, StepState, WorkflowRun
from pikku_celery.model.validate import check_name
from pikku_celery.store.base import WorkflowStore

# The backstop's first and longest interval between reads of a run being waited for, in
# seconds: it grows by 1.6x while no announcement comes.
BACKSTOP_S = (0.05, 1.0)

def get_run(store: WorkflowStore, run_id: str) -> WorkflowRun:
    """The run ``run_id``; ``WorkflowRunNotFoundError`` when there is none."""
    check_name("run id", run_id)
    run = store.get_run(run_id)
    if run is None:
        raise WorkflowRunNotFoundError(run_id)
    return run


class Reads:
    def __init__(self, store: WorkflowStore, leases: LeaseService) -> None:
        self.store = store
        self.leases = leases

    def get_run(self, run_id: str) -> WorkflowRun:
        return get_run(self.store, run_id)

    def get_steps(self, run_id: str) -> list[StepState]:
        self.get_run(run_id)
        return self.store.list_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        self.get_run(run_id)
        return self.store.get_history(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        """The run once it has ended. Woken by the announcement of its end (``Runs``,
        ``Passes``: the lease service's ``announce``), as Celery's ``AsyncResult.get`` is
        by its result; the run is read once listening begins, so an end announced before
        is read, and again on a backstop timer (``BACKSTOP_S``), so a lost announcement
        (Redis down, an end written by a process that died before it announced) costs
        latency, never the answer."""
        deadline = time.monotonic() + timeout
        interval = BACKSTOP_S[0]
        with self.leases.listen(keys.run_lease_key(run_id)) as listener:
            while True:
                run = self.get_run(run_id)
                if run.is_terminal:
                    return run
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"run {run_id} is still {run.status} after {timeout}s")
                if not listener.wait(min(interval, remaining)):
                    interval = min(interval * 1.6, BACKSTOP_S[1])
