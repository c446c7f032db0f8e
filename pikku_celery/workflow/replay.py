"""Deterministic replay: the ``wf`` object a workflow function receives.

Every orchestration pass runs the workflow function from the top. ``wf.do`` returns the
recorded result of a settled step, records and dispatches a step reached for the first
time (or, in a worker that may, runs it at once and goes on: running in place, with no
replay between steps), and ends the pass (by raising ``Pause``, which user code cannot
catch by accident: it is a ``BaseException``) while a step is in flight. The pass gets the
steps as a table its process keeps between passes (``pikku_celery.model.views``); the host does
the writes and keeps the table. Nothing here talks to MongoDB, Redis or Celery directly.

Replay is O(steps) per pass, so the path of a settled step is kept short: a run of 1,000
steps replays 500 of them per pass on average. A recorded result is handed to the workflow
as a copy: the table outlives the pass, and a workflow that changes a result it was given
must not change what the next pass replays.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar, overload

from pikku_celery.model import keys
from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowCancelledError,
    WorkflowReplayError,
    WorkflowRunFailedError,
)
from pikku_celery.model.records import (
    STEP_FAILED,
    STEP_RUNNING,
    STEP_SCHEDULED,
    STEP_SUCCEEDED,
    StepState,
)
from pikku_celery.model.validate import check_event_name, check_state_write
from pikku_celery.store.base import NewStep
from pikku_celery.workflow.definitions import StepDefinition, check_retries
from pikku_celery.workflow.retry import StepDefaults
from pikku_celery.workflow.typed import HasStep, R

CHILD_PREFIX = "workflow:"
SUSPEND_PREFIX = "__suspend:"
APPROVAL_PREFIX = "__approval:"
EVENT_PREFIX = "__event:"  # a wf.wait_for_event: its result names the event it took
PUBLISH_PREFIX = "__publish:"  # a wf.set_event: its result is the value published
EXPIRED = {"expired": True}  # an approval's result when its expiry elapsed first
T = TypeVar("T")  # a step's data


class Pause(BaseException):
    """Ends a pass quietly: something the workflow waits on is still in flight."""


class PassInterrupted(BaseException):
    """The broker, MongoDB or Redis failed under a pass. Not an ``Exception``, so the
    workflow body cannot swallow it: the pass ends, the run is left untouched (a step not
    sent stays ``pending`` and is sent again), and the cause goes to the orchestrator task.
    Only the workflow's own errors fail a run, never the infrastructure's."""


class ReplayHost(Protocol):
    """The writes a pass needs; implemented by the engine (``passes._PassHost``)."""

    def now_ms(self) -> int: ...

    def record_step(self, step: NewStep) -> StepState:
        """Record ``step`` (it is in the pass's table once this returns)."""
        ...

    def redispatch(self, state: StepState) -> None: ...

    def settle_sleep(self, run_id: str, step_name: str) -> bool: ...

    def ensure_child(self, parent_run_id: str, step_name: str, workflow: str, data: Any,
                     child_run_id: str) -> None: ...

    def step_definition(self, step: Any) -> StepDefinition: ...

    def step_defaults(self) -> StepDefaults:
        """The app's retries for a step that gives none (``workflow.retry``)."""
        ...

    def suspend_run(self, run_id: str, gate: str) -> bool: ...

    def expire_gate(self, run_id: str, gate: str, result: Any) -> bool:
        """Settle an approval gate whose expiry passed with ``result`` (guarded: a decision
        that landed first wins) and take a suspended run back to ``running``."""
        ...

    def should_redispatch(self, state: StepState) -> bool:
        """The step's worker died or its message was lost: send it again."""
        ...

    def run_in_place(self, step_name: str) -> StepState | None:
        """Run the step recorded just now here, at once, and return it settled; ``None``
        when it is sent instead (see ``passes._PassHost.run_in_place``)."""
        ...

    def note_waiting(self, step_names: set[str]) -> None:
        """The pass pauses at a gather waiting on these steps (``views.RunView.skips``)."""
        ...

    def run_state(self) -> tuple[Mapping[str, Any], tuple[str, ...]]:
        """The run state map as this pass knows it, and who made each write so far."""
        ...

    def write_state(self, run_id: str, writer: str, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into the run state as ``writer``'s write (a no-op if
        ``writer`` wrote before)."""
        ...

    def receive_event(self, run_id: str, gate: str, name: str, taken: list[int]
                      ) -> StepState | None:
        """Settle the event gate ``gate`` with the first event named ``name`` whose seq
        is not in ``taken``; the settled gate, or ``None`` when no such event was sent."""
        ...

    def publish(self, run_id: str, step_name: str, value: Any) -> None:
        """Settle the ``wf.set_event`` step ``step_name`` with ``value``."""
        ...


class StepCall(NamedTuple):
    """A step reached by this pass; ``wf.gather`` waits for several at once. (A tuple: a
    fan-out makes one per call per pass.)"""

    name: str
    outcome: str  # "done" | "failed" | "waiting"
    result: Any = None
    error: dict[str, Any] | None = None


class WorkflowContext:
    """The ``wf`` argument of a workflow function. Use only ``wf`` calls for effects."""

    def __init__(self, run_id: str, data: Any, steps: dict[str, StepState],
                 host: ReplayHost) -> None:
        self.run_id = run_id
        self.input = data
        self._steps = steps  # by step name; the host records new steps into it
        self._host = host
        self._reached: dict[str, int] = {}
        self._functions: dict[Any, str] = {}  # step object -> its step function's name

    @property
    def scheduled_for(self) -> datetime | None:
        """The tick that started this run (aware UTC) when a schedule did, else ``None``:
        read from the run id the tick decided (``keys.scheduled_run_id``), never stored."""
        return keys.scheduled_for(self.run_id)

    # --- steps --------------------------------------------------------------------------

    @overload  # typed by the step's function: fn(data: T) -> R, or fn(ctx, data: T) -> R
    def do(self, step_name: str, step: HasStep[[T], R], data: T, *, retries: int | None = ...,
           retry_delay: Duration | None = ..., on_error: Any = ...) -> R: ...
    @overload
    def do(self, step_name: str, step: HasStep[[Any, T], R], data: T, *,
           retries: int | None = ..., retry_delay: Duration | None = ...,
           on_error: Any = ...) -> R: ...
    @overload
    def do(self, step_name: str, step: HasStep[[None], R], *, retries: int | None = ...,
           retry_delay: Duration | None = ..., on_error: Any = ...) -> R: ...
    @overload
    def do(self, step_name: str, step: str | StepDefinition, data: Any = ..., *,
           retries: int | None = ..., retry_delay: Duration | None = ...,
           on_error: Any = ...) -> Any: ...
    def do(self, step_name: str, step: Any, data: Any = None, *, retries: int | None = None,
           retry_delay: Duration | None = None, on_error: Any = None) -> Any:
        """Run ``step`` once as step ``step_name`` and return its result; raises
        ``WorkflowRunFailedError`` when it failed for good (after ``on_error`` ran)."""
        name = self._physical(step_name)
        state = self._steps.get(name)
        if state is not None and state.status == STEP_SUCCEEDED:  # the replay's common case
            _check_same_function(self.run_id, state, self._function_of(step))
            result = state.result
            return _copied(result) if type(result) in _CONTAINERS else result
        call = self._call(name, step, data, retries=retries, retry_delay=retry_delay,
                          on_error=on_error)
        if call.outcome == "waiting" and state is None:  # recorded just now: run it here?
            ran = self._host.run_in_place(name)
            if ran is not None:
                call = self._outcome(ran)
        return self.gather(call)[0]

    def call(self, step_name: str, step: Any, data: Any = None, *, retries: int | None = None,
             retry_delay: Duration | None = None, on_error: Any = None) -> StepCall:
        """Start ``step`` without waiting: pass several to ``wf.gather`` to fan out."""
        return self._call(self._physical(step_name), step, data, retries=retries,
                          retry_delay=retry_delay, on_error=on_error)

    def _call(self, name: str, step: Any, data: Any, *, retries: int | None,
              retry_delay: Duration | None, on_error: Any) -> StepCall:
        state = self._steps.get(name)
        if state is not None:
            _check_same_function(self.run_id, state, self._function_of(step))
            return self._outcome(state)
        definition = self._host.step_definition(step)
        delay = None if retry_delay is None else to_ms(retry_delay, what="retry_delay")
        compensation = None if on_error is None else self._host.step_definition(on_error)
        state = self._record(_function_step(
            self.run_id, name, definition, data, self._host.step_defaults(), retries=retries,
            delay_ms=delay, on_error=None if compensation is None else compensation.name))
        _check_same_function(self.run_id, state, definition.name)
        return self._outcome(state)

    def gather(self, *calls: StepCall) -> list[Any]:
        """Wait for every call; a pass dispatches all of them before it pauses. The join is
        done here, by replay, not by a polling task."""
        failures = [c for c in calls if c.outcome == "failed"]
        for failed in failures:
            self._compensate(failed)
        waiting = {c.name for c in calls if c.outcome == "waiting"}
        if waiting:
            self._host.note_waiting(waiting)
            raise Pause
        if failures:
            first = failures[0]
            error = first.error or {}
            raise WorkflowRunFailedError(
                f"step {first.name!r} failed: {error.get('type', 'Error')}: "
                f"{error.get('message', '')}", error=error)
        return [c.result for c in calls]

    def sleep(self, step_name: str, duration: Duration) -> None:
        """Wait ``duration`` durably: no worker is held, and it survives restarts."""
        wait_ms = to_ms(duration, what=f"sleep {step_name!r}")
        name = self._physical(step_name)
        state = self._steps.get(name)
        if state is None:
            state = self._record(NewStep(
                run_id=self.run_id, step_name=name, function=None, data={"sleep_ms": wait_ms},
                status=STEP_SCHEDULED, due_ms=self._host.now_ms() + wait_ms))
        _check_same_function(self.run_id, state, None)
        if state.status == STEP_SUCCEEDED:
            return
        if state.status == STEP_SCHEDULED and self._host.settle_sleep(self.run_id, name):
            return
        raise Pause

    def child(self, step_name: str, workflow: str | Callable[..., Any], data: Any = None) -> Any:
        """Run a child workflow as one step and return its output; its failure or
        cancellation is raised here as ``WorkflowRunFailedError``."""
        workflow_name = workflow if isinstance(workflow, str) else getattr(
            getattr(workflow, "pikku_workflow", None), "name", getattr(workflow, "__name__", ""))
        name = self._physical(step_name)
        child_run_id = keys.child_run_id(self.run_id, name)
        function = CHILD_PREFIX + workflow_name
        state = self._steps.get(name)
        if state is None:
            state = self._record(NewStep(
                run_id=self.run_id, step_name=name, function=function, data=data,
                status=STEP_RUNNING, child_run_id=child_run_id))
        _check_same_function(self.run_id, state, function)
        if state.status == STEP_RUNNING:  # the recorded id: one derived before an upgrade too
            self._host.ensure_child(self.run_id, name, workflow_name, state.data,
                                    state.child_run_id or child_run_id)
        return self.gather(self._outcome(state))[0]

    def suspend(self, reason: str) -> None:
        """Suspend the run here until ``pikku.resume(run_id)``: the run is recorded
        ``suspended``, no worker waits, and replay passes stop at this point until then."""
        name = self._physical(SUSPEND_PREFIX + reason)  # a loop suspends every time
        state = self._steps.get(name)
        if state is None:
            state = self._record(NewStep(run_id=self.run_id, step_name=name, function=None,
                                         data={"reason": reason}, status=STEP_SCHEDULED))
        if state.status == STEP_SUCCEEDED:
            return
        if not self._host.suspend_run(self.run_id, name):
            return  # resumed while this pass was suspending the run: the gate is open
        raise Pause

    def approval(self, name: str, *, schema: dict[str, Any] | bool | None = None,
                 expiry: Duration | None = None, approvers: Iterable[str] | None = None
                 ) -> Any:
        """Suspend the run here until ``pikku.approve(run_id, name, decision, by=...)``
        records a decision, and return the decision. ``schema`` (a JSON Schema) and
        ``approvers`` (who may decide) are checked by ``approve``, which refuses what does
        not match and leaves the run suspended. Once ``expiry`` has elapsed with no
        decision, the result is ``{"expired": True}``. The gate is stored with the run, so
        ``approve`` can check a decision without the workflow's code."""
        step = self._physical(APPROVAL_PREFIX + name)
        state = self._steps.get(step)
        if state is None:
            allowed = None if approvers is None else _approvers(name, approvers)
            if schema is not None:
                _check_schema(name, schema)
            due = None
            if expiry is not None:
                due = self._host.now_ms() + to_ms(expiry, what=f"approval {name!r} expiry")
            state = self._record(NewStep(
                run_id=self.run_id, step_name=step, function=None,
                # The schema as JSON text: a JSON Schema's own keys ($schema, $ref, $defs,
                # property names with dots) are not keys MongoDB stores.
                data={"approval": name, "schema_json": None if schema is None
                      else json.dumps(schema, sort_keys=True),
                      "approvers": allowed, "expires_at_ms": due},
                status=STEP_SCHEDULED, due_ms=due))
        _check_same_function(self.run_id, state, None)
        if state.status == STEP_SUCCEEDED:
            return _copied(state.result)
        if (state.status == STEP_SCHEDULED and state.due_at is not None
                and state.due_at.timestamp() * 1000 <= self._host.now_ms()
                and self._host.expire_gate(self.run_id, step, dict(EXPIRED))):
            return dict(EXPIRED)
        if state.status == STEP_FAILED:  # fenced by a cancel: the run is ending
            raise Pause
        if not self._host.suspend_run(self.run_id, step):
            return _copied(self._steps[step].result)  # decided while this pass suspended
        raise Pause

    # --- events -----------------------------------------------------------------------------

    def wait_for_event(self, name: str, *, timeout: Duration | None = None,
                       default: Any = None) -> Any:
        """Wait for the next event ``name`` sent to this run (``pikku.send_event``) and
        return its payload; ``default`` once ``timeout`` has passed with none. Events sent
        before the run waits are kept, and each wait takes the first one not taken yet, in
        the order they were sent. The run waits ``suspended``, holding no worker."""
        check_event_name("event name", name)
        gate = self._physical(EVENT_PREFIX + name)
        state = self._steps.get(gate)
        if state is None:
            due = None
            if timeout is not None:
                due = self._host.now_ms() + to_ms(timeout, what=f"event {name!r} timeout")
            state = self._record(NewStep(
                run_id=self.run_id, step_name=gate, function=None,
                data={"event": name, "expires_at_ms": due}, status=STEP_SCHEDULED,
                due_ms=due))
        _check_same_function(self.run_id, state, None)
        if state.status == STEP_SUCCEEDED:
            return _payload(state, default)
        if state.status == STEP_FAILED:  # fenced by a cancel: the run is ending
            raise Pause
        received = self._host.receive_event(self.run_id, gate, name, events_taken(self._steps))
        if received is not None:
            return _payload(received, default)
        if (state.due_at is not None
                and state.due_at.timestamp() * 1000 <= self._host.now_ms()
                and self._host.expire_gate(self.run_id, gate, {"event": name,
                                                               "timed_out": True})):
            return _copied(default)
        if not self._host.suspend_run(self.run_id, gate):
            return _payload(self._steps[gate], default)  # settled while this pass suspended
        raise Pause

    def set_event(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` for callers to read (``pikku.get_event``): the
        latest value set under a key is the one read. Durable before this returns, and a
        replay that reaches the same call again changes nothing."""
        check_event_name("event key", key)
        step = self._physical(PUBLISH_PREFIX + key)
        state = self._steps.get(step)
        if state is None:
            state = self._record(NewStep(run_id=self.run_id, step_name=step, function=None,
                                         data={"publish": key}, status=STEP_SCHEDULED))
        _check_same_function(self.run_id, state, None)
        if state.status == STEP_SCHEDULED:
            self._host.publish(self.run_id, step, value)

    # --- run state ------------------------------------------------------------------------

    @property
    def state(self) -> dict[str, Any]:
        """A copy of the run state: the small map of shared values graph nodes write (see
        ``set_state``), as of this point of the pass."""
        values, _ = self._host.run_state()
        return _copied(dict(values))  # type: ignore[no-any-return]

    def set_state(self, writer: str, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into the run state, once: ``writer`` names the write, and a
        replay that reaches the same write again (by the same name) changes nothing. Each
        write is durable before this returns and bumps the run's ``state_version``."""
        check_state_write(writer, values, {})
        if writer not in self._host.run_state()[1]:
            self._host.write_state(self.run_id, writer, values)

    def cancel(self, reason: str | None = None) -> None:
        """End the run as ``cancelled`` from inside the workflow."""
        raise WorkflowCancelledError(self.run_id, reason)

    # --- internals ------------------------------------------------------------------------

    def _physical(self, step_name: str) -> str:
        """The N-th reach of a name in one pass is ``name#N``: loops get their own steps,
        and every pass resolves them to the same rows."""
        count = self._reached.get(step_name, 0) + 1
        self._reached[step_name] = count
        return step_name if count == 1 else f"{step_name}#{count}"

    def _record(self, step: NewStep) -> StepState:
        return self._host.record_step(step)

    def _function_of(self, step: Any) -> str:
        """The name of ``step``'s step function, looked up once per step object a pass."""
        try:
            return self._functions[step]
        except (KeyError, TypeError):
            name = self._host.step_definition(step).name
            with contextlib.suppress(TypeError):  # unhashable: looked up every time
                self._functions[step] = name
            return name

    def _outcome(self, state: StepState) -> StepCall:
        if state.status == STEP_SUCCEEDED:
            return StepCall(state.step_name, "done", result=_copied(state.result))
        if state.status == STEP_FAILED and state.due_at is None:
            return StepCall(state.step_name, "failed", error=_copied(state.error))
        if self._host.should_redispatch(state):
            self._host.redispatch(state)  # a dead worker or a lost message: claims decide
        return StepCall(state.step_name, "waiting")

    def _compensate(self, failed: StepCall) -> None:
        state = self._steps[failed.name]
        if state.on_error is None:
            return
        name = f"{failed.name}:on_error"
        comp = self._steps.get(name)
        if comp is None:
            comp = self._record(_function_step(
                self.run_id, name, self._host.step_definition(state.on_error),
                {"error": state.error, "data": state.data}, self._host.step_defaults()))
        if self._outcome(comp).outcome == "waiting":
            raise Pause


def _function_step(run_id: str, name: str, definition: StepDefinition, data: Any,
                   defaults: StepDefaults, *, retries: int | None = None,
                   delay_ms: int | None = None, on_error: str | None = None) -> NewStep:
    """A step of a function as replay first records it: its attempts from one call's
    ``retries`` or its definition, and whether its body's error is tried again."""
    return NewStep(
        run_id=run_id, step_name=name, function=definition.name, data=data,
        max_attempts=definition.max_attempts(defaults) if retries is None else (
            check_retries(retries, f"step {name!r}") + 1),
        retry_delay_ms=-1 if delay_ms is None else delay_ms, on_error=on_error,
        errors_retried=retries is not None or definition.retry.errors_retried(defaults))


def _check_same_function(run_id: str, state: StepState, function: str | None) -> None:
    if state.function != function:
        raise WorkflowReplayError(
            f"run {run_id}: step {state.step_name!r} was recorded as {state.function!r} but "
            f"the workflow now reaches {function!r} there; the workflow's code changed under "
            "a running run in a way replay cannot follow")


def _payload(state: StepState, default: Any) -> Any:
    """What a settled event gate gives the workflow: the event's payload, or ``default``
    when it timed out."""
    result = state.result if isinstance(state.result, dict) else {}
    if result.get("timed_out"):
        return _copied(default)
    return _copied(result.get("payload"))


def _approvers(name: str, approvers: Iterable[str]) -> list[str]:
    if isinstance(approvers, str):
        approvers = [approvers]
    allowed = list(approvers)
    if not allowed or not all(isinstance(a, str) and a for a in allowed):
        raise InvalidInputError(f"approval {name!r}: approvers must be non-empty strings, "
                                f"got {allowed!r}")
    return allowed


def _check_schema(name: str, schema: Any) -> None:
    """A bad schema fails the run where the workflow declares it, not at every decision."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidInputError(f"approval {name!r}: schema is not a valid JSON Schema: "
                                f"{exc.message}") from None


_CONTAINERS = (dict, list)


def _copied(value: Any) -> Any:
    """A copy of a stored (JSON-shaped) value, so the workflow cannot change the table's."""
    kind = type(value)
    if kind is dict:
        return {key: _copied(item) for key, item in value.items()}
    if kind is list:
        return [_copied(item) for item in value]
    return value


def events_taken(steps: Mapping[str, StepState]) -> list[int]:
    """The seqs of the events a run's waits took (``steps``: the run's, by name): a run's
    seqs are unique over all its events, so one list serves every name. Only waits the run
    settled count: a wait a fork copied (``forked_from``) holds an event of the source
    run, whose seq would hide the run's own event of that seq (issue 31, defect 2; a fork
    made before copies dropped the seq still has it in its result)."""
    return [s.result["seq"] for name, s in steps.items()
            if name.startswith(EVENT_PREFIX) and s.status == STEP_SUCCEEDED
            and s.forked_from is None
            and isinstance(s.result, dict) and isinstance(s.result.get("seq"), int)]
