"""What follows the reopening of an ended run's steps (``store.retry_run``, or the admission
of a run a retry queued, ``store.admit_run``): each reopened step of a function is sent
again, after its stale Redis lease is freed.

A step settled for good keeps its Redis lease until it lapses (a command saved per step,
``claims``): the claim of a reopened step would find it held and wait out the lease. It is
freed by its own holder and token; a body still running under it (fenced by a cancel) is
told at its next renewal, and its writes are refused as ever. A step parked on a child run
sends nothing: the child, retried first, tells it how it ended; a sleep or a timed wait
has its timer armed again."""

from __future__ import annotations

from collections.abc import Iterable

from pikku_celery.engine.protocols import Dispatcher
from pikku_celery.leases.base import LeaseService
from pikku_celery.model import keys
from pikku_celery.model.records import StepState
from pikku_celery.model.views import timer_due_ms
from pikku_celery.store.base import WorkflowStore


def send_reopened(leases: LeaseService, dispatcher: Dispatcher, run_id: str,
                  reopened: Iterable[StepState]) -> None:
    for state in reopened:
        if state.child_run_id is not None:
            continue
        if state.function is None:
            # A sleep, or a wait with a deadline, waits again until its own time: its timer
            # was spent (or fired on the ended run), so it is armed again; without it only
            # a reaper sweep would end the wait (none at all for an inline run).
            if (due_ms := timer_due_ms(state)) is not None:
                dispatcher.arm_timer(run_id, state.step_name, due_ms)
            continue
        current = leases.get(keys.step_lease_key(run_id, state.step_name))
        if current is not None:
            leases.release(current)
        dispatcher.dispatch_step(state.function, run_id, state.step_name)


def finish_reopen(store: WorkflowStore, leases: LeaseService, dispatcher: Dispatcher,
                  run_id: str, now_ms: int) -> None:
    """What a retry still owes a run a pass found live with its reopen owed (the retry
    between its two writes, or cut short there): replaying now would take a failed step
    for the run's outcome and end the run again. The steps are reopened and sent (guarded
    per step: a retry's caller doing the same meanwhile reopens each once); the owed mark
    is gone after it, here or by whoever finished first, so the pass's full read that
    follows does not come back here."""
    owed = store.resume_retry(run_id, now_ms)
    if owed:
        send_reopened(leases, dispatcher, run_id, owed)
