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

Waits are spans where nothing runs: a ``wf.sleep``, a suspension until ``resume``, a step
parked on a child run, and for ordinary steps the time before the first claim and between
attempts (retry delays).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pikku_celery.records import (
    RUN_TERMINAL,
    STEP_FAILED,
    STEP_SUCCEEDED,
    StepAttempt,
    StepState,
    WorkflowRun,
)
from pikku_celery.replay import SUSPEND_PREFIX

LEASE_EXPIRED = "WorkflowStepLeaseExpiredError"
CANCELLED = "WorkflowCancelledError"

# What a step waits on when it has no body of its own.
STEP, SLEEP, SUSPENSION, CHILD = "step", "sleep", "suspension", "child"


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
class StepView:
    state: StepState
    kind: str
    attempts: list[AttemptView] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return is_settled(self.state)


@dataclass(frozen=True)
class Timeline:
    run: WorkflowRun
    steps: list[StepView]
    start: datetime
    end: datetime

    @property
    def attempts(self) -> list[AttemptView]:
        return [a for step in self.steps for a in step.attempts]

    @property
    def settled_steps(self) -> int:
        return sum(1 for step in self.steps if step.settled)

    def progress(self) -> str:
        """``3/5 steps settled, 1 running, 6 attempts (1 superseded)``."""
        running = sum(1 for s in self.steps if s.state.status == "running")
        superseded = sum(1 for a in self.attempts if a.superseded)
        line = f"{self.settled_steps}/{len(self.steps)} steps settled"
        if running:
            line += f", {running} running"
        line += f", {len(self.attempts)} attempt{'s' if len(self.attempts) != 1 else ''}"
        if superseded:
            line += f" ({superseded} superseded)"
        return line


def kind_of(step: StepState) -> str:
    if step.child_run_id is not None:
        return CHILD
    if step.function is None:
        return SUSPENSION if step.step_name.startswith(SUSPEND_PREFIX) else SLEEP
    return STEP


def outcome_of(entry: StepAttempt, current_attempt: int) -> str:
    error_type = (entry.error or {}).get("type")
    if error_type == LEASE_EXPIRED:
        return "superseded" if entry.attempt != current_attempt else "lease-expired"
    if error_type == CANCELLED:
        return "cancelled"
    return entry.status


def build(run: WorkflowRun, steps: list[StepState], history: list[StepAttempt],
          now: datetime) -> Timeline:
    """The timeline of ``run`` from its steps and history; ``now`` ends what is open."""
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
    return Timeline(run=run, steps=views, start=min([run.created_at, *latest]), end=end)


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
            result=entry.result))
    return StepView(state=step, kind=kind, attempts=attempts,
                    waits=_waits(step, kind, attempts, end))


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


def format_duration(span: timedelta | None) -> str:
    """``850ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``; ``-`` when unknown."""
    if span is None:
        return "-"
    seconds = span.total_seconds()
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def format_time(moment: datetime | None) -> str:
    """UTC, to the millisecond: ``2026-05-01 12:00:03.250Z``; ``-`` when unknown."""
    if moment is None:
        return "-"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def error_line(error: dict[str, Any] | None, *, limit: int = 300) -> str:
    """``Type: message`` on one line, cut at ``limit`` characters."""
    if not error:
        return ""
    message = " ".join(str(error.get("message", "")).split())
    line = f"{error.get('type', 'Error')}: {message}" if message else str(error.get("type"))
    return line if len(line) <= limit else line[:limit - 1] + "…"
