"""A run's per-attempt timeline, as the CLI (``pikku show``/``watch``) and the dashboard
show it: each step, each attempt, its outcome and its span, from three reads (the run, its
steps, its history) and no other I/O.

What an attempt's outcome is, read from the history entry and the step document:

- ``superseded``: a history entry whose error is ``WorkflowStepLeaseExpiredError`` for an
  attempt that is not the step's current one. Its worker lost the lease (died, stalled)
  and a reclaim fenced it out; the reclaim's own write closed that entry when it advanced
  the attempt (``store._docs.superseded_fields``), or ``merge_history`` reports it so when
  no entry was written (a step from an earlier version). It has no end of its own: it
  ended, as far as the step is concerned, when the next attempt was claimed, so its span
  runs to that claim.
- ``lease-expired``: the same error on the step's current attempt: the last attempt lost
  its worker and the step failed for good.
- ``cancelled``: fenced by a cancellation (``WorkflowCancelledError``).
- otherwise the attempt's status: ``succeeded``, ``failed``, ``running``...

Waits are spans where nothing runs: a ``wf.sleep``, a suspension until ``resume``, an
approval gate until ``approve`` (or its expiry), a step parked on a child run, and for
ordinary steps the time before the first claim and between attempts (retry delays).

A gate is shown by what it is, not by its stored step name: an approval
(``__approval:manager``) as ``manager`` with its approvers, expiry, schema and decision
(``GateView``), a suspension (``__suspend:reason``) as its reason. ``StepView.label`` is the
name shown, and the one ``pikku approve`` takes.

Events (``wf.wait_for_event``, ``wf.set_event``) are their own kinds: a wait
(``__event:paid``) is shown as ``event paid`` with its timeout and, once settled, the event
it took or that it timed out (``EventWaitView``); a publish (``__publish:stage``) as
``published stage`` with its value. The events sent to the run (``pikku.list_events``, given
to ``build`` by its caller: the timeline does no I/O of its own) are listed in the order
sent, each with the wait that took it, found by the seq the wait's result records
(``SentEvent``), or none yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from pikku_celery.model.records import (
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    QueuedReason,
    StepAttempt,
    StepState,
    WorkflowEvent,
    WorkflowRun,
)
from pikku_celery.operate._text import format_time
from pikku_celery.workflow.replay import (
    APPROVAL_PREFIX,
    EVENT_PREFIX,
    PUBLISH_PREFIX,
    SUSPEND_PREFIX,
)

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

LEASE_EXPIRED = "WorkflowStepLeaseExpiredError"
CANCELLED = "WorkflowCancelledError"

# What a step waits on when it has no body of its own.
STEP, SLEEP, SUSPENSION, APPROVAL, CHILD = "step", "sleep", "suspension", "approval", "child"
#: A ``wf.wait_for_event`` gate, and a ``wf.set_event`` publish.
EVENT, PUBLISH = "event", "publish"
#: The kinds whose label names the kind already (``event paid``, ``published stage``).
SELF_NAMED = (EVENT, PUBLISH)
#: What an approval gate is at: ``waiting`` for a decision, ``expiry-passed`` (no decision
#: is taken any more; the next pass settles it as expired), ``decided``, ``expired``, or
#: ``cancelled`` (fenced by the run's cancellation).
GATE_WAITING, GATE_EXPIRY_PASSED = "waiting", "expiry-passed"
GATE_DECIDED, GATE_EXPIRED, GATE_CANCELLED = "decided", "expired", "cancelled"
#: What an event wait is at: ``waiting`` for an event, ``expiry-passed`` (its timeout has
#: passed; the next pass settles it as timed out unless an event came first),
#: ``received`` (it took an event), ``timed-out``, or ``cancelled``.
EVENT_RECEIVED, EVENT_TIMED_OUT = "received", "timed-out"


@dataclass(frozen=True)
class AttemptView:
    """One attempt of one step, with its outcome and span."""

    step_name: str
    attempt: int
    status: str
    outcome: str
    started_at: datetime | None
    ended_at: datetime | None
    worker: str | None
    task_id: str | None
    error: dict[str, Any] | None
    result: Any = None
    max_attempts: int | None = None  # the total it ran under (``StepAttempt.max_attempts``)

    @property
    def superseded(self) -> bool:
        return self.outcome == "superseded"

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return max(self.ended_at - self.started_at, timedelta(0))


@dataclass(frozen=True)
class Wait:
    """A span where the step waits: ``kind`` is ``sleep``, ``suspension``, ``child``,
    ``queued`` (before the first claim) or ``retry`` (between attempts)."""

    kind: str
    start: datetime
    end: datetime
    open: bool = False  # still waiting: ``end`` is now


@dataclass(frozen=True)
class GateView:
    """An approval gate (``wf.approval``) as an operator acts on it: ``name`` is what
    ``approve`` takes; ``schema`` the JSON Schema a decision must match (``None``: any);
    ``approvers`` who may decide (``None``: anyone); ``decision`` and ``decided_by`` once
    decided."""

    name: str
    step_name: str
    status: str
    approvers: list[str] | None
    expires_at: datetime | None
    schema: Any
    decision: Any = None
    decided_by: str | None = None

    @property
    def waiting(self) -> bool:
        return self.status == GATE_WAITING


@dataclass(frozen=True)
class EventWaitView:
    """A ``wf.wait_for_event(name)`` gate: ``label`` is what is shown (``event paid``, a
    loop's later reach ``event paid#2``); ``expires_at`` its timeout (``None``: none);
    ``seq``, ``payload`` and ``sent_at`` the event it took, once ``received``."""

    name: str
    step_name: str
    label: str
    status: str
    expires_at: datetime | None
    seq: int | None = None
    payload: Any = None
    sent_at: datetime | None = None

    @property
    def waiting(self) -> bool:
        return self.status == GATE_WAITING

    def describe(self) -> str:
        """``waiting for event 'paid'`` (``, times out at ...`` when it has a timeout)."""
        line = f"waiting for event {self.name!r}"
        if self.expires_at is not None:
            line += f" (times out at {format_time(self.expires_at)})"
        return line


@dataclass(frozen=True)
class Published:
    """A value the run published with ``wf.set_event(key, value)``."""

    key: str
    step_name: str
    value: Any
    published_at: datetime

    @property
    def label(self) -> str:
        """``published stage`` (a loop's later reach: ``published stage#2``)."""
        return display_name(self.step_name, PUBLISH)


@dataclass(frozen=True)
class SentEvent:
    """An event sent to the run (``pikku.send_event``) and the wait that took it: its
    label and stored step name (``None``: not taken yet)."""

    event: WorkflowEvent
    taken_by: str | None = None
    taken_by_step: str | None = None

    @property
    def taken(self) -> bool:
        return self.taken_by is not None


@dataclass(frozen=True)
class StepView:
    state: StepState
    kind: str
    attempts: list[AttemptView] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    gate: GateView | None = None
    event_wait: EventWaitView | None = None

    @property
    def settled(self) -> bool:
        return is_settled(self.state)

    @property
    def label(self) -> str:
        """The name shown: a gate's own name (``manager``, a suspension's reason; a loop's
        later reach keeps its ``#N``), else the step's name."""
        return display_name(self.state.step_name, self.kind)


COMPENSATION_SUFFIX = ":on_error"


@dataclass(frozen=True)
class Compensation:
    """A compensation (``wf.do(name, step, on_error=undo)``): after step ``name`` failed
    for good, ``undo`` ran once as step ``name:on_error`` with ``{"error", "data"}``.
    ``failed`` is the step that failed (``None`` if it is not on the page read)."""

    failed: StepState | None
    step: StepState

    @property
    def for_step(self) -> str:
        return self.step.step_name.removesuffix(COMPENSATION_SUFFIX)

    @property
    def function(self) -> str | None:
        """The compensation's step function (its task name)."""
        return self.step.function

    @property
    def status(self) -> str:
        return self.step.status

    @property
    def result(self) -> Any:
        return self.step.result

    @property
    def error(self) -> dict[str, Any] | None:
        return self.step.error


@dataclass(frozen=True)
class Timeline:
    run: WorkflowRun
    steps: list[StepView]
    start: datetime
    end: datetime
    #: The events sent to the run, in the order sent (what the caller of ``build`` read
    #: with ``pikku.list_events``; empty when it read none).
    events: list[SentEvent] = field(default_factory=list)
    #: Why the run waits ``queued`` (``pikku.why_queued``), when it does and it was read.
    queued: QueuedReason | None = None

    @property
    def attempts(self) -> list[AttemptView]:
        return [a for step in self.steps for a in step.attempts]

    @property
    def settled_steps(self) -> int:
        return sum(1 for step in self.steps if step.settled)

    @property
    def gates(self) -> list[GateView]:
        """The run's approval gates, in the order it reached them."""
        return [step.gate for step in self.steps if step.gate is not None]

    @property
    def waiting_gate(self) -> GateView | None:
        """The approval the run waits on for a decision now, if any."""
        if self.run.is_terminal:
            return None
        return next((g for g in reversed(self.gates) if g.waiting), None)

    @property
    def waiting_suspension(self) -> bool:
        """Whether a ``wf.suspend`` gate waits for ``resume``."""
        return not self.run.is_terminal and any(
            s.kind == SUSPENSION and s.state.status == STEP_SCHEDULED for s in self.steps)

    @property
    def approval_only(self) -> GateView | None:
        """The approval the run waits on when no ``wf.suspend`` gate waits too: ``resume``
        would change nothing (it opens suspensions; the run would wake and suspend again
        at its gate), so the CLI, the dashboard and the JSON API refuse it and name this
        gate."""
        gate = self.waiting_gate
        return gate if gate is not None and not self.waiting_suspension else None

    @property
    def event_waits(self) -> list[EventWaitView]:
        """The run's ``wf.wait_for_event`` gates, in the order it reached them."""
        return [s.event_wait for s in self.steps if s.event_wait is not None]

    @property
    def waiting_event(self) -> EventWaitView | None:
        """The event wait the run waits on now, if any."""
        if self.run.is_terminal:
            return None
        return next((w for w in reversed(self.event_waits) if w.waiting), None)

    @property
    def event_wait_only(self) -> EventWaitView | None:
        """The event wait the run waits on when no ``wf.suspend`` gate waits too:
        ``resume`` would change nothing (the run would wake and wait again), so the CLI,
        the dashboard and the JSON API refuse it and name the event to send."""
        wait = self.waiting_event
        return wait if wait is not None and not self.waiting_suspension else None

    @property
    def published(self) -> list[Published]:
        """What the run published with ``wf.set_event``, in the order it did."""
        return [Published(str(s.state.data.get("publish")), s.state.step_name,
                          s.state.result, s.state.updated_at)
                for s in self.steps if s.kind == PUBLISH and isinstance(s.state.data, dict)
                and s.state.status == STEP_SUCCEEDED]

    @property
    def compensations(self) -> list[Compensation]:
        """The run's compensations (``wf.do(..., on_error=...)``), in the order recorded."""
        by_name = {s.state.step_name: s for s in self.steps}
        found = []
        for view in self.steps:
            name = view.state.step_name
            if view.kind == STEP and name.endswith(COMPENSATION_SUFFIX):
                failed = by_name.get(name.removesuffix(COMPENSATION_SUFFIX))
                if failed is not None and failed.state.on_error is None:
                    continue  # a step merely named so
                found.append(Compensation(failed.state if failed is not None else None,
                                          view.state))
        return found

    def progress(self) -> str:
        """``3/5 steps settled, 1 running, 6 attempts (1 superseded)``, then the approval
        waited on and each compensation's status."""
        running = sum(1 for s in self.steps if s.state.status == "running")
        superseded = sum(1 for a in self.attempts if a.superseded)
        line = f"{self.settled_steps}/{len(self.steps)} steps settled"
        if running:
            line += f", {running} running"
        line += f", {len(self.attempts)} attempt{'s' if len(self.attempts) != 1 else ''}"
        if superseded:
            line += f" ({superseded} superseded)"
        gate = self.waiting_gate
        if gate is not None:
            line += f", waiting for approval {gate.name!r}"
        waiting = self.waiting_event
        if waiting is not None:
            line += ", " + waiting.describe()
        for comp in self.compensations:
            line += f", compensation of {comp.for_step!r} {comp.status}"
        return line


def kind_of(step: StepState) -> str:
    if step.child_run_id is not None:
        return CHILD
    if step.function is None:
        if step.step_name.startswith(SUSPEND_PREFIX):
            return SUSPENSION
        if step.step_name.startswith(APPROVAL_PREFIX) and isinstance(step.data, dict) \
                and isinstance(step.data.get("approval"), str):
            return APPROVAL
        if step.step_name.startswith(EVENT_PREFIX) and isinstance(step.data, dict) \
                and isinstance(step.data.get("event"), str):
            return EVENT
        if step.step_name.startswith(PUBLISH_PREFIX) and isinstance(step.data, dict) \
                and isinstance(step.data.get("publish"), str):
            return PUBLISH
        return SLEEP
    return STEP


def display_name(step_name: str, kind: str) -> str:
    """``__approval:manager`` -> ``manager``, ``__suspend:review`` -> ``review``,
    ``__event:paid`` -> ``event paid``, ``__publish:stage`` -> ``published stage``."""
    if kind == APPROVAL:
        return step_name.removeprefix(APPROVAL_PREFIX)
    if kind == SUSPENSION:
        return step_name.removeprefix(SUSPEND_PREFIX)
    if kind == EVENT:
        return "event " + step_name.removeprefix(EVENT_PREFIX)
    if kind == PUBLISH:
        return "published " + step_name.removeprefix(PUBLISH_PREFIX)
    return step_name


def send_command(run_id: str, wait: EventWaitView) -> str:
    """The command sending the event ``wait`` waits for (``show``, a refused ``resume``)."""
    return f"pikku send {run_id} {wait.name} [PAYLOAD_JSON] [--key KEY]"


def approve_command(run_id: str, gate: GateView) -> str:
    """The command deciding ``gate`` (what ``show`` and a refused ``resume`` print)."""
    return (f"pikku approve {run_id} {gate.name} --decision JSON"
            + (" --by WHO" if gate.approvers is not None else ""))


def gate_of(step: StepState, attempts: list[AttemptView], now: datetime) -> GateView:
    """The approval gate ``step`` records (``kind_of(step) == APPROVAL``)."""
    data: dict[str, Any] = step.data
    text = data.get("schema_json")  # "schema": a gate an earlier version recorded
    try:
        schema = json.loads(text) if isinstance(text, str) else data.get("schema")
    except ValueError:
        schema = text
    approvers = data.get("approvers")
    expires_ms = data.get("expires_at_ms")
    expires_at = (datetime.fromtimestamp(expires_ms / 1000, tz=UTC)
                  if isinstance(expires_ms, int | float) else None)
    decision, decided_by = None, None
    if step.status == STEP_SUCCEEDED:
        if step.result == {"expired": True}:
            status = GATE_EXPIRED
        else:
            status, decision = GATE_DECIDED, step.result
            decided_by = next((a.worker for a in reversed(attempts)
                               if a.status == STEP_SUCCEEDED), None)
    elif step.status == STEP_SCHEDULED:
        due = step.due_at
        status = GATE_EXPIRY_PASSED if due is not None and due <= now else GATE_WAITING
    else:
        status = GATE_CANCELLED
    return GateView(name=str(data["approval"]), step_name=step.step_name, status=status,
                    approvers=list(approvers) if isinstance(approvers, list) else None,
                    expires_at=expires_at, schema=schema, decision=decision,
                    decided_by=decided_by)


def event_wait_of(step: StepState, now: datetime) -> EventWaitView:
    """The event wait ``step`` records (``kind_of(step) == EVENT``)."""
    data: dict[str, Any] = step.data
    expires_ms = data.get("expires_at_ms")
    expires_at = (datetime.fromtimestamp(expires_ms / 1000, tz=UTC)
                  if isinstance(expires_ms, int | float) else None)
    result = step.result if isinstance(step.result, dict) else {}
    seq, payload, sent_at = None, None, None
    if step.status == STEP_SUCCEEDED:
        if result.get("timed_out"):
            status = EVENT_TIMED_OUT
        else:
            status, payload = EVENT_RECEIVED, result.get("payload")
            seq = result.get("seq") if isinstance(result.get("seq"), int) else None
            sent_ms = result.get("sent_at_ms")
            sent_at = (datetime.fromtimestamp(sent_ms / 1000, tz=UTC)
                       if isinstance(sent_ms, int | float) else None)
    elif step.status == STEP_SCHEDULED:
        due = step.due_at
        status = GATE_EXPIRY_PASSED if due is not None and due <= now else GATE_WAITING
    else:
        status = GATE_CANCELLED
    return EventWaitView(name=str(data["event"]), step_name=step.step_name,
                         label=display_name(step.step_name, EVENT), status=status,
                         expires_at=expires_at, seq=seq, payload=payload, sent_at=sent_at)


def sent_events(events: list[WorkflowEvent], waits: list[EventWaitView]) -> list[SentEvent]:
    """``events`` each with the wait that took it (the wait whose result has its seq)."""
    by_seq = {w.seq: w for w in waits if w.seq is not None}
    found = []
    for event in events:
        wait = by_seq.get(event.seq)
        found.append(SentEvent(event, None if wait is None else wait.label,
                               None if wait is None else wait.step_name))
    return found


def outcome_of(entry: StepAttempt, current_attempt: int) -> str:
    error_type = (entry.error or {}).get("type")
    if error_type == LEASE_EXPIRED:
        return "superseded" if entry.attempt != current_attempt else "lease-expired"
    if error_type == CANCELLED:
        return "cancelled"
    return entry.status


def build(run: WorkflowRun, steps: list[StepState], history: list[StepAttempt],
          now: datetime, events: list[WorkflowEvent] | None = None,
          queued: QueuedReason | None = None) -> Timeline:
    """The timeline of ``run`` from its steps and history; ``now`` ends what is open;
    ``events``: the run's sent events (``pikku.list_events``), shown with the waits that
    took them (``None``: none were read)."""
    end = run.updated_at if run.status in RUN_TERMINAL else max(now, run.updated_at)
    by_step: dict[str, list[StepAttempt]] = {}
    for entry in history:
        by_step.setdefault(entry.step_name, []).append(entry)
    views = [_step_view(step, sorted(by_step.get(step.step_name, []),
                                     key=lambda a: a.attempt), end)
             for step in steps]
    latest = [t for v in views for a in v.attempts for t in (a.started_at, a.ended_at)
              if t is not None]
    end = max([end, *latest])
    waits = [v.event_wait for v in views if v.event_wait is not None]
    return Timeline(run=run, steps=views, start=min([run.created_at, *latest]), end=end,
                    events=sent_events(events or [], waits), queued=queued)


def _step_view(step: StepState, entries: list[StepAttempt], end: datetime) -> StepView:
    kind = kind_of(step)
    attempts: list[AttemptView] = []
    for i, entry in enumerate(entries):
        outcome = outcome_of(entry, step.attempt)
        ended = entry.ended_at
        if outcome == "superseded" and ended is None:
            # Fenced out when the next attempt was claimed.
            ended = next((e.started_at for e in entries[i + 1:] if e.started_at), None)
        if ended is None and entry.status == "running":
            ended = end  # still running: its bar runs to now
        attempts.append(AttemptView(
            step_name=step.step_name, attempt=entry.attempt, status=entry.status,
            outcome=outcome, started_at=entry.started_at, ended_at=ended,
            worker=entry.worker, task_id=entry.task_id, error=entry.error,
            result=entry.result, max_attempts=entry.max_attempts))
    return StepView(state=step, kind=kind, attempts=attempts,
                    waits=_waits(step, kind, attempts, end),
                    gate=gate_of(step, attempts, end) if kind == APPROVAL else None,
                    event_wait=event_wait_of(step, end) if kind == EVENT else None)


def is_settled(step: StepState) -> bool:
    """Succeeded, or failed for good (a failed step with a retry due still waits)."""
    return step.status == STEP_SUCCEEDED or (step.status == STEP_FAILED
                                             and step.due_at is None)


def _waits(step: StepState, kind: str, attempts: list[AttemptView], end: datetime
           ) -> list[Wait]:
    settled_at = step.updated_at if is_settled(step) else None
    if kind != STEP:
        # The wait is the step: from when it was recorded to when it settled (a sleep's
        # attempt "runs" only for the instant it is settled).
        return [Wait(kind, step.created_at, settled_at or end, open=settled_at is None)]
    waits: list[Wait] = []
    cursor: datetime | None = step.created_at
    first = True
    for attempt in attempts:
        if attempt.started_at is None:
            continue  # nothing is known of it (its entry was lost)
        if cursor is not None and attempt.started_at > cursor:
            waits.append(Wait("queued" if first else "retry", cursor, attempt.started_at))
        first = False
        cursor = attempt.ended_at
    if cursor is not None and settled_at is None and step.status != "running":
        waits.append(Wait("queued" if first else "retry", cursor, max(end, cursor),
                          open=True))
    return waits
