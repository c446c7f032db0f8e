"""A run's first pass finishes what the run's creator may have left half-done.

Two creators write a run and then have a second half: a fork copies the steps it replays
after inserting the run (``forks.copy_missing``), and a pass creating a child reads the
parent after inserting the child (``Runs.cancel_if_parent_cancelled``, a Dekker pair with
a cancel of the parent). A creator can stop in between: a worker killed, a pass's deadline
reached on a slow network, an outage. Nothing else looks at such a run again but the
stalled-run sweep, which wakes it, so its first pass (a view built from a run that has
recorded no step) repeats the second half before it replays anything. The chaos harness's
full profile with partitions found the child's case: a cancelled parent's child, created
by a pass that stopped before its read, ran a step eleven seconds after the cancel.
"""

from __future__ import annotations

from pikku_celery.engine.forks import copy_missing
from pikku_celery.engine.protocols import RunEnds
from pikku_celery.store.base import RunRead, WorkflowStore


def finish_creation(store: WorkflowStore, runs: RunEnds, read: RunRead, now_ms: int) -> RunRead:
    """``read`` (a whole run and its steps) as the first pass must see it: a fork's steps
    copied, a child of a cancelled parent cancelled; read again when either was done."""
    run = read.run
    if run is None or read.steps or run.is_terminal:
        return read
    if run.forked_from is not None and copy_missing(store, run, now_ms):
        return RunRead(run, store.read_run(run.run_id, run=False, all_steps=True).steps)
    if run.parent_run_id is not None and runs.cancel_if_parent_cancelled(run.run_id,
                                                                          run.parent_run_id):
        return store.read_run(run.run_id, all_steps=True)
    return read
