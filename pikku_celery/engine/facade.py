"""The workflow engine: the facade that wires the engine's parts together and that the
Celery tasks (``tasks.py``), the inline driver and ``PikkuCelery`` call. No Celery import.

The parts, each over a narrow interface (``protocols.py``), imports pointing one way::

    protocols   Dispatcher, Emit, Settings, RunEnds, Advancer: the interfaces
    reads       get a run, its steps, its history; wait for its end
    runs        create, finish, fence leftovers, cancel; children and their parents
    forks       fork a run into a new one (uses runs)
    gates       resume, approve, timers
    passes      advance a run by replay under its run lease (uses runs through RunEnds)
    execution   one step delivery: claim, body, settle once, continue (uses passes)
    reaper      sweeps for lost work (uses runs through RunEnds)

``Engine`` builds them on one store, lease service, registry, clock and dispatcher, and
forwards each call to the part that owns it; replacing its ``dispatcher`` or ``clock``
(the test kit, tests) replaces them in every part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pikku_celery.engine.claims import Claimer
from pikku_celery.engine.concurrency import queued_reason
from pikku_celery.engine.execution import StepExecution
from pikku_celery.engine.forks import Forks
from pikku_celery.engine.gates import Gates
from pikku_celery.engine.heartbeat import Heartbeat
from pikku_celery.engine.observed import ObservedPasses
from pikku_celery.engine.outcomes import RecordedStepError, StepOutcome
from pikku_celery.engine.passes import Passes
from pikku_celery.engine.protocols import Dispatcher, Emit, Settings, no_emit
from pikku_celery.engine.reads import Reads
from pikku_celery.engine.reaper import Reaper
from pikku_celery.engine.runs import Runs
from pikku_celery.leases.base import LeaseService
from pikku_celery.model.clock import Clock, ServerClock
from pikku_celery.model.records import QueuedReason, StepAttempt, StepState, WorkflowRun
from pikku_celery.model.validate import check_by
from pikku_celery.model.views import ALL
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.definitions import Registry, StepDefinition

__all__ = ["Dispatcher", "Emit", "Engine", "RecordedStepError", "Settings", "StepOutcome"]

# What ``Engine.advance`` returns when the run has not ended: its passes sent a step (or
# ran one in place) and the run waits for it, or they only found it waiting (on a timer, a
# gate, an event, steps already in flight). Celery logs it as the orchestrator's result.
DISPATCHED = "dispatched"
WAITING = "waiting"  # also ``passes.Passes.advance``'s result for a run not ended


class _Noting:
    """The dispatcher of one ``advance`` call, noting whether its passes sent a step or
    ran one in place; everything else is the wrapped dispatcher's."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self.dispatched = False

    def dispatch_step(self, function: str, run_id: str, step_name: str, *,
                      expected: object = None) -> None:
        if expected is None:
            self._dispatcher.dispatch_step(function, run_id, step_name)
        else:  # only asked of a dispatcher that ``carries_claims``
            self._dispatcher.dispatch_step(  # type: ignore[call-arg]
                function, run_id, step_name, expected=expected)
        self.dispatched = True

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        self._dispatcher.wake_run(run_id, countdown_s, step_name)

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        self._dispatcher.arm_timer(run_id, step_name, due_ms)

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._dispatcher, name)  # ``runs_here`` and ``batch``, if it has them
        if name != "runs_here":
            return found

        def runs_here(function: str, run_id: str, step_name: str) -> bool:
            here = bool(found(function, run_id, step_name))
            self.dispatched = self.dispatched or here
            return here

        return runs_here


class Engine:
    def __init__(self, store: WorkflowStore, leases: LeaseService, registry: Registry,
                 dispatcher: Dispatcher, settings: Settings, *,
                 worker: str | Callable[[], str] | None = None,
                 clock: Clock | None = None, emit: Emit | None = None) -> None:
        self.leases = leases
        self.registry = registry
        self.emit: Emit = emit if emit is not None else no_emit
        clock = clock if clock is not None else ServerClock(leases)
        self.heartbeat = Heartbeat(store, leases, clock)
        self.claimer = Claimer(store, leases, clock, self.heartbeat, host=worker)
        self.reads = Reads(store, leases)
        self.runs = Runs(store, leases, registry, settings, clock, dispatcher, self.emit)
        self.forks = Forks(self.runs)  # reads the runs' store, clock and dispatcher
        self.gates = Gates(store, settings, clock, dispatcher)
        self.passes = Passes(store, leases, registry, settings, clock, self.runs)
        self.passes.emit = self.emit
        self.advancer = ObservedPasses(self.passes, self.emit)
        self.execution = StepExecution(store, self.claimer, self.advancer, settings, clock,
                                       dispatcher, self.emit)
        self.passes.runner = self.execution  # a pass runs the steps it may run in place
        self._reaper = Reaper(store, leases, registry, settings, self.runs, self.emit)
        self._store, self._settings = store, settings
        self._dispatcher, self._clock = dispatcher, clock

    def _share(self, name: str, value: Any) -> None:
        """Give every part that has ``name`` the engine's new ``value``."""
        for part in (self.reads, self.runs, self.gates, self.passes, self.execution,
                     self._reaper):
            if hasattr(part, name):
                setattr(part, name, value)

    # --- what every part shares (replacing one replaces it in every part; the heartbeat
    # --- and the claim layer keep the store and clock they were built with) ---------------

    @property
    def store(self) -> WorkflowStore:
        return self._store

    @store.setter
    def store(self, store: WorkflowStore) -> None:
        self._store = store
        self._share("store", store)

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings
        self._share("settings", settings)

    @property
    def dispatcher(self) -> Dispatcher:
        return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self._share("dispatcher", dispatcher)

    @property
    def clock(self) -> Clock:
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = clock
        self._share("clock", clock)

    def now_ms(self) -> int:
        return self._clock.now_ms()

    def wake_check_ms(self, now_ms: int) -> int:
        return self.settings.wake_check_ms(now_ms)

    def recorded_error(self, error: dict[str, Any]) -> dict[str, Any]:
        return self.runs.recorded_error(error)

    # --- runs (runs.py) -------------------------------------------------------------------

    def create_run(self, workflow: Any, data: Any, *, run_id: str | None = None,
                   parent: tuple[str, str] | None = None) -> tuple[WorkflowRun, bool]:
        return self.runs.create_run(workflow, data, run_id=run_id, parent=parent)

    def finish(self, run: WorkflowRun, status: str, *, output: Any = None,
               error: dict[str, Any] | None = None, dispatcher: Dispatcher | None = None,
               reason: str | None = None, leftovers: bool = True) -> str:
        return self.runs.finish(run, status, output=output, error=error,
                                dispatcher=dispatcher, reason=reason, leftovers=leftovers)

    def fence_leftovers(self, run_id: str, status: str) -> None:
        self.runs.fence_leftovers(run_id, status)

    def cancel(self, run_id: str, reason: str | None = None) -> bool:
        return self.runs.cancel(run_id, reason)

    def retry(self, run_id: str, *, by: str | None = None) -> bool:
        check_by(by)
        return self.runs.retry(run_id, by=by)

    def fork(self, run_id: str, from_step: str, new_run_id: str | None = None, *,
             keep_decisions: bool = False, by: str | None = None) -> str:
        return self.forks.fork(run_id, from_step, new_run_id, keep_decisions=keep_decisions,
                               by=by)

    def notify_parent(self, child_run_id: str, dispatcher: Dispatcher) -> None:
        self.runs.notify_parent(child_run_id, dispatcher)

    def ensure_child(self, parent_run_id: str, step_name: str, workflow: str, data: Any,
                     child_run_id: str, dispatcher: Dispatcher) -> None:
        self.runs.ensure_child(parent_run_id, step_name, workflow, data, child_run_id,
                               dispatcher)

    # --- passes (passes.py) ---------------------------------------------------------------

    def advance(self, run_id: str, dispatcher: Dispatcher | None = None, *,
                step_name: str | None = None, settled: StepState | None = None) -> str:
        """Orchestration passes under the run lease, until nothing is left to do (see
        ``pikku_celery.engine.passes``). ``step_name`` is the step whose change asked for it (the
        pass reads that step; ``None``: anything may have changed), ``settled`` that step as
        its settle wrote it. Raises ``LeaseTakenError`` when another orchestrator holds the
        run (it will pass again: this call left it a mark), ``LeaseLostError`` when the
        lease was lost during a pass (whatever the pass wrote stands). Returns the run's
        status once it has ended (``completed``, ``failed``, ``cancelled``), else
        ``dispatched`` when the passes sent a step or ran one in place, ``waiting`` when
        they sent none (the run waits on a timer, a gate, an event or steps in flight)."""
        noting = _Noting(dispatcher or self.dispatcher)
        status = self.advancer.advance(run_id, noting,
                                       mark=ALL if step_name is None else step_name,
                                       settled=settled)
        return DISPATCHED if status == WAITING and noting.dispatched else status

    # --- steps (execution.py) -------------------------------------------------------------

    def execute_step(self, definition: StepDefinition, run_id: str, step_name: str,
                     dispatcher: Dispatcher | None = None, *, task_id: str | None = None,
                     expected: object = None) -> StepOutcome:
        """Claim, run and settle one attempt. Raises ``WorkflowStepSupersededError`` when
        the attempt lost the step before it could record its outcome. ``task_id`` (the
        Celery task id of this delivery) is recorded with the attempt; ``expected``: what
        the message says the step was when recorded (``store.claim_step``)."""
        return self.execution.execute_step(definition, run_id, step_name, dispatcher,
                                           task_id=task_id, expected=expected)

    # --- gates (gates.py) -----------------------------------------------------------------

    def resume(self, run_id: str) -> bool:
        return self.gates.resume(run_id)

    def approve(self, run_id: str, name: str, decision: Any, *, by: str | None = None
                ) -> StepState:
        return self.gates.approve(run_id, name, decision, by=by)

    def fire_timer(self, run_id: str, step_name: str, dispatcher: Dispatcher | None = None
                   ) -> str:
        return self.gates.fire_timer(run_id, step_name, dispatcher)

    # --- reads (reads.py) -----------------------------------------------------------------

    def get_run(self, run_id: str) -> WorkflowRun:
        return self.reads.get_run(run_id)

    def get_steps(self, run_id: str) -> list[StepState]:
        return self.reads.get_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        return self.reads.get_history(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        return self.reads.wait(run_id, timeout)

    def why_queued(self, run_id: str) -> QueuedReason | None:
        run = self.get_run(run_id)
        return queued_reason(self._store, run, self.registry.workflows.get(run.workflow))

    # --- the reaper (reaper.py) -----------------------------------------------------------

    def reap(self, dispatcher: Dispatcher | None = None) -> dict[str, int]:
        """One sweep for lost work (see ``pikku_celery.engine.reaper``); returns what it resumed."""
        return self._reaper.sweep(dispatcher or self.dispatcher)
