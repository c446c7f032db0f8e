"""OpenTelemetry traces of runs (``pip install pikku-celery[otel]``): one trace per run,
whichever processes run its parts.

As instrumentation libraries do, pikku uses ``opentelemetry-api`` alone and the global
tracer provider: its spans appear whenever the application configures an SDK (the inline
test kit included), and cost one provider check per event when none is configured.

The spans of a run (names are low-cardinality; what varies is in attributes):

- ``pikku.start <workflow>``: recorded by the process that creates the run, as a child of
  the caller's current span (a web request's), and ended at once. Its context is saved with
  the run (``WorkflowRun.trace``), so every other span of the run, in any process, at any
  time, is its descendant: that is what makes one trace of a run.
- ``pikku.pass <workflow>``: one orchestration pass, current while it runs, so the steps it
  runs in place are its children.
- ``pikku.step <function>``: one step attempt, from its claim to its settle (a step run in
  place: to the write that settles it, which travels with the next step's claim), current
  while its body runs, so the body's own instrumented calls are its children.
- ``pikku.run <workflow>``: the run from its creation to its end. A span cannot start in
  one process and end in another, so the process that ends the run records it then, with
  the run's creation as its start time, as a child of ``pikku.start``.

A pass or attempt is the child of the span current when it begins when that span is in the
run's trace: the pass that runs a step in place, or Celery's own task span
(``opentelemetry-instrumentation-celery``) for a message a pass of the run sent. Otherwise
it is the child of the run's saved context, and a current span of another trace (Celery's
task span for a message the reaper sent) is linked to it: a run is always one trace.

The spans this thread opened are kept on its own stack (``_Thread``), which decides the
nesting; OpenTelemetry's current context is only attached so that what runs inside a span
(a body's own calls) finds it. The engine runs each step in place inside a copied
``contextvars.Context`` while the pass around it runs in the thread's own, and an attempt's
end may be reported in either: a context attached in one Context cannot be detached from
another (OpenTelemetry logs "Failed to detach context"), so such an attachment is undone
the next time that Context is current here (``_Thread.stale``), never across.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from pikku_celery.engine import protocols
from pikku_celery.observe import Observer, trace_messages

log = logging.getLogger("pikku_celery")

SCOPE = "pikku_celery"
#: Attribute names (``pikku.*``), for queries and dashboards.
RUN_ID, WORKFLOW, STEP, FUNCTION = "pikku.run_id", "pikku.workflow", "pikku.step", "pikku.function"
ATTEMPT, MAX_ATTEMPTS, OUTCOME = "pikku.attempt", "pikku.max_attempts", "pikku.outcome"
IN_PLACE, SUPERSEDED, LEASE_LOST = "pikku.in_place", "pikku.superseded", "pikku.lease_lost"
TASK_ID, WORKER, CURRENT_ATTEMPT = "pikku.task_id", "pikku.worker", "pikku.current_attempt"
MARK, PARENT_RUN_ID, STATUS = "pikku.pass.mark", "pikku.parent_run_id", "pikku.run.status"
#: The outcome of an attempt whose end was never reported in a live process (an exception
#: that is not an ``Exception``, like a time limit, escaped its body).
ABANDONED = "abandoned"
#: How many runs' trace contexts a process remembers (least recently used go first).
CACHED_RUNS = 4096


def install(pikku: Any) -> Observer | None:
    """The tracing observer of ``pikku``, or ``None`` without ``opentelemetry-api``. It also
    makes the engine save the caller's trace context with every run it creates."""
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return None
    protocols.trace_context = _capture
    return Tracing(pikku)


# --- the tracer, when an SDK is configured ----------------------------------------------

class _Api:
    """The OpenTelemetry names the observer uses, looked up once when tracing is first
    checked (the module imports cleanly without OpenTelemetry; an import statement in every
    handler cost a ``sys.modules`` lookup per name and event)."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.get_current = context.get_current
        self.attach = context.attach
        self.detach = context.detach
        self.set_span_in_context = trace.set_span_in_context
        self.get_current_span = trace.get_current_span
        self.non_recording = trace.NonRecordingSpan
        self.link = trace.Link
        self.status = Status
        self.error = StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()


class _Provider:
    """The global tracer provider's tracer, or ``None`` while no SDK is configured (none set,
    or the API's no-op provider): checked on every event by identity, so a provider set
    later (in a prefork child's ``worker_process_init``) is picked up, and so is one a test
    sets.

    The check reads the API's global itself (``opentelemetry.trace._TRACER_PROVIDER``):
    ``trace.get_tracer_provider()`` looks the environment up on every call while none is
    set (microseconds under load), which would be the whole cost of tracing left off. Where
    a later API names it otherwise, the public call is used."""

    def __init__(self) -> None:
        self._provider: object = None
        self._tracer: Any = None
        self._module: Any = None

    def tracer(self) -> Any:
        module = self._module
        if module is None:
            global _API
            _API = _Api()
            module = _API.trace
            module.get_tracer_provider()  # one provider named by the environment: set now
            self._module = module
        provider: Any = getattr(module, "_TRACER_PROVIDER", _PUBLIC)
        if provider is _PUBLIC:
            provider = module.get_tracer_provider()
        if provider is not self._provider:
            off = provider is None or isinstance(
                provider, (module.ProxyTracerProvider, module.NoOpTracerProvider))
            self._tracer = None if off else provider.get_tracer(SCOPE)
            self._provider = provider
        return self._tracer


_PUBLIC = object()  # the API's global is not where this module reads it
_PROVIDER = _Provider()
_API: _Api = None  # type: ignore[assignment]  # set by the first ``_PROVIDER.tracer()``
#: How many attachments left in another ``contextvars.Context`` a thread remembers (their
#: Context is usually gone with the pass that copied it; see ``_Thread.stale``).
STALE_KEPT = 16


class _Thread(threading.local):
    """What one thread keeps between a span's start and its end."""

    def __init__(self) -> None:
        #: The spans this thread opened and has not ended, innermost last: their nesting.
        self.stack: list[_Frame] = []
        #: Spans ended while their context was attached in another ``contextvars.Context``
        #: than the one current here (a step run in place runs in a copy of the pass's, and
        #: its end may be reported in the pass's): undone when that Context is current
        #: here again, or dropped with the pass they ran in.
        self.stale: list[_Frame] = []
        #: The attempt of a step sent as its own task whose settle went with the pass after
        #: it: detached when that pass began (the pass is not its child, as before), ended
        #: when its settle lands inside the pass.
        self.handed: dict[tuple[Any, ...], _Frame] = {}
        #: The ``pikku.start`` span of the run being created and the context saved with
        #: the run, until ``run_started``.
        self.starting: tuple[str, Any, dict[str, str]] | None = None


_local = _Thread()


def _capture(run_id: str, workflow: str) -> dict[str, str] | None:
    """``protocols.trace_context``: start the run's ``pikku.start`` span under the caller's
    current span and return its context as the W3C map saved with the run. The span ends
    when the run is reported created (``run_started``); a start that created nothing (the
    run existed) never ends it, and it is never exported."""
    tracer = _PROVIDER.tracer()
    if tracer is None:
        return None
    api = _API
    span = tracer.start_span(f"pikku.start {workflow}",
                             attributes={RUN_ID: run_id, WORKFLOW: workflow})
    carrier: dict[str, str] = {}
    api.propagator.inject(carrier, context=api.set_span_in_context(span))
    _local.starting = (run_id, span, carrier)
    return carrier


# --- where a run's spans hang ------------------------------------------------------------

class _RunInfo:
    __slots__ = ("context", "workflow")

    def __init__(self, context: Any, workflow: str | None) -> None:
        self.context = context  # the run's saved SpanContext (None: no trace was saved)
        self.workflow = workflow


class _RunContexts:
    """Each run's saved trace context, as this process last learnt it: from the start it
    recorded, else read once from the store (one run read per run and process, and only
    while tracing is on), kept for the ``CACHED_RUNS`` most recent runs."""

    def __init__(self, read_run: Callable[[str], Any]) -> None:
        self._read_run = read_run
        self._runs: OrderedDict[str, _RunInfo] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, run_id: str, info: _RunInfo,
                 carrier: Mapping[str, str] | None) -> None:
        with self._lock:
            self._runs[run_id] = info
            self._runs.move_to_end(run_id)
            while len(self._runs) > CACHED_RUNS:
                self._runs.popitem(last=False)
        trace_messages.know(run_id, carrier, info.workflow)  # carried by its messages

    def get(self, run_id: str) -> _RunInfo:
        with self._lock:
            info = self._runs.get(run_id)
            if info is not None:
                self._runs.move_to_end(run_id)
                return info
        carried = trace_messages.carried(run_id)  # in the message the task runs for
        if carried is not None:
            info = _RunInfo(_extract(carried[0]), carried[1])
            self.remember(run_id, info, carried[0])
            return info
        try:
            run = self._read_run(run_id)
        except Exception:  # the store is down: the span goes on without its parent
            log.debug("pikku: no trace context read for run %s", run_id, exc_info=True)
            return _RunInfo(None, None)
        carrier = run.trace if run is not None else None
        info = _RunInfo(_extract(carrier), run.workflow if run is not None else None)
        self.remember(run_id, info, carrier)
        return info


def _extract(carrier: Mapping[str, str] | None) -> Any:
    if not carrier:
        return None
    api = _API
    context = api.get_current_span(api.propagator.extract(dict(carrier))).get_span_context()
    return context if context.is_valid else None


# --- the observer ------------------------------------------------------------------------

class _Frame:
    """A span this thread opened and attached as current, until its end is reported."""

    __slots__ = ("attached", "in_place", "info", "key", "parent", "span", "token")

    def __init__(self, key: tuple[Any, ...], span: Any, token: Any, attached: Any,
                 in_place: bool, info: _RunInfo, parent: _Frame | None) -> None:
        self.key = key
        self.span = span
        self.token = token
        self.attached = attached  # the OpenTelemetry context attached: the span current
        self.in_place = in_place
        self.info = info
        self.parent = parent  # the frame it was opened in (its pass, for a step in place)


class Tracing:
    """The observer: opens a span at each ``..._started``, ends it at its end."""

    def __init__(self, pikku: Any) -> None:
        self._runs = _RunContexts(lambda run_id: pikku.engine.store.get_run(run_id))
        self._handlers: dict[str, Callable[[Any, str, dict[str, Any]], None]] = {
            "run_started": self._run_started,
            "run_finished": self._run_finished,
            "pass_started": self._pass_started,
            "pass_finished": self._pass_finished,
            "step_attempt_started": self._attempt_started,
            "step_attempt_finished": self._attempt_finished,
            "step_attempt_superseded": self._attempt_superseded,
        }

    def __call__(self, event: str, sender: str, fields: dict[str, Any]) -> None:
        handler = self._handlers.get(event)
        if handler is None:
            return
        tracer = _PROVIDER.tracer()
        if tracer is None:
            return
        handler(tracer, sender, fields)

    # --- runs ---------------------------------------------------------------------------

    def _run_started(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        run_id = fields["run_id"]
        starting = _local.starting
        if starting is None or starting[0] != run_id:
            return  # created while tracing was off
        _local.starting = None
        span = starting[1]
        if fields.get("parent_run_id"):
            span.set_attribute(PARENT_RUN_ID, fields["parent_run_id"])
        span.end()
        self._runs.remember(run_id, _RunInfo(span.get_span_context(), fields.get("workflow")),
                            starting[2])

    def _run_finished(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        api = _API
        run_id, workflow = fields["run_id"], fields.get("workflow") or sender
        info = self._runs.get(run_id)
        context = (api.set_span_in_context(api.non_recording(info.context))
                   if info.context is not None else None)
        now = time.time_ns()
        duration_ns = int(float(fields.get("duration") or 0.0) * 1e9)
        status = fields.get("status")
        span = tracer.start_span(f"pikku.run {workflow}", context=context,
                                 start_time=now - duration_ns,
                                 attributes={RUN_ID: run_id, WORKFLOW: workflow,
                                             STATUS: str(status), OUTCOME: str(status)})
        if status == "failed":
            span.set_status(api.status(api.error, _describe(fields.get("error"))))
        span.end(end_time=now)

    # --- passes -------------------------------------------------------------------------

    def _pass_started(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        state = _local
        run_id = fields["run_id"]
        _hand_on(state, run_id, fields.get("mark"))
        _abandon_sent_attempts(state)
        info = self._runs.get(run_id)
        workflow = fields.get("workflow") or info.workflow or ""
        attributes = {RUN_ID: run_id, MARK: str(fields.get("mark"))}
        if workflow:
            attributes[WORKFLOW] = workflow
        name = f"pikku.pass {workflow}" if workflow else "pikku.pass"
        span = self._open(tracer, state, ("pass", run_id), name, attributes, info,
                          in_place=True)
        if info.context is None:
            # A run created while tracing was off: its later spans in this process join
            # the trace its first pass here began.
            info = _RunInfo(span.get_span_context(), workflow or None)
            state.stack[-1].info = info
            self._runs.remember(run_id, info, None)  # nothing saved: nothing to carry

    def _pass_finished(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        state = _local
        frame = _close(state, ("pass", fields["run_id"]))
        if frame is None:
            return
        if state.stale:  # attachments in the Context this pass's steps ran in: gone with it
            state.stale = [f for f in state.stale if f.parent is not frame]
        outcome = str(fields.get("outcome"))
        span = frame.span
        span.set_attributes({OUTCOME: outcome, LEASE_LOST: outcome == "lost"})
        if outcome == "error":
            span.set_status(_API.status(_API.error, "an exception escaped the pass"))
        span.end()

    # --- attempts -----------------------------------------------------------------------

    def _attempt_started(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        state = _local
        _abandon_attempts(state)  # attempts never nest: one still open here never ended
        run_id = fields["run_id"]
        stack = state.stack
        if stack and stack[-1].key == ("pass", run_id):
            info = stack[-1].info  # run in place by its pass: the run is known
        else:
            info = self._runs.get(run_id)
        in_place = bool(fields.get("in_place"))
        function = fields.get("function") or sender
        attributes: dict[str, Any] = {
            RUN_ID: run_id, STEP: fields["step_name"], FUNCTION: function,
            ATTEMPT: fields["attempt"], MAX_ATTEMPTS: fields.get("max_attempts") or 0,
            IN_PLACE: in_place, SUPERSEDED: False, LEASE_LOST: False}
        workflow = fields.get("workflow") or info.workflow
        if workflow:
            attributes[WORKFLOW] = workflow
        task_id, worker = fields.get("task_id"), fields.get("worker")
        if task_id:
            attributes[TASK_ID] = str(task_id)
        if worker:
            attributes[WORKER] = str(worker)
        self._open(tracer, state, _attempt_key(fields), f"pikku.step {function}", attributes,
                   info, in_place=in_place)

    def _attempt_finished(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        frame = _close(_local, _attempt_key(fields))
        if frame is None:
            return
        span = frame.span
        status = str(fields.get("status"))
        if fields.get("lease_lost"):
            span.set_attributes({OUTCOME: status, LEASE_LOST: True})
        else:
            span.set_attributes({OUTCOME: status})
        if status == "failed":
            error = fields.get("error")
            span.set_status(_API.status(_API.error, _describe(error)))
            exception = fields.get("exception")
            if isinstance(exception, BaseException):
                span.record_exception(exception)
            elif isinstance(error, Mapping):
                span.add_event("exception", {"exception.type": str(error.get("type")),
                                             "exception.message": str(error.get("message"))})
        span.end()

    def _attempt_superseded(self, tracer: Any, sender: str, fields: dict[str, Any]) -> None:
        frame = _close(_local, _attempt_key(fields))
        if frame is None:
            return
        # Not an error: a later attempt (or the run's end) owns the step, and this attempt's
        # outcome changed nothing. A later attempt means its lease lapsed (only then is a
        # step reclaimed); the same attempt, that the step was fenced (a cancel, the run's
        # end).
        attributes: dict[str, Any] = {OUTCOME: "superseded", SUPERSEDED: True}
        current = fields.get("current_attempt")
        if current is not None:
            attributes[CURRENT_ATTEMPT] = int(current)
        lost = fields.get("lease_lost")
        if lost is None:
            lost = current is not None and int(current) > int(fields["attempt"])
        attributes[LEASE_LOST] = bool(lost)
        frame.span.set_attributes(attributes)
        frame.span.end()

    # --- spans --------------------------------------------------------------------------

    def _open(self, tracer: Any, state: _Thread, key: tuple[Any, ...], name: str,
              attributes: dict[str, Any], info: _RunInfo, *, in_place: bool) -> Any:
        """Start a span, as the child of what this thread's stack says, and attach it."""
        api = _API
        if state.stale:
            _undo_stale(state)
        stack = state.stack
        current = api.get_current()
        parent = current
        links = None
        if stack:
            # Nested in one of ours (a step run in place in its pass): that span is the
            # parent, whichever Context this runs in, unless a live span of the same trace
            # was opened inside it (a body's own span around an inline run).
            top = stack[-1]
            if current is not top.attached:
                inner = api.get_current_span(current)
                if not (inner.is_recording() and inner.get_span_context().trace_id
                        == top.span.get_span_context().trace_id):
                    parent = api.set_span_in_context(top.span, current)
        else:
            context = api.get_current_span(current).get_span_context()
            if context.is_valid and (info.context is None
                                     or context.trace_id == info.context.trace_id):
                pass  # in someone else's span of the run's trace: Celery's task span
            elif info.context is not None:
                # The run's saved context; a span of another trace that is current
                # (Celery's task span for a message sent outside the run's spans, by the
                # reaper, say) is linked, so the run stays one trace and that span still
                # finds it.
                parent = api.set_span_in_context(api.non_recording(info.context), current)
                if context.is_valid:
                    links = [api.link(context)]
        span = tracer.start_span(name, context=parent, links=links, attributes=attributes)
        attached = api.set_span_in_context(span, parent)
        stack.append(_Frame(key, span, api.attach(attached), attached, in_place, info,
                            stack[-1] if stack else None))
        return span


def _attempt_key(fields: dict[str, Any]) -> tuple[Any, ...]:
    return ("step", fields["run_id"], fields["step_name"], fields["attempt"])


def _close(state: _Thread, key: tuple[Any, ...]) -> _Frame | None:
    """Take the frame of ``key`` off this thread's stack (those opened above it and never
    ended are ended as abandoned) and detach its context; ``None`` when it is not there
    (opened before tracing was on)."""
    stack = state.stack
    for index in range(len(stack) - 1, -1, -1):
        if stack[index].key == key:
            break
    else:
        return state.handed.pop(key, None)  # detached already
    while len(stack) > index + 1:
        _end_abandoned(state, stack.pop())
    frame = stack.pop()
    _detach(state, frame)
    return frame


def _detach(state: _Thread, frame: _Frame) -> None:
    """Undo ``frame``'s attachment if it was made in the Context current now; if it was made
    in another (a step run in place: its end reported from the pass's Context), keep it to
    undo when that Context is current here again (``_undo_stale``): OpenTelemetry's
    ``detach`` would log an error and change nothing."""
    token = frame.token
    if type(token) is not contextvars.Token:  # another runtime context than the API's
        _API.detach(token)
        return
    try:
        token.var.reset(token)
    except ValueError:  # "created in a different Context"
        stale = state.stale
        if len(stale) >= STALE_KEPT:
            del stale[0]
        stale.append(frame)
    except RuntimeError:  # already undone
        pass


def _undo_stale(state: _Thread) -> None:
    """Undo the attachments of ended spans that are current in this Context (the Context of
    the pass's steps run in place, when the next step begins there), newest first."""
    stale = state.stale
    current = _API.get_current()
    for index in range(len(stale) - 1, -1, -1):
        frame = stale[index]
        if frame.attached is current:
            del stale[index]
            try:
                frame.token.var.reset(frame.token)
            except (ValueError, RuntimeError):
                continue
            current = _API.get_current()


def _abandon_attempts(state: _Thread) -> None:
    stack = state.stack
    while stack and stack[-1].key[0] == "step":
        _end_abandoned(state, stack.pop())


def _hand_on(state: _Thread, run_id: str, mark: object) -> None:
    """A pass of ``run_id`` begins for step ``mark`` while that step's attempt (sent as its
    own task) is open on this thread: the attempt handed its settle to this pass. Detach it
    and keep it aside (``_Thread.handed``) until its settle lands; any attempt kept aside
    before never heard of its settle, and is ended as abandoned."""
    for frame in state.handed.values():
        frame.span.set_attributes({OUTCOME: ABANDONED})
        frame.span.end()
    state.handed.clear()
    stack = state.stack
    if not stack:
        return
    top = stack[-1]
    if top.key[0] == "step" and not top.in_place and top.key[1:3] == (run_id, mark):
        stack.pop()
        _detach(state, top)
        state.handed[top.key] = top


def _abandon_sent_attempts(state: _Thread) -> None:
    """A pass never begins inside the attempt of a step sent as its own task (the pass that
    continues after it takes its settle: ``_hand_on``): such an attempt still open never
    ended."""
    stack = state.stack
    while stack and stack[-1].key[0] == "step" and not stack[-1].in_place:
        _end_abandoned(state, stack.pop())


def _end_abandoned(state: _Thread, frame: _Frame) -> None:
    _detach(state, frame)
    frame.span.set_attributes({OUTCOME: ABANDONED})
    frame.span.end()


def _describe(error: Any) -> str:
    if isinstance(error, Mapping):
        return f"{error.get('type')}: {error.get('message')}"[:500]
    return "" if error is None else str(error)[:500]
