"""The events part of the store contract (``EventStore``; the rules every store applies to
a send are ``store._events``')."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

from pikku_celery.model.records import WorkflowEvent


@runtime_checkable
class EventStore(Protocol):
    """The events part of the store contract (``store._events``)."""

    def send_event(self, run_id: str, name: str, payload: Any, now_ms: int, *,
                   key: str | None = None, wake_check_ms: int | None = None,
                   send_id: str | None = None, max_events: int | None = None,
                   max_bytes: int | None = None) -> tuple[WorkflowEvent, bool]:
        """Keep an event for the live run ``run_id``, next in its order; returns it and
        whether this send wrote it (``False``: ``key``'s earlier send did). Unknown run:
        ``WorkflowRunNotFoundError``, ended: ``WorkflowEventError``, nothing kept.
        ``wake_check_ms``: when the reaper wakes the run (``find_event_wakes``) unless the
        sender does (``clear_event_wake``). ``send_id`` names the one send (a call repeated
        with it keeps one event; ``store._events``). ``max_bytes``: a payload larger as
        JSON is refused; ``max_events``: a run that has kept that many events refuses
        another, in the write that would keep it (concurrent sends never pass it); both
        ``WorkflowEventLimitError``, nothing kept (``None`` or 0: no limit)."""
        ...

    def next_event(self, run_id: str, name: str, taken: Collection[int] = ()
                   ) -> WorkflowEvent | None:
        """The first event named ``name`` sent to the run whose ``seq`` is not in
        ``taken`` (the events the run's earlier waits took)."""
        ...

    def list_events(self, run_id: str, limit: int = 1000, *, after: int = 0,
                    payloads: bool = True) -> list[WorkflowEvent]:
        """The run's events whose ``seq`` is over ``after``, in the order they were sent,
        at most ``limit`` (1 or more); without ``payloads``, each event's ``payload`` is
        not read (``None``; its ``size`` says how large it is)."""
        ...

    def find_event_wakes(self, now_ms: int, limit: int) -> list[WorkflowEvent]:
        """Events whose wake check is due: their sender may have stopped before it woke
        the run."""
        ...

    def clear_event_wake(self, event_id: str) -> bool:
        """End an event's wake check; ``False`` when it had none."""
        ...
