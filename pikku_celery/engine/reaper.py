"""The reaper: finds work that nothing will resume by itself, and resumes it.

Steps whose lease lapsed (their worker died), ``pending`` steps nobody picked up (their
message died in a killed worker's prefetch), due sleeps and retries, stalled runs (a lost
wake-up), child runs whose parent was never told, events whose sender stopped before it
woke their run, and concurrency slots a crash left held or free (``concurrency``). Safe
from any number of processes at once: re-dispatching a step only asks for a claim, and the
claim is the guarded write that decides; waking a run only asks for a pass, and the run
lease admits one at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from pikku_celery.engine.concurrency import Admission
from pikku_celery.engine.events import wake_lost_sends
from pikku_celery.engine.protocols import Dispatcher, Emit, RunEnds, Settings, no_emit
from pikku_celery.leases.base import LeaseService
from pikku_celery.model.records import (
    RUN_RUNNING,
    RUN_SUSPENDED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepState,
)
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.definitions import Registry
from pikku_celery.workflow.replay import APPROVAL_PREFIX, CHILD_PREFIX, EVENT_PREFIX, SUSPEND_PREFIX

log = logging.getLogger("pikku_celery")
_MEMORY = 10_000  # redispatch memory entries before it is cleared


class Reaper:
    """One engine's sweeps; a child run that ended unheard is reported through ``runs``
    (the lifecycle, ``runs.Runs``). Its clock is the lease service's. Reports through
    ``emit``: ``step_lease_expired`` for each lapsed attempt it re-sends, ``reaper_recovered``
    (``kind``, ``count``) after each sweep for each kind it resumed, ``service_error``
    (``where="reaper"``, ``exception``) for a sweep that raised."""

    def __init__(self, store: WorkflowStore, leases: LeaseService, registry: Registry,
                 settings: Settings, runs: RunEnds, emit: Emit = no_emit) -> None:
        self.emit = emit
        self.store = store
        self.leases = leases
        self.registry = registry
        self.settings = settings
        self.runs = runs
        # (kind, step, attempt) -> when this process last re-sent it: one re-send per window.
        self._sent: dict[tuple[str, str, int], int] = {}
        # Where the next sweep's page starts, per kind: (sort key ms, invocation id).
        self._cursor: dict[str, tuple[int, str]] = {}
        self._unknown: set[str] = set()

    def sweep(self, dispatcher: Dispatcher) -> dict[str, int]:
        counts: dict[str, int] = {}
        children = {"children": 0}  # reported, not returned (the sweep's result stays)
        try:
            self._sweep(dispatcher, counts, children)
        except Exception as exc:
            self.emit("service_error", "reaper", where="reaper", exception=exc)
            raise
        finally:
            for kind, count in {**counts, **children}.items():
                if count:
                    self.emit("reaper_recovered", "reaper", kind=kind, count=count)
        return counts

    def _sweep(self, dispatcher: Dispatcher, counts: dict[str, int],
               children: dict[str, int]) -> None:
        store, s = self.store, self.settings
        now = self.leases.now_ms()
        admission = Admission(store, self.registry.concurrency_of, self.leases.now_ms,
                              leases=self.leases)
        counts["events"] = wake_lost_sends(store, dispatcher, now, s.sweep_limit)
        counts["slots"] = admission.sweep(dispatcher, s.sweep_limit)
        counts.update(lapsed=0, due=0, stalled=0)
        lapsed = store.find_lapsed_steps(now, s.sweep_limit,
                                                after=self._cursor.get("lapsed"))
        self._advance("lapsed", lapsed, lambda step: step.lease_expires_at)
        for step in lapsed:
            if step.function and self._first_in("lapsed", step, now, s.step_lease_ms):
                self._dispatch(step, dispatcher)
                counts["lapsed"] += 1
                self.emit("step_lease_expired", step.function, run_id=step.run_id,
                          step_name=step.step_name, attempt=step.attempt,
                          function=step.function)
        due = store.find_due_steps(now, now - s.undispatched_after_ms, s.sweep_limit,
                                          after=self._cursor.get("due"))
        # The store's order (``due_sweep_key``): pending steps by dispatch, others by due time.
        self._advance("due", due, lambda step: step.updated_at if step.status == STEP_PENDING
                      or step.due_at is None else step.due_at)
        for step in due:
            if not self._first_in("due", step, now, s.undispatched_after_ms):
                continue
            counts["due"] += 1
            if step.status == STEP_SUCCEEDED and step.due_at is not None:
                self._finish_opening(step, now, dispatcher)
            elif step.function is None or step.function.startswith(CHILD_PREFIX):
                dispatcher.wake_run(step.run_id, step_name=step.step_name)
            else:
                self._dispatch(step, dispatcher)
        stalled = store.find_stalled_runs(now - s.stalled_after_ms, s.sweep_limit)
        if not stalled:
            return
        # Three commands however many runs wait (a backlog of waiting runs is checked
        # again every ``stalled_after``): touched either way, so the sweep rotates through
        # idle runs instead of re-checking the same ``sweep_limit`` ones forever.
        run_ids = [run.run_id for run in stalled]
        store.touch_runs(run_ids, now)
        unsettled: dict[str, list[StepState]] = {run_id: [] for run_id in run_ids}
        for step in store.find_unsettled_steps(run_ids):
            unsettled[step.run_id].append(step)
        for run_id, steps in unsettled.items():
            live_children = self._recover_children(steps, dispatcher, children)
            if not any(self._in_flight(step, now, live_children) for step in steps):
                dispatcher.wake_run(run_id)  # its wake-up message was lost
                counts["stalled"] += 1

    def _finish_opening(self, gate: StepState, now: int, dispatcher: Dispatcher) -> None:
        """A gate opened (a decision, an expiry, a resume) whose wake check is due: its
        opener may have died before moving the run, so move it (only a ``suspended`` run
        moves: one that went on and stopped at a later gate passes it again and suspends
        there), wake it, and end the check."""
        store = self.store
        waiting_elsewhere = any(
            step.function is None and step.status == STEP_SCHEDULED
            and step.step_name.startswith((APPROVAL_PREFIX, SUSPEND_PREFIX, EVENT_PREFIX))
            for step in store.find_unsettled_steps([gate.run_id]))
        if not waiting_elsewhere:  # suspended behind another gate: it stays
            if store.transition_run(gate.run_id, [RUN_SUSPENDED], RUN_RUNNING, now):
                log.warning("pikku: run %s was left suspended behind its opened gate %r "
                            "(its opener stopped before it moved the run): moved and woken",
                            gate.run_id, gate.step_name)
            dispatcher.wake_run(gate.run_id, step_name=gate.step_name)
        assert gate.due_at is not None
        store.clear_wake_check(gate.run_id, gate.step_name,
                               round(gate.due_at.timestamp() * 1000))

    def _recover_children(self, steps: list[StepState], dispatcher: Dispatcher,
                          counts: dict[str, int]) -> set[str]:
        """Report children that ended while the parent was not told (a crash between the two
        writes); the parent's step settles once, whoever gets there first. Returns the
        names of steps whose child run is alive: only those wait on something.

        A step parked on a child run that does not exist (its creation failed after the
        step was recorded) waits on nothing; the caller wakes the parent, whose pass
        creates the child again."""
        live: set[str] = set()
        for step in steps:
            if step.status == STEP_RUNNING and step.child_run_id is not None:
                child = self.store.get_run(step.child_run_id)
                if child is None:
                    continue
                if child.is_terminal:
                    self.runs.notify_parent(child.run_id, dispatcher)
                    counts["children"] += 1
                else:
                    live.add(step.step_name)
        return live

    def _in_flight(self, step: StepState, now_ms: int, live_children: set[str]) -> bool:
        """Something will wake the run by itself: a live step, a live child run, a timer not
        yet due, or a dispatch too recent to call lost."""
        if step.status == STEP_RUNNING:
            if step.child_run_id is not None:
                return step.step_name in live_children
            lease = step.lease_expires_at
            return lease is None or lease.timestamp() * 1000 >= now_ms
        if step.status == STEP_PENDING:
            recent_ms = now_ms - self.settings.undispatched_after_ms
            return step.updated_at.timestamp() * 1000 >= recent_ms
        if step.due_at is not None:
            return step.due_at.timestamp() * 1000 > now_ms
        return False

    def _advance(self, kind: str, page: list[StepState],
                 key: Callable[[StepState], datetime | None]) -> None:
        """Page through the sweep's matches across sweeps: a full page means more may
        follow, so the next sweep starts after its last step; a short one wraps around.
        Oldest-first alone would leave steps nobody can claim (a task removed by a deploy)
        at the head of every page, and the steps behind them would never be seen."""
        if len(page) < self.settings.sweep_limit:
            self._cursor.pop(kind, None)
            return
        last = key(page[-1])
        assert last is not None
        self._cursor[kind] = (round(last.timestamp() * 1000), page[-1].invocation_id)

    def _dispatch(self, step: StepState, dispatcher: Dispatcher) -> None:
        function = step.function
        assert function is not None
        if function not in self.registry.steps and function not in self._unknown:
            self._unknown.add(function)  # once per task per process, not once per sweep
            log.error("pikku reaper: step %r of run %s needs task %r, which this worker "
                      "does not register (removed by a deploy?); it stays unclaimed until "
                      "a worker that registers %r runs", step.step_name, step.run_id,
                      function, function)
        dispatcher.dispatch_step(function, step.run_id, step.step_name)

    def _first_in(self, kind: str, step: StepState, now_ms: int, window_ms: int) -> bool:
        key = (kind, f"{step.run_id}:{step.step_name}", step.attempt)
        last = self._sent.get(key)
        if last is not None and now_ms - last < window_ms:
            return False
        if len(self._sent) > _MEMORY:
            self._sent.clear()
        self._sent[key] = now_ms
        return True
