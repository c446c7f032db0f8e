"""Frozen read models handed to users; the store's documents never leak out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

RUN_QUEUED = "queued"  # waiting for a slot of its workflow's concurrency limit
RUN_RUNNING = "running"
RUN_SUSPENDED = "suspended"
RUN_COMPLETED = "completed"
RUN_FAILED = "failed"
RUN_CANCELLED = "cancelled"
RUN_STATUSES = (RUN_QUEUED, RUN_RUNNING, RUN_SUSPENDED, RUN_COMPLETED, RUN_FAILED,
                RUN_CANCELLED)
RUN_TERMINAL = frozenset({RUN_COMPLETED, RUN_FAILED, RUN_CANCELLED})
RUN_LIVE = (RUN_QUEUED, RUN_RUNNING, RUN_SUSPENDED)  # not ended: events may be sent to it

STEP_PENDING = "pending"
STEP_SCHEDULED = "scheduled"
STEP_RUNNING = "running"
STEP_SUCCEEDED = "succeeded"
STEP_FAILED = "failed"
STEP_STATUSES = (STEP_PENDING, STEP_SCHEDULED, STEP_RUNNING, STEP_SUCCEEDED, STEP_FAILED)


LINEAGE_RETRY = "retry"
LINEAGE_FORK = "fork"


@dataclass(frozen=True)
class RunLineage:
    """One operation on a run's record (``WorkflowRun.lineage``): a retry of the run
    (``op`` ``"retry"``) or the fork that made it (``"fork"``: ``run_id`` is the source
    run, ``from_step`` the step the fork ran afresh from, ``keep_decisions`` whether it
    copied the source's decided gates and taken events). ``by`` is who asked (``None``:
    not said); ``at`` when the operation was written. Kept so that a person reading a run
    learns why it ran again and where it came from, never only what it did."""

    op: str
    at: datetime
    by: str | None = None
    from_step: str | None = None
    run_id: str | None = None
    keep_decisions: bool = False


@dataclass(frozen=True)
class WorkflowRun:
    """One execution of a workflow. Times are aware UTC datetimes."""

    run_id: str
    workflow: str
    status: str
    input: Any
    output: Any
    error: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    version: str | None = None
    parent_run_id: str | None = None
    parent_step_name: str | None = None
    cancel_reason: str | None = None
    # The run state: a small map graph nodes share (``pikku_celery.with_state``), versioned
    # per write: ``state_version`` counts the writes, ``state_writers[n - 1]`` made write n.
    state: Mapping[str, Any] = field(default_factory=dict)
    state_version: int = 0
    state_writers: tuple[str, ...] = ()
    # The schedule whose tick started the run, and that tick (``pikku.schedule``); ``None``
    # for a run started any other way.
    schedule: str | None = None
    scheduled_for: datetime | None = None
    # The slot group of a workflow with a concurrency limit (``pikku_celery.engine.concurrency``):
    # the run waits ``queued`` until it holds one of the group's slots.
    slot: str | None = None
    # The run a fork copied this one from (``pikku.fork``), ``None`` for a run started any
    # other way; ``lineage``: the forks and retries of this run, oldest first.
    forked_from: str | None = None
    lineage: tuple[RunLineage, ...] = ()
    # The trace the run belongs to, as a W3C Trace Context carrier (``traceparent``, and
    # ``tracestate`` when there is one): taken when the run was created, so every span of
    # the run joins the trace of whoever started it (``pikku_celery.observe.tracing``).
    # ``None`` when no tracing was on then. A retry keeps it; a child run's is taken inside
    # its parent's pass, so it is in its parent's trace.
    trace: Mapping[str, str] | None = None
    # A retry made the run live again and has not yet reopened the steps its end left
    # failed (on MongoDB a retry is several writes): the pass that reads this finishes the
    # reopen before it replays (``engine.passes``), instead of replaying a failed step.
    reopen_owed: bool = False

    @property
    def is_terminal(self) -> bool:
        return self.status in RUN_TERMINAL


@dataclass(frozen=True)
class QueuedReason:
    """Why a run waits ``queued``: its workflow's concurrency limit for its key is taken
    (``pikku.why_queued``). ``holders``: the runs holding the key's slots now; ``ahead``:
    the queued runs admitted before it (admission goes by creation time)."""

    run_id: str
    workflow: str
    key: str | None
    limit: int | None
    holders: tuple[str, ...]
    ahead: int

    def describe(self) -> str:
        """One line for a person, e.g. ``waits for a slot: concurrency 2 for key 'acme' is
        held by run-1, run-2; 3 runs ahead``."""
        key = "" if self.key is None else f" for key {self.key!r}"
        limit = "its concurrency limit" if self.limit is None else f"concurrency {self.limit}"
        held = ", ".join(self.holders) if self.holders else "no run (a slot frees now)"
        ahead = {0: "next in line", 1: "1 run ahead"}.get(self.ahead, f"{self.ahead} runs ahead")
        return f"waits for a slot: {limit}{key} is held by {held}; {ahead}"


@dataclass(frozen=True)
class StepState:
    """The current state of one step; ``attempt`` is the fencing token (1-based)."""

    run_id: str
    step_name: str
    status: str
    attempt: int
    max_attempts: int
    function: str | None
    data: Any
    result: Any
    error: dict[str, Any] | None
    lease_expires_at: datetime | None
    created_at: datetime
    updated_at: datetime
    invocation_id: str
    due_at: datetime | None = None
    child_run_id: str | None = None
    retry_delay_ms: int = 0
    on_error: str | None = None
    # Whether an attempt whose body raised may be tried again (attempts allowing); a lost
    # worker's attempt always may (``workflow.retry``).
    errors_retried: bool = True
    task_id: str | None = None  # the Celery task id of the delivery that claimed ``attempt``
    # What the current attempt said of its progress (``StepContext.progress``), and when.
    progress: Any = None
    progress_at: datetime | None = None
    # The run a fork copied this step's outcome from (``pikku.fork``); ``None`` for a step
    # this run recorded itself.
    forked_from: str | None = None

    @property
    def attempts_left(self) -> int:
        return max(0, self.max_attempts - self.attempt)


@dataclass(frozen=True)
class StepAttempt:
    """One attempt of one step, as recorded in the history. ``task_id`` is the Celery task
    id of the delivery that ran it (``None`` inline, or when nothing is known of it)."""

    run_id: str
    step_name: str
    attempt: int
    status: str
    result: Any
    error: dict[str, Any] | None
    started_at: datetime | None
    ended_at: datetime | None
    worker: str | None = None
    task_id: str | None = None
    # The attempts the step had when this attempt ran (``2`` in "attempt 1/2"): a retry
    # gives the step a fresh budget, and an earlier attempt keeps the total it ran under.
    max_attempts: int | None = None


@dataclass(frozen=True)
class WorkflowEvent:
    """One event sent to a run (``pikku.send_event``). ``seq`` orders a run's events (the
    order they were sent in); ``key`` is the sender's idempotency key, if it gave one;
    ``size``, its payload's size in bytes as JSON (``None`` for an event kept before sizes
    were recorded). Listed without payloads (``pikku.list_events(payloads=False)``), its
    ``payload`` is ``None`` whatever was sent: read it with ``payloads=True``."""

    run_id: str
    name: str
    seq: int
    payload: Any
    sent_at: datetime
    key: str | None = None
    event_id: str = ""
    size: int | None = None


CATCH_UP_LATEST = "latest"
CATCH_UP_ALL = "all"
CATCH_UP_NONE = "none"
CATCH_UPS = (CATCH_UP_LATEST, CATCH_UP_ALL, CATCH_UP_NONE)


@dataclass(frozen=True)
class WorkflowSchedule:
    """A schedule as stored (``pikku.schedule``, ``pikku.list_schedules``): its definition,
    whether it is paused, the next tick not yet started and the latest tick fired.
    ``every`` is in seconds; ``last_run_id`` is the run the latest tick started."""

    name: str
    workflow: str
    cron: str | None
    every: float | None
    tz: str
    data: Any
    catch_up: str
    paused: bool
    next_at: datetime
    last_at: datetime | None
    last_run_id: str | None
    created_at: datetime
    updated_at: datetime
    declared: bool = True  # whether this process declares it (list_schedules says)
