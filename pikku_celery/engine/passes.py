"""Orchestration passes: advance a run by replay under its run lease, reading only what
changed since this process last saw it (see ``pikku_celery.model.views``).

One call of ``Passes.advance``, in order:

1. Take the run lease, or leave a mark on it (``acquire_or_mark``): a caller that finds the
   run being advanced does not wait and sends no message; the holder sees the mark.
2. Bring the process's view of the run up to date: one read of what the marks name (and of
   the run and its unsettled steps when a mark says ``ALL`` or another process advanced
   the run meanwhile), or of the whole run when there is no view.
3. Replay the workflow over the view. Steps reached for the first time are recorded in one
   ``insert_steps`` when the pass stops (or before any other write that needs them), then
   dispatched.
4. Hand the lease back: when marks were left meanwhile, take them and go to 2 instead of
   releasing. Release and take are one atomic step, so a mark left after the last look is
   never missed: the next grant carries it.

A pass that ends well puts its view back for the next one. No Celery here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

from pikku_celery.engine.busy_runs import BusyRuns
from pikku_celery.engine.claims import serialize_error
from pikku_celery.engine.first_pass import finish_creation
from pikku_celery.engine.gates import rearm_early_wakes
from pikku_celery.engine.handover import adopt, note_of, whole_view
from pikku_celery.engine.in_place import InPlace
from pikku_celery.engine.pass_host import PassHost, _Void
from pikku_celery.engine.protocols import (
    Dispatcher,
    Emit,
    PendingSettle,
    RunEnds,
    Settings,
    StepRunner,
    no_emit,
)
from pikku_celery.engine.reopen import finish_reopen
from pikku_celery.leases.base import Lease, LeaseBusy, LeaseService
from pikku_celery.leases.hold import hold_granted
from pikku_celery.leases.memory import WATCH_SLACK_MS
from pikku_celery.model import keys
from pikku_celery.model.clock import Clock, epoch_ms
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseTakenError,
    WorkflowCancelledError,
    WorkflowRunNotFoundError,
)
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_COMPLETED,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    STEP_RUNNING,
    StepState,
)
from pikku_celery.model.validate import check_name
from pikku_celery.model.views import ALL, RunView, Views
from pikku_celery.store._concerns import deadline
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.definitions import Registry
from pikku_celery.workflow.replay import PassInterrupted, Pause, WorkflowContext

log = logging.getLogger("pikku_celery")


class Passes:
    """The passes of one engine, and the views of the runs they advanced. A run that ends
    is finished through ``runs`` (the lifecycle, ``runs.Runs``); ``clock`` is the engine's
    (it sets it again when it is replaced)."""

    def __init__(self, store: WorkflowStore, leases: LeaseService, registry: Registry,
                 settings: Settings, clock: Clock, runs: RunEnds) -> None:
        self.store = store
        self.leases = leases
        self.registry = registry
        self.settings = settings
        self.clock = clock
        self.runs = runs
        self.views = Views()
        self.busy = BusyRuns()  # runs another pass held a moment ago (``_take``)
        # Set by the engine: what runs steps in place (``execution.StepExecution``; none:
        # every step is sent as a message), and where a pass reports (events taken).
        self.runner: StepRunner | None = None
        self.emit: Emit = no_emit

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def advance(self, run_id: str, dispatcher: Dispatcher, *, mark: str = ALL,
                settled: StepState | None = None,
                pending: PendingSettle | None = None) -> str:
        """Advance ``run_id`` until no mark is left: see the module docstring. ``mark`` names
        the step whose change brought this call (``ALL``: unknown); ``settled`` is that
        step's state as its settle wrote it, when the caller has it (no need to read it).
        ``pending``: that settle, not written yet; the pass writes it with its first write
        (as a step run in place hands its settle on), or alone first when another pass
        holds the run (whose read of the step must find it settled).

        Raises ``LeaseTakenError`` (having left the mark) when another pass holds the run,
        ``LeaseLostError`` when the lease was lost (whatever the pass wrote stands)."""
        check_name("run id", run_id)
        key = keys.run_lease_key(run_id)
        ttl_ms = self.settings.run_lease_ms
        view = self.views.take(run_id)
        requested = time.monotonic()
        try:
            got, pending = self._take(run_id, key, ttl_ms, mark, pending)
        except BaseException:
            if view is not None:  # untouched: still what this process last saw
                self.views.put(view)
            raise
        if isinstance(got, LeaseBusy):
            if view is not None:
                if settled is not None:
                    view.put(settled)  # what the settle wrote is true whoever passes next
                self.views.put(view)
            if got.watch:
                # Should the holder die with the mark untaken, look again once its lease has
                # lapsed: one message per lease grant, however many marks are left.
                dispatcher.wake_run(run_id, countdown_s=(got.remaining_ms + WATCH_SLACK_MS)
                                    / 1000)
            raise LeaseTakenError(key)
        if view is not None and got.token <= view.token:
            view = None  # the token went backwards: Redis lost its counters, trust nothing
        elif view is not None:
            view.begin()
            adopt(view, got.note, got.token)  # the last holder's note, if it fits (handover)
        elif got.note is not None:
            view = whole_view(self.store, run_id, got.note, got.token)
        marks = set(got.marks) | {mark}
        in_place = self._in_place(dispatcher, ttl_ms, pending)
        try:
            status, view = self._passes(run_id, got, view, marks, settled, dispatcher,
                                        in_place, requested)
        finally:
            if in_place is not None:
                in_place.close()  # a pass that ended well wrote it before its hand-back
        if view is not None:
            self.views.put(view)
        return status

    def _passes(self, run_id: str, got: Lease, view: RunView | None, marks: set[str],
                settled: StepState | None, dispatcher: Dispatcher, in_place: InPlace | None,
                requested: float) -> tuple[str, RunView | None]:
        """Pass until no mark is left (``advance``), holding the lease ``got``."""
        ttl_ms = self.settings.run_lease_ms
        with hold_granted(self.leases, got, ttl_ms, requested) as held:
            if in_place is not None:
                in_place.lease = held
            while True:
                # Every MongoDB call of a pass ends within the run lease: the lease is
                # renewed while the pass runs, so a call stuck on a primary that stopped
                # answering (paused, or cut off without a reset) would hold the run from
                # every other pass until pymongo gives the node up. (Not a step run in
                # place: it has its own deadlines, ``InPlace``.)
                with deadline(ttl_ms / 1000):
                    status, view, again = self._once(run_id, got.token, view, marks,
                                                     settled, dispatcher, in_place)
                settled = None
                if again is not None:  # the view lacked what the store has: replay
                    marks = again
                    continue
                if view is None:  # the run has ended: marks left now change nothing
                    # Those waiting for its end hear it in the same call (``Reads.wait``).
                    while held.hand_back(announce=True):
                        pass
                    break
                if in_place is not None and not in_place.close():
                    # The settle a step handed on, still pending (the pass wrote nothing
                    # after it), was refused or not written: the view went on from a
                    # result the store does not hold. No note may carry it: replay from
                    # the store first, under the same grant.
                    view, marks = None, {ALL}
                    continue
                note, cumulative = note_of(view, got.token)
                if not cumulative:  # too large: the next notes start from this pass's
                    view.restart_note()
                taken = held.hand_back(note)
                if not taken:
                    break
                marks = set(taken)
        return status, view

    # --- one pass -----------------------------------------------------------------------

    def _take(self, run_id: str, key: str, ttl_ms: int, mark: str,
              pending: PendingSettle | None) -> tuple[Lease | LeaseBusy, PendingSettle | None]:
        """The run lease, or the mark left on it, and the settle still to write. With a
        settle handed on (``pending``) and the run held elsewhere, the mark just left may
        be read before the settle lands: the settle is written alone
        (``ContinuationRefused`` goes to the caller), then the mark left again. When this
        process found the run held a moment ago (a gather's calls settling in turn,
        ``busy_runs``), the settle goes first and the mark once."""
        if pending is not None and self.busy.likely_held(run_id):
            assert self.runner is not None  # whoever handed a settle on runs steps
            self.runner.finish_settle(pending)
            pending = None
        got = self.leases.acquire_or_mark(key, uuid.uuid4().hex, ttl_ms, mark)
        if not isinstance(got, LeaseBusy):
            self.busy.found_free(run_id)
            return got, pending
        self.busy.found_held(run_id)
        if pending is None:
            return got, pending
        assert self.runner is not None
        self.runner.finish_settle(pending)
        again = self.leases.acquire_or_mark(key, uuid.uuid4().hex, ttl_ms, mark)
        if isinstance(again, LeaseBusy) and got.watch and not again.watch:
            again = dataclasses.replace(again, watch=True)  # the first mark's duty stays
        return again, None

    def _in_place(self, dispatcher: Dispatcher, pass_ms: int,
                  pending: PendingSettle | None = None) -> InPlace | None:
        """What this call's passes may run in place (``in_place.InPlace``), if anything,
        holding ``pending`` (a settle handed on) if there is one."""
        settings = self.settings
        in_place = None
        if (self.runner is not None and settings.continue_in_place
                and settings.in_place_steps > 0
                and getattr(dispatcher, "runs_here", None) is not None):
            in_place = InPlace(self.runner, settings.in_place_steps, settings.in_place_ms,
                               pass_ms)
        if pending is not None:
            assert self.runner is not None  # whoever handed a settle on runs steps
            in_place = in_place or InPlace(self.runner, 0, 0, pass_ms)  # runs none
            in_place.pending = pending
        return in_place

    def _once(self, run_id: str, token: int, view: RunView | None, marks: set[str],
              settled: StepState | None, dispatcher: Dispatcher, in_place: InPlace | None
              ) -> tuple[str, RunView | None, set[str] | None]:
        """One pass: returns the status, the view to keep (``None`` once the run has
        ended), and the marks to replay again with at once (``None``: no need)."""
        view, fresh = self._load(run_id, token, view, marks, settled)
        if view.run.is_terminal:
            self._ended(view, dispatcher)
            return view.run.status, None, None
        if view.run.status == RUN_QUEUED:  # waits for a slot: its admission wakes it
            return RUN_QUEUED, None, None
        if view.run.reopen_owed and view.run.status == RUN_RUNNING:  # a retry unfinished
            finish_reopen(self.store, self.leases, dispatcher, run_id, self.clock.now_ms())
            return view.run.status, None, {ALL}  # then read it all
        host = PassHost(self, dispatcher, view, token, fresh, in_place)
        skip = ALL not in marks and view.skips(fresh)  # it would pause at the same gather
        status = self._paused(view, host) if skip else self._replay(view, host, dispatcher)
        if status in (RUN_COMPLETED, RUN_FAILED, RUN_CANCELLED):
            return status, None, None
        rearm_early_wakes(view, marks, dispatcher, host.now_ms())  # a timer fired early
        if host.void:  # it went on from a result that was not recorded: read it all again
            return status, None, {ALL}
        return status, view, host.again

    def _load(self, run_id: str, token: int, view: RunView | None, marks: set[str],
              settled: StepState | None) -> tuple[RunView, set[str]]:
        """The view brought up to date for this pass, and the names of the steps read (or
        written by their settle) just now."""
        store = self.store
        if view is None:
            read = store.read_run(run_id, all_steps=True)
            if read.run is None:
                raise WorkflowRunNotFoundError(run_id)
            # What its creator may have left half-done (a fork's copy, a child's check).
            read = finish_creation(store, self.runs, read, self.clock.now_ms())
            assert read.run is not None
            view = RunView(read.run, {}, token, epoch_ms(read.run.updated_at))
            for state in read.steps:
                view.put(state)
            read_now = view.steps.get(settled.step_name) if settled is not None else None
            if (settled is not None and read_now is not None
                    and read_now.status == STEP_RUNNING and read_now.attempt == settled.attempt):
                view.put(settled)  # a settle handed to this pass: written with its first write
            return view, set(view.steps)
        fresh: set[str] = set()
        if settled is not None:
            view.put(settled)
            fresh.add(settled.step_name)
        current = token - 1 <= view.token <= token
        everything = ALL in marks or not current
        names = {m for m in marks if m != ALL} - fresh
        if everything:
            names |= view.unsettled
        read = store.read_run(run_id, run=everything or view.run_stale, input=False,
                              step_names=names, recorded_after=None if current else view.token)
        if everything or view.run_stale:
            view.run_stale = False
            if read.run is None:
                raise WorkflowRunNotFoundError(run_id)
            view.run = dataclasses.replace(read.run, input=view.run.input)
            view.touched_ms = epoch_ms(read.run.updated_at)
        for state in read.steps:
            view.put(state)
            fresh.add(state.step_name)
        view.token = token
        return view, fresh

    def _ended(self, view: RunView, dispatcher: Dispatcher) -> None:
        """A pass found the run ended. A child makes sure its parent heard (idempotent: the
        parent's step settles once). Steps it left unsettled are fenced again: a pass that
        held the lease while a cancel landed may have recorded steps after the cancel's
        fence, and the writer that completed or failed the run may have stopped between
        that write and its fence."""
        runs = self.runs
        run = view.run
        if run.status == RUN_CANCELLED and view.unsettled:
            runs.cancel(run.run_id, None)
        elif view.unsettled:
            runs.fence_leftovers(run.run_id, run.status)
        if run.parent_run_id is not None:
            runs.notify_parent(run.run_id, dispatcher)

    def _replay(self, view: RunView, host: PassHost, dispatcher: Dispatcher) -> str:
        try:
            return self._run_workflow(view, host, dispatcher)
        except _Void:
            return "waiting"  # nothing since the refused settle was written: replay anew

    def _run_workflow(self, view: RunView, host: PassHost, dispatcher: Dispatcher) -> str:
        run = view.run
        fn = self.registry.workflow(run.workflow).fn
        view.waiting = set()
        wf = WorkflowContext(run.run_id, run.input, view.steps, host)
        try:
            output = fn(wf, run.input)
        except Pause:
            if (failed := host.flush_or_error()) is not None:
                return self._finish(view, host, RUN_FAILED, dispatcher, error=failed)
            return self._paused(view, host)
        except PassInterrupted as interrupted:
            raise interrupted.__cause__ or RuntimeError("pass interrupted") from None
        except WorkflowCancelledError as exc:
            host.flush_or_error(ending=True)
            return self._finish(view, host, RUN_CANCELLED, dispatcher,
                                error=serialize_error(exc), reason=exc.reason)
        except Exception as exc:
            log.info("pikku: run %s of %s failed: %s", run.run_id, run.workflow, exc)
            host.flush_or_error(ending=True)
            return self._finish(view, host, RUN_FAILED, dispatcher, error=serialize_error(exc))
        if (failed := host.flush_or_error(ending=True)) is not None:
            return self._finish(view, host, RUN_FAILED, dispatcher, error=failed)
        try:
            return self._finish(view, host, RUN_COMPLETED, dispatcher, output=output)
        except InvalidInputError as exc:
            return self._finish(view, host, RUN_FAILED, dispatcher, error=serialize_error(exc))

    def _paused(self, view: RunView, host: PassHost) -> str:
        """The run waits on something. The stalled-run sweep looks at runs no pass touched
        for ``stalled_after``: touch the run when its last touch is half that old (one write
        every few seconds of activity, not one per pass). The touch reads the status too: a
        cancel found there fences what this pass recorded."""
        now = host.now_ms()
        if now - view.touched_ms < self.settings.stalled_after_ms // 2:
            return "waiting"
        status = self.store.touch_run(view.run.run_id, now)
        view.touched_ms = now
        if status == RUN_CANCELLED:
            self.runs.cancel(view.run.run_id, None)
            view.run = dataclasses.replace(view.run, status=RUN_CANCELLED)
        return "waiting"

    def _finish(self, view: RunView, host: PassHost, status: str, dispatcher: Dispatcher, *,
                output: Any = None, error: dict[str, Any] | None = None,
                reason: str | None = None) -> str:
        return self.runs.finish(view.run, status, output=output, error=error,
                                dispatcher=dispatcher, reason=reason,
                                leftovers=bool(view.unsettled), marked=host.end_marked)
