"""Reads of runs for callers: a run, its steps, its history, and waiting for its end.
Each checks the run id and raises ``WorkflowRunNotFoundError`` for an unknown run; no
writes."""

from __future__ import annotations

import time

from pikku_celery.model.errors import WorkflowRunNotFoundError
from pikku_celery.model.records import StepAttempt, StepState, WorkflowRun
from pikku_celery.model.validate import check_name
from pikku_celery.store.base import WorkflowStore


def get_run(store: WorkflowStore, run_id: str) -> WorkflowRun:
    """The run ``run_id``; ``WorkflowRunNotFoundError`` when there is none."""
    check_name("run id", run_id)
    run = store.get_run(run_id)
    if run is None:
        raise WorkflowRunNotFoundError(run_id)
    return run


class Reads:
    def __init__(self, store: WorkflowStore) -> None:
        self.store = store

    def get_run(self, run_id: str) -> WorkflowRun:
        return get_run(self.store, run_id)

    def get_steps(self, run_id: str) -> list[StepState]:
        self.get_run(run_id)
        return self.store.list_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        self.get_run(run_id)
        return self.store.get_history(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        deadline = time.monotonic() + timeout
        interval = 0.01
        while True:
            run = self.get_run(run_id)
            if run.is_terminal:
                return run
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"run {run_id} is still {run.status} after {timeout}s")
            time.sleep(min(interval, remaining))
            interval = min(interval * 1.6, 0.5)
