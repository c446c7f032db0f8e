"""The writes a pass makes for events (``wf.wait_for_event``, ``wf.set_event``): a part
of ``passes._PassHost``, kept beside it.

Taking an event is one guarded write: the waiting gate is settled with the event's seq and
payload while it still waits (not settled, not expired). No event document changes: which
events a run has taken is read from its settled gates (``replay``), so a pass that stopped
anywhere leaves either a gate that still waits, with the event still there for the next
pass, or a gate that holds the event. A sender keeps the event before it wakes the run
(``events.Events.send``), so the pass that wake asks for finds it: no pass can suspend the
run after the event was kept and before its wake."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any, Protocol

from pikku_celery.engine._guard import guarded
from pikku_celery.engine.protocols import Emit, Settings
from pikku_celery.model.records import RUN_RUNNING, RUN_SUSPENDED, STEP_SUCCEEDED, StepState
from pikku_celery.model.validate import as_stored
from pikku_celery.model.views import RunView
from pikku_celery.store.base import WorkflowStore

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10


class _Passes(Protocol):
    """What of ``passes.Passes`` the event writes use."""

    store: WorkflowStore
    settings: Settings
    emit: Emit


class EventWrites:
    """``_PassHost``'s event writes; ``_passes``, ``_view``, ``flush`` and ``now_ms`` are
    the host's."""

    _passes: _Passes
    _view: RunView

    def flush(self) -> None:
        raise NotImplementedError

    def now_ms(self) -> int:
        raise NotImplementedError

    def receive_event(self, run_id: str, gate: str, name: str, taken: list[int]
                      ) -> StepState | None:
        self.flush()  # the gate may have been recorded by this pass
        store = self._passes.store
        event = guarded(lambda: store.next_event(run_id, name, taken))
        if event is None:
            return None
        now = self.now_ms()
        check = self._passes.settings.wake_check_ms(now)
        result = {"event": name, "seq": event.seq, "payload": event.payload,
                  "sent_at_ms": round(event.sent_at.timestamp() * 1000)}
        if not guarded(lambda: store.settle_waiting_step(run_id, gate, now, gate=True,
                                                         result=result,
                                                         wake_check_ms=check)):
            # Expired, or settled by a pass that no longer held the lease: the store says.
            state = guarded(lambda: store.get_step(run_id, gate))
            if state is None or state.status != STEP_SUCCEEDED:
                return None
            self._view.put(state)
            return state
        # As an expiry does (``_PassHost.expire_gate``): the run moves on past the gate.
        guarded(lambda: store.transition_run(run_id, [RUN_SUSPENDED], RUN_RUNNING, now))
        if self._view.run.status == RUN_SUSPENDED:
            self._view.run = dataclasses.replace(self._view.run, status=RUN_RUNNING)
        guarded(lambda: store.clear_wake_check(run_id, gate, check))
        self._passes.emit("event_taken", "events", run_id=run_id, name=name, seq=event.seq,
                          workflow=self._view.run.workflow)
        return self._settled(gate, result, now)

    def publish(self, run_id: str, step_name: str, value: Any) -> None:
        self.flush()  # recorded by this pass, most likely
        store = self._passes.store
        now = self.now_ms()
        if guarded(lambda: store.settle_waiting_step(run_id, step_name, now, gate=True,
                                                     result=value)):
            self._settled(step_name, as_stored(value), now)
            return
        state = guarded(lambda: store.get_step(run_id, step_name))
        if state is not None:  # published by an earlier pass this view had not seen
            self._view.put(state)

    def _settled(self, step_name: str, result: Any, now_ms: int) -> StepState:
        settled = dataclasses.replace(
            self._view.steps[step_name], status=STEP_SUCCEEDED, result=result, error=None,
            due_at=None, lease_expires_at=None,
            updated_at=datetime.fromtimestamp(now_ms / 1000, tz=UTC))
        self._view.put(settled)
        return settled
