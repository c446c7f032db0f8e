"""The writes one pass makes (``PassHost``, the workflow's ``ReplayHost``): steps recorded
together and sent, steps run in place, the settle a step handed on written with the pass's
first write, and every other write of a replay. ``passes.Passes`` runs the passes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

from pikku_celery.engine._guard import guarded as _guarded
from pikku_celery.engine.claims import serialize_error
from pikku_celery.engine.in_place import InPlace
from pikku_celery.engine.pass_events import EventWrites
from pikku_celery.engine.protocols import ContinuationRefused, Dispatcher, Emit, RunEnds, Settings
from pikku_celery.engine.step_messages import send_recorded
from pikku_celery.model import keys
from pikku_celery.model.clock import epoch_ms
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    PikkuError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.records import (
    RUN_RUNNING,
    RUN_SUSPENDED,
    STEP_PENDING,
    STEP_RUNNING,
    STEP_SUCCEEDED,
    StepState,
)
from pikku_celery.model.views import ALL, RunView
from pikku_celery.store import _docs
from pikku_celery.store.base import NewClaim, NewStep, WorkflowStore
from pikku_celery.workflow.definitions import Registry, StepDefaults, StepDefinition
from pikku_celery.workflow.replay import PassInterrupted

T = TypeVar("T")


class _Void(BaseException):
    """Ends a pass whose workflow went on from a result its settle did not record
    (``ContinuationRefused``): not an ``Exception``, so the workflow cannot swallow it."""



class _Passes(Protocol):
    """What of ``passes.Passes`` a pass's writes use."""

    store: WorkflowStore
    settings: Settings
    emit: Emit
    registry: Registry
    runs: RunEnds

    def now_ms(self) -> int: ...


class PassHost(EventWrites):
    """The writes one pass makes (``ReplayHost``), bound to its dispatcher and view.

    Steps reached for the first time are recorded together: ``record_step`` returns the step
    as it will be stored, and ``flush`` inserts the batch in one command, then sends their
    messages. Every other write flushes first, since it may need them (a sleep settled at
    once, a child run, a suspension gate)."""

    _passes: _Passes

    def __init__(self, passes: _Passes, dispatcher: Dispatcher, view: RunView, token: int,
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
        # Whether ``flush(ending=True)`` wrote the run's end mark with its last settle: the
        # end is then written without one (``transition_run``'s ``marked``).
        self.end_marked = False

    def now_ms(self) -> int:
        return _guarded(self._passes.now_ms)

    # --- recording ----------------------------------------------------------------------

    def record_step(self, step: NewStep) -> StepState:
        state = _docs.step_from_doc(_docs.new_step_doc(step, self.now_ms(), self._token))
        self._pending.append(step)
        self._view.put(state)
        return state

    def flush(self, *, ending: bool = False) -> None:
        """Insert what the pass recorded (one command) and send its messages, after the
        settle of the last step run in place (or handed on by a delivered step), if still
        pending, in the same command: every write of a pass comes after it, since the
        workflow reached them with its result. ``ending``: the pass ends the run next; a
        settle still pending with nothing else to insert carries the end's mark
        (``end_marked``), the end's own first write, so ending a run after its last step
        costs one command fewer."""
        if not self._pending:
            if ending:
                self.end_marked = self._settle_with([], self.now_ms(),
                                                    end_mark=True) is not None
            else:
                self._settle_pending()
            return
        batch, self._pending = self._pending, []
        now_ms = self.now_ms()
        recorded = self._settle_with(batch, now_ms)
        if recorded is None:
            recorded = _guarded(lambda: self._passes.store.insert_steps(
                batch, now_ms, seq=self._token))
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
                send_recorded(self._dispatcher, step, now_ms, self._token)

    def flush_or_error(self, *, ending: bool = False) -> dict[str, Any] | None:
        """``flush``; the error that fails the run when a recorded step can never be
        stored (``InvalidInputError``), else ``None``. Other errors interrupt the pass."""
        try:
            self.flush(ending=ending)
        except PassInterrupted as interrupted:
            raise interrupted.__cause__ or RuntimeError("pass interrupted") from None
        except PikkuError as exc:
            return serialize_error(exc)
        return None

    def _settle_pending(self) -> None:
        in_place = self._in_place
        if in_place is None or in_place.pending is None:
            return
        self._settling(in_place.settle)

    def _settle_with(self, batch: list[NewStep], now_ms: int, *, end_mark: bool = False
                     ) -> list[tuple[StepState, bool]] | None:
        """The pending settle and ``batch``'s insert in one command (``InPlace.settle_with``);
        ``None`` when nothing was pending, or the settle went alone: insert as usual."""
        in_place = self._in_place
        if in_place is None or in_place.pending is None:
            return None
        return self._settling(lambda: in_place.settle_with(batch, now_ms, self._token,
                                                           end_mark=end_mark))

    def _settling(self, write: Callable[[], T]) -> T:
        """A write of the pending settle: refused, the pass is void (``_Void``)."""
        try:
            return write()
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
