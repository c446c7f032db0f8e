"""Events, from outside a run: send one to a run (``wf.wait_for_event`` takes it), read
what a run published (``wf.set_event``), list a run's events.

A send keeps the event (``store.send_event``), then wakes the run: the pass that wake
asks for finds the event, whatever the run was doing, so no order of a send and a pass
that suspends the run leaves the run asleep with an event it could take
(``pass_events``). The event carries a wake check until the sender has woken the run: a
sender that stops between the two leaves the reaper to wake it (``wake_lost_sends``)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Protocol

from pikku_celery.engine.protocols import Dispatcher, Emit, Settings, no_emit
from pikku_celery.model.errors import WorkflowEventNotSentError, WorkflowRunNotFoundError
from pikku_celery.model.records import STEP_SUCCEEDED, WorkflowEvent
from pikku_celery.model.validate import check_event_name, check_name
from pikku_celery.store._events import kept_as_marked, transient
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.replay import PUBLISH_PREFIX

log = logging.getLogger("pikku_celery")
# How long a send tries its store writes again after transient errors (a MongoDB primary
# election takes some 10 to 12 s; pymongo waits up to its server-selection timeout for a
# new primary within each try). docs/guide/events.md promises it.
SEND_DEADLINE_S = 30.0
_PAUSE_S = 0.05  # between two tries (doubled, at most 1 s)


class _Engine(Protocol):
    """What of ``engine.Engine`` events use."""

    @property
    def store(self) -> WorkflowStore: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def dispatcher(self) -> Dispatcher: ...

    def now_ms(self) -> int: ...


def _emit_of(engine: _Engine) -> Emit:
    """The engine's ``emit`` (one without it reports nothing)."""
    emit: Emit = getattr(engine, "emit", no_emit)
    return emit


class Events:
    """Events on ``engine``'s store, woken through its dispatcher (both read at each call:
    the test kit replaces them)."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine

    def send(self, run_id: str, name: str, payload: Any = None, *, key: str | None = None
             ) -> WorkflowEvent:
        """One event per call (issue 31): the call's own ``send_id`` names its event, so
        the store's writes retried through an election (``SEND_DEADLINE_S``) keep it once;
        past that, ``WorkflowEventNotSentError`` says whether it may have been kept. A
        send past the run's limits on events (``Settings.max_events_per_run``,
        ``max_event_bytes``) is refused by the store: ``WorkflowEventLimitError``."""
        engine = self.engine
        now = engine.now_ms()
        event, created = self._keep(run_id, name, payload, key, now,
                                    engine.settings.wake_check_ms(now))
        if not created:
            log.info("pikku: event %r (key %r) for run %s was sent before: not sent again",
                     name, key, run_id)
        else:
            _emit_of(engine)("event_sent", "events", run_id=run_id, name=name, key=key)
        # Woken even when the key's first send was the one that kept it: that sender may
        # have stopped before it woke the run, and a second wake costs one pass. The wake,
        # *then* the check's end: a wake that fails leaves the check for the reaper. The
        # event is kept by then, so neither failing fails the send: an error here would
        # have its caller send the event again, and keep it twice.
        try:
            engine.dispatcher.wake_run(run_id)
        except Exception:
            log.warning("pikku: event %r for run %s is kept, but the run could not be "
                        "woken; the reaper wakes it (stalled_after)", name, run_id,
                        exc_info=True)
            return event
        try:
            engine.store.clear_event_wake(event.event_id)
        except Exception:  # the reaper wakes the run once more: one pass, nothing lost
            log.info("pikku: event %r for run %s: its wake check is left to the reaper",
                     name, run_id, exc_info=True)
        return event

    def _keep(self, run_id: str, name: str, payload: Any, key: str | None, now_ms: int,
              wake_check_ms: int) -> tuple[WorkflowEvent, bool]:
        """``store.send_event`` under this call's ``send_id``, tried again after a
        transient store error until ``SEND_DEADLINE_S`` has passed."""
        send_id = uuid.uuid4().hex
        settings = self.engine.settings
        deadline = time.monotonic() + SEND_DEADLINE_S
        pause = _PAUSE_S
        kept = False  # what the store's answers said of the event so far
        while True:
            try:
                return self.engine.store.send_event(
                    run_id, name, payload, now_ms, key=key, wake_check_ms=wake_check_ms,
                    send_id=send_id, max_events=settings.max_events_per_run,
                    max_bytes=settings.max_event_bytes)
            except Exception as exc:
                if transient(exc) or type(exc).__module__.startswith("pymongo"):
                    _emit_of(self.engine)("service_error", "events", where="events",
                                          exception=exc)
                if not transient(exc):
                    raise
                said = kept_as_marked(exc)
                kept = kept if said is None else said
                if time.monotonic() + pause >= deadline:
                    raise WorkflowEventNotSentError(
                        run_id, name, kept, f"the store kept failing for "
                        f"{SEND_DEADLINE_S:g} s; last: {type(exc).__name__}") from exc
                log.info("pikku: event %r for run %s: %s: trying again in %g s",
                         name, run_id, type(exc).__name__, pause)
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def get(self, run_id: str, key: str, default: Any = None) -> Any:
        """The value the run last published under ``key`` (``wf.set_event``); ``default``
        when it has published none."""
        check_name("run id", run_id)
        check_event_name("event key", key)
        store = self.engine.store
        if store.get_run(run_id) is None:
            raise WorkflowRunNotFoundError(run_id)
        base = PUBLISH_PREFIX + key
        latest: tuple[int, Any] | None = None
        for step in store.list_steps(run_id):
            reach = _reach(step.step_name, base)
            if reach is not None and step.status == STEP_SUCCEEDED and (
                    latest is None or reach > latest[0]):
                latest = (reach, step.result)
        return default if latest is None else latest[1]

    def list(self, run_id: str, limit: int = 1000, *, after: int = 0,
             payloads: bool = True) -> list[WorkflowEvent]:
        store = self.engine.store
        if store.get_run(run_id) is None:
            raise WorkflowRunNotFoundError(run_id)
        return store.list_events(run_id, limit, after=after, payloads=payloads)


def wake_lost_sends(store: WorkflowStore, dispatcher: Dispatcher, now_ms: int,
                    limit: int) -> int:
    """The reaper's part: wake the runs of events whose sender stopped before it woke
    them; how many were woken."""
    woken = 0
    for event in store.find_event_wakes(now_ms, limit):
        dispatcher.wake_run(event.run_id)
        store.clear_event_wake(event.event_id)
        woken += 1
    return woken


def _reach(step_name: str, base: str) -> int | None:
    """Which reach of ``base`` the step ``step_name`` is (1, 2, ...), or ``None`` when it is
    another step (``replay``: the N-th reach of a name is ``name#N``; keys hold no ``#``)."""
    if step_name == base:
        return 1
    head, sep, tail = step_name.rpartition("#")
    if sep and head == base and tail.isdigit():
        return int(tail)
    return None
