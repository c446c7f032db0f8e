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
from collections.abc import Mapping
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Any

from pikku_celery.engine._guard import guarded as _guarded
from pikku_celery.engine.claims import serialize_error
from pikku_celery.engine.first_pass import finish_creation
from pikku_celery.engine.handover import adopt, note_of, whole_view
from pikku_celery.engine.in_place import InPlace
from pikku_celery.engine.pass_events import EventWrites
from pikku_celery.engine.protocols import (
    ContinuationRefused,
    Dispatcher,
    Emit,
    RunEnds,
    Settings,
    StepRunner,
    no_emit,
)
from pikku_celery.leases.base import Lease, LeaseBusy, LeaseService
from pikku_celery.leases.hold import hold_granted
from pikku_celery.leases.memory import WATCH_SLACK_MS
from pikku_celery.model import keys
from pikku_celery.model.clock import Clock, epoch_ms
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    PikkuError,
    WorkflowCancelledError,
    WorkflowRunNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import (
    RUN_CANCELLED,
    RUN_COMPLETED,
    RUN_FAILED,
    RUN_QUEUED,
    RUN_RUNNING,
    RUN_SUSPENDED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SUCCEEDED,
    StepState,
)
from pikku_celery.model.validate import check_name
from pikku_celery.model.views import ALL, RunView, Views
from pikku_celery.store import _docs
from pikku_celery.store._concerns import deadline
from pikku_celery.store.base import NewClaim, NewStep, WorkflowStore
from pikku_celery.workflow.definitions import Registry, StepDefaults, StepDefinition
from pikku_celery.workflow.replay import PassInterrupted, Pause, WorkflowContext

log = logging.getLogger("pikku_celery")


class _Void(BaseException):
    """Ends a pass whose workflow went on from a result its settle did not record
    (``ContinuationRefused``): not an ``Exception``, so the workflow cannot swallow it."""


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
        # Set by the engine: what runs steps in place (``execution.StepExecution``; none:
        # every step is sent as a message), and where a pass reports (events taken).
        self.runner: StepRunner | None = None
        self.emit: Emit = no_emit

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def advance(self, run_id: str, dispatcher: Dispatcher, *, mark: str = ALL,
                settled: StepState | None = None) -> str:
        """Advance ``run_id`` until no mark is left: see the module docstring. ``mark`` names
        the step whose change brought this call (``ALL``: unknown); ``settled`` is that
        step's state as its settle wrote it, when the caller has it (no need to read it).

        Raises ``LeaseTakenError`` (having left the mark) when another pass holds the run,
        ``LeaseLostError`` when the lease was lost (whatever the pass wrote stands)."""
        check_name("run id", run_id)
        key = keys.run_lease_key(run_id)
        ttl_ms = self.settings.run_lease_ms
        view = self.views.take(run_id)
        requested = time.monotonic()
        got = self.leases.acquire_or_mark(key, uuid.uuid4().hex, ttl_ms, mark)
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
        in_place = self._in_place(dispatcher, ttl_ms)
        try:
            status, view = self._passes(run_id, got, view, marks, settled, dispatcher,
                                        in_place, requested)
        finally:
            if in_place is not None:
                in_place.close()
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
                    while held.hand_back():
                        pass
                    break
                taken = held.hand_back(note_of(view, got.token))
                if not taken:
                    break
                marks = set(taken)
        return status, view

    # --- one pass -----------------------------------------------------------------------

    def _in_place(self, dispatcher: Dispatcher, pass_ms: int) -> InPlace | None:
        """What this call's passes may run in place (``in_place.InPlace``), if anything."""
        settings = self.settings
        if (self.runner is None or not settings.continue_in_place
                or settings.in_place_steps <= 0
                or getattr(dispatcher, "runs_here", None) is None):
            return None
        return InPlace(self.runner, settings.in_place_steps, settings.in_place_ms, pass_ms)

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
        host = _PassHost(self, dispatcher, view, token, fresh, in_place)
        if ALL not in marks and view.skips(fresh):  # it would pause at the same gather
            return self._paused(view, host), view, None
        status = self._replay(view, host, dispatcher)
        if status in (RUN_COMPLETED, RUN_FAILED, RUN_CANCELLED):
            return status, None, None
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

    def _replay(self, view: RunView, host: _PassHost, dispatcher: Dispatcher) -> str:
        try:
            return self._run_workflow(view, host, dispatcher)
        except _Void:
            return "waiting"  # nothing since the refused settle was written: replay anew

    def _run_workflow(self, view: RunView, host: _PassHost, dispatcher: Dispatcher) -> str:
        run = view.run
        fn = self.registry.workflow(run.workflow).fn
        view.waiting = set()
        wf = WorkflowContext(run.run_id, run.input, view.steps, host)
        try:
            output = fn(wf, run.input)
        except Pause:
            if (failed := host.flush_or_error()) is not None:
                return self._finish(view, RUN_FAILED, dispatcher, error=failed)
            return self._paused(view, host)
        except PassInterrupted as interrupted:
            raise interrupted.__cause__ or RuntimeError("pass interrupted") from None
        except WorkflowCancelledError as exc:
            host.flush_or_error()
            return self._finish(view, RUN_CANCELLED, dispatcher, error=serialize_error(exc),
                                reason=exc.reason)
        except Exception as exc:
            log.info("pikku: run %s of %s failed: %s", run.run_id, run.workflow, exc)
            host.flush_or_error()
            return self._finish(view, RUN_FAILED, dispatcher, error=serialize_error(exc))
        if (failed := host.flush_or_error()) is not None:
            return self._finish(view, RUN_FAILED, dispatcher, error=failed)
        try:
            return self._finish(view, RUN_COMPLETED, dispatcher, output=output)
        except InvalidInputError as exc:
            return self._finish(view, RUN_FAILED, dispatcher, error=serialize_error(exc))

    def _paused(self, view: RunView, host: _PassHost) -> str:
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

    def _finish(self, view: RunView, status: str, dispatcher: Dispatcher, *,
                output: Any = None, error: dict[str, Any] | None = None,
                reason: str | None = None) -> str:
        return self.runs.finish(view.run, status, output=output, error=error,
                                   dispatcher=dispatcher, reason=reason,
                                   leftovers=bool(view.unsettled))


class _PassHost(EventWrites):
    """The writes one pass makes (``ReplayHost``), bound to its dispatcher and view.

    Steps reached for the first time are recorded together: ``record_step`` returns the step
    as it will be stored, and ``flush`` inserts the batch in one command, then sends their
    messages. Every other write flushes first, since it may need them (a sleep settled at
    once, a child run, a suspension gate)."""

    _passes: Passes

    def __init__(self, passes: Passes, dispatcher: Dispatcher, view: RunView, token: int,
                 fresh: set[str], in_place: InPlace | None = None) -> None:
        self._passes = passes
        self._dispatcher = dispatcher
        self._view = view
        self._token = token
        self._fresh = fresh
        self._in_place = in_place
        self._pending: list[NewStep] = []
        # Marks to replay with at once: ``set()`` when the view lacked steps the store has,
        # ``{ALL}`` when a step run in place lost its attempt. ``void``: the workflow went
        # on with a result its settle did not record (``_settle_pending``).
        self.again: set[str] | None = None
        self.void = False

    def now_ms(self) -> int:
        return _guarded(self._passes.now_ms)

    # --- recording ----------------------------------------------------------------------

    def record_step(self, step: NewStep) -> StepState:
        state = _docs.step_from_doc(_docs.new_step_doc(step, self.now_ms(), self._token))
        self._pending.append(step)
        self._view.put(state)
        return state

    def flush(self) -> None:
        """Insert what the pass recorded (one command) and send its messages, after the
        settle of the last step run in place, if still pending: every write of a pass
        comes after it, since the workflow reached them with its result."""
        self._settle_pending()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        recorded = _guarded(lambda: self._passes.store.insert_steps(
            batch, self.now_ms(), seq=self._token))
        sending: list[NewStep] = []
        for step, (state, created) in zip(batch, recorded, strict=True):
            if created:
                sending.append(step)
                continue
            self._view.put(state)  # recorded before, by a pass whose view we lack
            self._fresh.add(state.step_name)
            self._replay_again()
        together = getattr(self._dispatcher, "batch", None)  # a fan-out: one producer
        with together() if together is not None and len(sending) > 1 else nullcontext():
            for step in sending:
                self._send(step)

    def flush_or_error(self) -> dict[str, Any] | None:
        """``flush``; the error that fails the run when a recorded step can never be
        stored (``InvalidInputError``), else ``None``. Other errors interrupt the pass."""
        try:
            self.flush()
        except PassInterrupted as interrupted:
            raise interrupted.__cause__ or RuntimeError("pass interrupted") from None
        except PikkuError as exc:
            return serialize_error(exc)
        return None

    def _send(self, step: NewStep) -> None:
        if step.child_run_id is not None or (step.function is None and step.due_ms is None):
            return  # parked on a child run, or a gate: nothing to send
        if step.function is None:
            due_ms = step.due_ms
            assert due_ms is not None
            _guarded(lambda: self._dispatcher.arm_timer(step.run_id, step.step_name, due_ms))
            return
        function = step.function
        _guarded(lambda: self._dispatcher.dispatch_step(function, step.run_id, step.step_name))

    def _settle_pending(self) -> None:
        in_place = self._in_place
        if in_place is None or in_place.pending is None:
            return
        try:
            in_place.settle()
        except ContinuationRefused:
            self._void()
            raise _Void() from None
        except PikkuError:
            raise
        except Exception as exc:  # unwritten: the pass cannot go on past that step
            raise PassInterrupted() from exc

    def _void(self) -> None:
        self._pending = []
        self.void = True

    def _replay_again(self, *marks: str) -> None:
        self.again = (self.again or set()) | set(marks)

    # --- running in place -----------------------------------------------------------------

    def run_in_place(self, step_name: str) -> StepState | None:
        """Run the step this pass just recorded, here and now, and return it settled;
        ``None`` when it is sent as usual (the pass pauses on it). When it may
        (``InPlace.runnable``), its insert is its claim, no message is sent, and the
        workflow goes on from its result with no replay, under the same run lease; after
        ``in_place_steps`` steps or ``in_place_ms`` the next step is sent instead."""
        in_place = self._in_place
        if in_place is None or (chosen := in_place.runnable(
                self._pending, step_name, self._passes.registry, self._dispatcher)) is None:
            return None
        step, definition = chosen
        if in_place.lease_lost:  # the streak stops here: the pass ends, its caller wakes
            raise PassInterrupted() from LeaseLostError(keys.run_lease_key(step.run_id))
        self._pending = []
        try:
            ran = in_place.run(definition, step, self._token, self._dispatcher,
                               workflow=self._view.run.workflow)
        except InvalidInputError:
            self._pending = [step]  # the step cannot be stored: the flush fails the run
            return None
        except ContinuationRefused:  # the step before it: this one was reached in vain
            self._void()
            return None
        except WorkflowStepSupersededError:  # fenced by a cancel, or reclaimed: read it
            self._replay_again(ALL)
            return None
        except PikkuError:
            raise
        except Exception as exc:  # the step stays claimed; its lease lapses for the reaper
            raise PassInterrupted() from exc
        if ran is None:  # its step lease is held: record and send it as usual
            self._pending = [step]
            return None
        if isinstance(ran, NewClaim):
            if ran.state is not None:  # recorded before, by a pass whose view we lack
                self._view.put(ran.state)
                self._fresh.add(step_name)
            elif ran.run_status is not None:  # the run ended first: the replay finishes it
                self._view.run = dataclasses.replace(self._view.run, status=ran.run_status)
            self._replay_again()
            return None
        in_place.done()
        self._view.put(ran)
        self._fresh.add(step_name)
        return ran

    # --- the other writes ----------------------------------------------------------------

    def suspend_run(self, run_id: str, gate: str) -> bool:
        """Record the run suspended behind ``gate``; ``False`` if the gate turned out open.

        A resume can land between this pass's read of the gate and this write. The write
        cannot check another document, so the gate is read again after it: ``resume``
        opens gates before it moves the run, so if it moved the run first, the gate is open
        by now and the run is taken back to ``running`` here."""
        self.flush()
        store = self._passes.store
        _guarded(lambda: store.transition_run(run_id, [RUN_RUNNING], RUN_SUSPENDED,
                                              self.now_ms()))
        self._view.run = dataclasses.replace(self._view.run, status=RUN_SUSPENDED)
        state = _guarded(lambda: store.get_step(run_id, gate))
        if state is not None:
            self._view.put(state)
            self._fresh.add(gate)
        if state is None or state.status != STEP_SUCCEEDED:
            return True
        _guarded(lambda: store.transition_run(run_id, [RUN_SUSPENDED], RUN_RUNNING,
                                              self.now_ms()))
        self._view.run = dataclasses.replace(self._view.run, status=RUN_RUNNING)
        return False

    def expire_gate(self, run_id: str, gate: str, result: Any) -> bool:
        """An approval's expiry passed: settle it with ``result`` (guarded on the step
        still waiting and due, so a decision recorded first wins), then take the run back
        from ``suspended``. ``False``: it no longer waits (the caller suspends, re-reading
        the gate there)."""
        self.flush()
        store = self._passes.store
        now = self.now_ms()
        check = self._passes.settings.wake_check_ms(now)
        if not _guarded(lambda: store.settle_waiting_step(run_id, gate, now, result=result,
                                                          wake_check_ms=check)):
            return False
        # The view's status may be stale (it is read on ALL marks only): the guarded
        # write decides, and moves only a suspended run.
        _guarded(lambda: store.transition_run(run_id, [RUN_SUSPENDED], RUN_RUNNING, now))
        if self._view.run.status == RUN_SUSPENDED:
            self._view.run = dataclasses.replace(self._view.run, status=RUN_RUNNING)
        # This pass goes on past the gate: the reaper has nothing to finish.
        _guarded(lambda: store.clear_wake_check(run_id, gate, check))
        self._view.put(dataclasses.replace(
            self._view.steps[gate], status=STEP_SUCCEEDED, result=result, error=None,
            due_at=None, lease_expires_at=None,
            updated_at=datetime.fromtimestamp(now / 1000, tz=timezone.utc)))
        return True

    def note_waiting(self, step_names: set[str]) -> None:
        self._view.waiting = step_names

    def should_redispatch(self, state: StepState) -> bool:
        """A step read just now whose worker died (lease lapsed) or whose message was lost
        (``pending`` too long): send it again, the claim decides. A state the view kept
        from an earlier pass may be out of date, so only fresh ones are judged (the reaper
        finds the rest)."""
        if state.step_name not in self._fresh:
            return False
        now = self.now_ms()
        if state.status == STEP_RUNNING and state.lease_expires_at is not None:
            return epoch_ms(state.lease_expires_at) < now
        if state.status == STEP_PENDING:
            return now - epoch_ms(state.updated_at) > self._passes.settings.undispatched_after_ms
        return False

    def run_state(self) -> tuple[Mapping[str, Any], tuple[str, ...]]:
        run = self._view.run
        return run.state, run.state_writers

    def write_state(self, run_id: str, writer: str, values: Mapping[str, Any]) -> None:
        """One guarded write at the version this pass knows. The view's run is current
        under the lease (a pass of another process makes the next one re-read it), so a
        refused write means a write whose reply was lost, or a lease lost meanwhile: read
        the run to tell which."""
        self._settle_pending()
        store = self._passes.store
        run = self._view.run
        written = _guarded(lambda: store.write_run_state(run_id, writer, values,
                                                         run.state_version, self.now_ms()))
        if written is None:
            written = _guarded(lambda: store.get_run(run_id))
            if written is None or writer not in written.state_writers:
                # Another pass wrote the state meanwhile: this one lost the run lease.
                raise PassInterrupted() from LeaseLostError(keys.run_lease_key(run_id))
        self._view.run = dataclasses.replace(
            run, state=written.state, state_version=written.state_version,
            state_writers=written.state_writers)

    def redispatch(self, state: StepState) -> None:
        self._settle_pending()
        function = state.function
        if function is not None:
            _guarded(lambda: self._dispatcher.dispatch_step(function, state.run_id,
                                                            state.step_name))

    def settle_sleep(self, run_id: str, step_name: str) -> bool:
        self.flush()
        now = self.now_ms()
        settled = _guarded(lambda: self._passes.store.settle_waiting_step(run_id, step_name,
                                                                          now))
        if settled:
            self._view.put(dataclasses.replace(
                self._view.steps[step_name], status=STEP_SUCCEEDED, result=None, error=None,
                due_at=None, lease_expires_at=None,
                updated_at=datetime.fromtimestamp(now / 1000, tz=timezone.utc)))
        return settled

    def ensure_child(self, parent_run_id: str, step_name: str, workflow: str, data: Any,
                     child_run_id: str) -> None:
        self.flush()
        _guarded(lambda: self._passes.runs.ensure_child(parent_run_id, step_name, workflow, data,
                                                   child_run_id, self._dispatcher))

    def step_defaults(self) -> StepDefaults:
        return self._passes.settings.step_defaults

    def step_definition(self, step: Any) -> StepDefinition:
        return self._passes.registry.step(step)
