"""The interfaces between the engine's parts, below all of them: how work is sent
(``Dispatcher``), where the engine reports what it did (``Emit``), the engine's settings,
and what the orchestration passes and the reaper ask of the run lifecycle (``RunEnds``,
``Advancer``). The parts (``runs``, ``execution``, ``gates``, ``reads``, ``passes``,
``reaper``) import these, never ``engine``, so imports point one way::

    protocols <- runs <- passes <- execution <- engine
    protocols <- reaper, gates, reads        <- engine

No Celery here, nor anywhere in the core (``tasks.py`` is the adapter)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pikku_celery.model.records import StepState, WorkflowRun
from pikku_celery.model.redaction import Redactor
from pikku_celery.store.base import NewClaim, NewStep
from pikku_celery.workflow.definitions import StepDefinition
from pikku_celery.workflow.retry import NO_DEFAULTS, StepDefaults


class Emit(Protocol):
    """Where the engine reports what it did (``pikku_celery.worker.signals`` sends them as Celery
    signals): ``event`` names the signal, ``sender`` is the workflow name for run events
    and the step's task name for attempt events."""

    def __call__(self, event: str, sender: str, **fields: Any) -> None: ...


def no_emit(event: str, sender: str, **fields: Any) -> None:
    return None


class TraceContext(Protocol):
    """The trace context a run created now saves with it (``WorkflowRun.trace``: a W3C
    ``traceparent``/``tracestate`` map), ``None`` when nothing traces: what joins the run's
    spans, in any process, to the trace of whoever started it."""

    def __call__(self, run_id: str, workflow: str) -> Mapping[str, str] | None: ...


def no_trace_context(run_id: str, workflow: str) -> None:
    return None


#: Asked by ``runs.Runs.create_run`` for every run it creates. Process-wide, as the
#: OpenTelemetry state it reads is (the global tracer provider, the current context):
#: ``pikku_celery.observe.tracing`` sets it when opentelemetry-api is installed; the engine
#: never imports the tracing it serves. Without it: one call that returns ``None``.
trace_context: TraceContext = no_trace_context


class Dispatcher(Protocol):
    """How the engine sends work: Celery messages, or the inline driver's queue."""

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None: ...

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        """Ask for a pass of ``run_id``; ``step_name``: the step whose change it is for (the
        pass reads that step; ``None``: it reads the run and every unsettled step)."""
        ...

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None: ...

    # Optional (``runs_here``): whether this process, now, may run a step of ``function``
    # in place rather than send it (``passes``). A dispatcher without it never runs steps
    # in place.
    # Optional (``carries_claims``, true): its ``dispatch_step`` takes ``expected=``, the
    # step as recorded, and delivers it with the message to ``execute_step`` (a first claim
    # without a read: ``store._claim_hint``).


#: Every run's limits on the events sent to it (``pikku_max_events_per_run``,
#: ``pikku_max_event_bytes``; 0: none): at most 2.5 GiB of payloads per run by default.
DEFAULT_MAX_EVENTS_PER_RUN = 10_000
DEFAULT_MAX_EVENT_BYTES = 256 * 1024


@dataclass(frozen=True)
class Settings:
    step_lease_ms: int = 60_000
    run_lease_ms: int = 30_000
    undispatched_after_ms: int = 30_000
    stalled_after_ms: int = 30_000
    sweep_limit: int = 100
    continue_in_place: bool = True
    # Running in place (``passes``): a pass in a worker runs the next step of a sequential
    # run itself, at most this many in a row and for this long, then sends a message.
    in_place_steps: int = 100
    in_place_ms: int = 10_000
    # The user's redaction of recorded errors, after the built-in masking (redaction.py).
    redact_error: Redactor | None = None
    # Every run's limits on its events (``store._events``; 0: none).
    max_events_per_run: int = DEFAULT_MAX_EVENTS_PER_RUN
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    # The app's ``pikku_step_*`` settings: retries of the steps that give none
    # (``workflow.retry``).
    step_defaults: StepDefaults = NO_DEFAULTS

    def wake_check_ms(self, now_ms: int) -> int:
        """When the reaper makes sure that a gate opened now has its run moving: the
        opener moves the run itself right after (a second write), so the check only acts
        when the opener died in between (see ``store.settle_waiting_step``)."""
        return now_ms + self.stalled_after_ms


class RunEnds(Protocol):
    """What a pass and the reaper ask of the run lifecycle (``runs.Runs``)."""

    def finish(self, run: WorkflowRun, status: str, *, output: Any = None,
               error: dict[str, Any] | None = None, dispatcher: Dispatcher | None = None,
               reason: str | None = None, leftovers: bool = True,
               marked: bool = False) -> str: ...

    def fence_leftovers(self, run_id: str, status: str) -> None: ...

    def cancel(self, run_id: str, reason: str | None = None) -> bool: ...

    def cancel_if_parent_cancelled(self, child_run_id: str, parent_run_id: str) -> bool: ...

    def notify_parent(self, child_run_id: str, dispatcher: Dispatcher) -> None: ...

    def ensure_child(self, parent_run_id: str, step_name: str, workflow: str, data: Any,
                     child_run_id: str, dispatcher: Dispatcher) -> None: ...


class PendingSettle(Protocol):
    """A step run in place whose body succeeded: the pass went on with its result, and its
    settle travels with the next step's claim, or is written alone before any other write
    of the pass (``StepRunner.finish_settle``)."""

    @property
    def running(self) -> StepState:
        """The step as its claim left it (running)."""
        ...


class ContinuationRefused(Exception):
    """The settle of a step run in place did not record the result the workflow went on
    with (its attempt was superseded, or MongoDB refused the result after all): what the
    pass did since is void, and it replays from what the store holds."""


class StepRunner(Protocol):
    """What a pass asks of step execution (``execution.StepExecution``) to run the step it
    records at once, in place: the step as settled (a success as it will be written,
    with the settle still to write), or why it was not run."""

    def run_new_step(self, definition: StepDefinition, step: NewStep, seq: int,
                     dispatcher: Dispatcher, *, after: PendingSettle | None = None,
                     workflow: str | None = None
                     ) -> tuple[StepState | NewClaim | None, PendingSettle | None]: ...

    def finish_settle(self, pending: PendingSettle) -> StepState: ...

    def settle_with_inserts(self, pending: PendingSettle, steps: list[NewStep], now_ms: int,
                            seq: int, *, end_mark: bool = False
                            ) -> list[tuple[StepState, bool]] | None: ...


class Advancer(Protocol):
    """What step execution asks of the orchestration passes (``passes.Passes``)."""

    def advance(self, run_id: str, dispatcher: Dispatcher, *, mark: str = ...,
                settled: StepState | None = None,
                pending: PendingSettle | None = None) -> str: ...
