"""The Celery side: step tasks, pikku's own tasks, the dispatcher, the in-worker reaper.

Thin by design: each task validates its message, calls the engine, and maps outcomes to
Celery's vocabulary. A superseded step ends with ``WorkflowStepSupersededError`` recorded as
its task state (declared in ``Task.throws``, so Celery logs it without a traceback) and its
message acknowledged; a duplicate delivery the claim refuses ends with ``Ignore`` (acked,
no state written). A body error with attempts left ends the task as RETRY (``Retry`` raised,
not ``task.retry()``: Celery records the state, logs one INFO line and acknowledges the
message, but sends nothing; pikku logs one WARNING line), since the next attempt is scheduled
by the workflow, never by Celery's ``max_retries``. A body error with no attempts left is
re-raised, so the attempt shows as FAILURE.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from celery.exceptions import Ignore, Retry

from pikku_celery.engine import sweep_hooks
from pikku_celery.model import keys
from pikku_celery.model.errors import (
    InvalidInputError,
    LeaseLostError,
    LeaseTakenError,
    WorkflowRunNotFoundError,
    WorkflowStepSupersededError,
)
from pikku_celery.model.validate import check_name

# Imported with the tasks, before a worker starts: ``celery_events`` connects
# ``worker_init`` (read before the pool forks), ``logs`` puts its filter on pikku's loggers.
from pikku_celery.observe import celery_events, logs  # noqa: F401
from pikku_celery.store._concerns import deadline
from pikku_celery.worker.backend import record_attempt
from pikku_celery.worker.config import task_namespace
from pikku_celery.worker.pool_limits import enforces_time_limits

if TYPE_CHECKING:
    from pikku_celery.engine.execution import StepOutcome
    from pikku_celery.engine.facade import Engine

log = logging.getLogger("pikku_celery")
Route = Callable[[str, tuple[Any, ...], Any], dict[str, Any]]

# The kinds of pikku's own tasks. Each app names them ``<namespace>.<kind>`` (the setting
# ``pikku_task_namespace``, default ``pikku.<main>``: ``internal_task_names``), so a worker
# of another app never runs one: a message it takes from a shared queue is refused there
# as an unregistered task, never run against the wrong app's engine.
ORCHESTRATE_KIND = "orchestrate"
TIMER_KIND = "timer"
REAP_KIND = "reap"
INTERNAL_KINDS = (ORCHESTRATE_KIND, TIMER_KIND, REAP_KIND)
# The names every app used before namespaces (``pikku_task_namespace = "pikku"`` keeps
# them); not the names of an app's tasks otherwise.
ORCHESTRATE = "pikku.orchestrate"
TIMER = "pikku.timer"
REAP = "pikku.reap"
_NAMES_ATTR = "_pikku_task_names"  # on the Celery app, once its tasks are registered
RUN_LEASE_RETRY_S = 1.0
# The shortest deadline of a reaper sweep (and of its service probe): long enough to ride out
# an election (pymongo waits 5 s for a server by default), so a routine failover is not a
# failed sweep; bounded, so a primary that stopped answering cannot hold the reaper.
SWEEP_DEADLINE_MIN_S = 10.0
# No ``queue`` here: a task attribute would beat the user's ``task_routes``. pikku's own
# queue, when configured, is chosen per message (routing.py), after the user's routing.
STEP_TASK_DEFAULTS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "serializer": "json",
    "throws": (WorkflowStepSupersededError,),
}


_NO_STEP = object()


def internal_task_names(app: Celery) -> dict[str, str]:
    """The names of ``app``'s own pikku tasks, for routing (``task_routes``, ``-X``,
    monitoring): ``{"orchestrate": ..., "timer": ..., "reap": ...}``, each
    ``<namespace>.<kind>`` where the namespace is the ``pikku_task_namespace`` setting
    (default ``pikku.<main>``, ``pikku`` for an app without a main name or ``__main__``).
    Once the app is finalized, the names its tasks were registered under; before, the
    names the configuration gives now."""
    registered: dict[str, str] | None = getattr(app, _NAMES_ATTR, None)
    if registered is not None:
        return dict(registered)
    namespace = task_namespace(app)
    return {kind: f"{namespace}.{kind}" for kind in INTERNAL_KINDS}


def internal_task(app: Celery, kind: str) -> Task:
    """``app``'s own pikku task of ``kind`` (``"orchestrate"``, ``"timer"``, ``"reap"``),
    finalizing the app first (its tasks, and so their names, are made then)."""
    tasks = app.tasks
    return tasks[internal_task_names(app)[kind]]


def check_message(run_id: object, step_name: object = _NO_STEP) -> None:
    """A forged or malformed message is refused before it touches Redis or the store: its
    names must be names the store could hold (``check_name``), so a forged message with a
    500 KB step name never becomes a 500 KB lease key."""
    try:
        check_name("run id", run_id)
        if step_name is not _NO_STEP:
            check_name("step name", step_name)
    except InvalidInputError as exc:
        raise InvalidInputError(f"malformed pikku message: {exc}") from None


class CeleryDispatcher:
    """Sends engine work as Celery messages; long waits are chained, never one long ETA."""

    def __init__(self, app: Celery, engine_ref: Callable[[], Engine], max_countdown_s: float,
                 route: Route | None = None) -> None:
        self._app = app
        self._engine = engine_ref
        self.max_countdown_s = max_countdown_s
        # Extra routing options per message (pikku's queue, when one is configured).
        self._route: Route = route or (lambda name, args, task: {})
        self._local = threading.local()  # the producer of a batch, per thread

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Send the steps dispatched inside on one producer, as a Celery group does (a
        fan-out's messages: a third less time per message than a producer each)."""
        if getattr(self._local, "producer", None) is not None:
            yield
            return
        with self._app.producer_or_acquire() as producer:
            self._local.producer = producer
            try:
                yield
            finally:
                self._local.producer = None

    def dispatch_step(self, function: str, run_id: str, step_name: str) -> None:
        task = self._app.tasks.get(function)
        route = self._route(function, (run_id, step_name), task)
        producer = getattr(self._local, "producer", None)
        if producer is not None:
            route = {**route, "producer": producer}
        if task is not None:
            task.apply_async((run_id, step_name), **route)
        else:
            self._app.send_task(function, args=(run_id, step_name), **route)

    def wake_run(self, run_id: str, countdown_s: float = 0.0,
                 step_name: str | None = None) -> None:
        task = internal_task(self._app, ORCHESTRATE_KIND)
        args = (run_id,) if step_name is None else (run_id, step_name)
        task.apply_async(args, countdown=countdown_s or None,
                         **self._route(task.name, args, task))

    def runs_here(self, function: str, run_id: str, step_name: str) -> bool:
        """Whether the task running now in this worker may run step ``function`` in place
        (``passes``) instead of sending it: the message would go where this task's came
        from (same queue, exchange and routing key, by the same routing), the step's task
        has the same task class call (the app's ``task_cls`` around it, or not around
        either), the step has no rate limit, neither task has a time limit the pool
        enforces (a step in place runs inside this task's limits, not its own: the threads
        and solo pools enforce none), and the worker is not shutting down.
        Anything else, and the step is sent as a message."""
        current = self._app.current_worker_task
        task = self._app.tasks.get(function)
        if current is None or current.app is not self._app or task is None or _stopping():
            return False
        request = current.request
        if request.is_eager or request.called_directly or task.rate_limit:
            return False
        if enforces_time_limits(self._app) and (any(request.timelimit or ()) or _time_limited(task)
                                       or _time_limited(current)):
            return False
        if _task_call(type(task)) is not _task_call(type(current)):
            return False
        here = self._here(current)
        return here is not None and here == self._destination(function, (run_id, step_name),
                                                               task)

    def _here(self, current: Task) -> tuple[Any, ...] | None:
        """Where the running task's message came from, worked out once per delivery (a
        streak asks at every step)."""
        request = current.request
        key = (current.name, request.id)
        cached = getattr(self._local, "here", None)
        if cached is None or cached[0] != key:
            cached = (key, self._destination(current.name, tuple(request.args or ()), current))
            self._local.here = cached
        return cached[1]

    def _destination(self, name: str, args: tuple[Any, ...], task: Task
                     ) -> tuple[Any, ...] | None:
        """Where a message of ``name`` would go: its queue, exchange and routing key, as
        ``apply_async`` routes it (the task's options, pikku's queue, the app's routes)."""
        options = {**getattr(task, "_get_exec_options", dict)(),
                   **self._route(name, args, task)}
        try:
            route = self._app.amqp.router.route(options, name, args, {}, task)
        except Exception:  # a user's router that cannot answer this: send as usual
            return None
        queue = route.get("queue")
        exchange = route.get("exchange") or getattr(getattr(queue, "exchange", None),
                                                    "name", None)
        return (getattr(queue, "name", queue), exchange,
                route.get("routing_key") or getattr(queue, "routing_key", None))

    def arm_timer(self, run_id: str, step_name: str, due_ms: int) -> None:
        # A broker ETA longer than the Redis transport's visibility timeout would be
        # redelivered while it waits: chain short timers instead (each re-arms the next).
        wait_s = max(0.0, (due_ms - self._engine().now_ms()) / 1000)
        task = internal_task(self._app, TIMER_KIND)
        task.apply_async((run_id, step_name), countdown=min(wait_s, self.max_countdown_s) or None,
                         **self._route(task.name, (run_id, step_name), task))


def _task_call(task_type: type) -> Any:
    """The ``__call__`` a task class runs, seen through sentry-sdk's Celery integration:
    in a worker (where Celery's stack protection makes ``__call__`` look custom to it) it
    wraps each task class's ``__call__`` on its own, so no two tasks would share one and
    no step could run in place. Its wrapper reports the task's exception and times it; a
    step run in place is reported to Sentry by ``observe.errors`` instead."""
    call: Any = task_type.__call__
    while (getattr(call, "__wrapped__", None) is not None
           and "sentry_sdk" in getattr(getattr(call, "__code__", None), "co_filename", "")):
        call = call.__wrapped__
    return call


def _time_limited(task: Task) -> bool:
    conf = task.app.conf
    return bool(task.time_limit or task.soft_time_limit or conf.task_time_limit
                or conf.task_soft_time_limit)


def _stopping() -> bool:
    """A worker asked to stop (warm shutdown) finishes its tasks: they must not go on."""
    from celery.worker import state

    return any(flag is not None and flag is not False
               for flag in (state.should_stop, state.should_terminate))


def check_step_call(name: str, args: Any, kwargs: Any) -> None:
    """A step task is sent by pikku only, as ``(run_id, step_name)``: a user calling it like
    an ordinary task gets told how steps run instead of a ``TypeError`` about arguments."""
    if (not kwargs and isinstance(args, list | tuple) and len(args) == 2
            and all(isinstance(a, str) for a in args)):
        return
    short = name.rsplit(".", 1)[-1]
    raise InvalidInputError(
        f"{name!r} is a pikku step: it runs inside a workflow, not on its own. Call it from "
        f"a workflow with wf.do('<step name>', {short}, data) and start the workflow with "
        "pikku.start(<workflow>, data); to run the plain function, call it as "
        f"{short}.pikku_step.fn(data)")


class StepTask(Task):  # type: ignore[misc]
    """What every step task adds to its app's task class: ``my_step.delay(data)`` is
    refused at the caller. Mixed in front of the app's own class (``step_task_class``)."""

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any,
                    **options: Any) -> Any:
        check_step_call(self.name, args, kwargs)
        return super().apply_async(args, kwargs, *rest, **options)


def step_task_class(app: Celery) -> type[Task]:
    """The class of ``app``'s step tasks: ``StepTask`` in front of the app's task class
    (``Celery(task_cls=...)``), so a step runs through that class's ``__call__`` and hooks
    exactly as the app's other tasks do (Flask's app context, a tracer, a DB session
    scope). One per app, made once."""
    made = getattr(app, "_pikku_step_task_class", None)
    if made is None:
        made = type("StepTask", (StepTask, app.Task), {"__module__": __name__})
        app._pikku_step_task_class = made
    return made


def make_step_task(app: Celery, engine_ref: Callable[[], Engine], name: str,
                   options: dict[str, Any]) -> Task:
    def run_step(task: Task, *args: Any, **kwargs: Any) -> Any:
        # Not ``(task, run_id, step_name)``: a step called like a plain function, or a
        # message with other arguments, gets ``check_step_call``'s explanation, not a
        # ``TypeError`` about a missing ``step_name``.
        if kwargs or len(args) != 2:
            check_step_call(name, args, kwargs)
        run_id, step_name = args
        check_message(run_id, step_name)  # a forged message of the right shape
        engine = engine_ref()
        definition = engine.registry.steps[name]
        try:
            outcome = engine.execute_step(definition, run_id, step_name,
                                          task_id=recordable_task_id(task.request.id))
        except WorkflowStepSupersededError as exc:
            # The result backend fences on this: a superseded attempt cannot replace the
            # outcome a later attempt stored under the same task id.
            record_attempt(task.request, exc.attempt)
            log.warning("WorkflowStepSupersededError: %s", exc,
                        extra=log_fields(run_id, step_name, exc.attempt))
            raise
        if outcome.kind == "not_claimed":
            log.info("pikku: step %r of run %s: task %s ran nothing: a live worker holds "
                     "the step, it has settled, or its next attempt is not due (a duplicate "
                     "or redelivered copy). The holder's outcome stands; should its worker "
                     "die, the reaper runs the step again once its lease lapses", step_name,
                     run_id, task.request.id, extra=log_fields(run_id, step_name, None))
            raise Ignore()
        record_attempt(task.request, outcome.attempt)
        if outcome.kind == "settled":
            # A duplicate of a step that settled for good under another task id: this
            # task id reports the recorded outcome too (nothing ran), fenced by the
            # attempt that recorded it, so it can never replace a later attempt's.
            log.info("pikku: step %r of run %s had already settled (attempt %d); task %s "
                     "reports its recorded outcome", step_name, run_id, outcome.attempt,
                     task.request.id, extra=log_fields(run_id, step_name, outcome.attempt))
            if outcome.error is not None:
                raise recorded_failure(getattr(outcome.error, "error", {}))
            return outcome.result
        if outcome.error is not None:
            if outcome.retry_at is not None:
                raise retry_of(run_id, step_name, outcome)
            raise outcome.error
        return outcome.result

    run_step.__name__ = name.rsplit(".", 1)[-1]
    # A step task belongs to this app and its engine only: never shared with other apps.
    options = {k: v for k, v in options.items() if k != "shared"}
    task: Task = app.task(name=name, bind=True, shared=False, base=step_task_class(app),
                          **{**STEP_TASK_DEFAULTS, **options})(run_step)
    return task


MAX_TASK_ID_CHARS = 200


def recorded_failure(error: dict[str, Any]) -> BaseException:
    """An exception like the one the settling attempt raised, from its stored form (type
    name and message): the builtin or pikku class of that name, else a class of that name
    made the way Celery rebuilds an exception it cannot import. Celery stores it as the
    same FAILURE: same type name, same message."""
    import builtins

    from celery.utils.serialization import create_exception_cls

    from pikku_celery.model import errors

    name = str(error.get("type") or "Exception")
    message = str(error.get("message", ""))
    known = getattr(builtins, name, None) or getattr(errors, name, None)
    if isinstance(known, type) and issubclass(known, Exception) and not issubclass(
            known, errors.PikkuError):
        try:
            return known(message)
        except Exception:  # a builtin with another signature (UnicodeDecodeError...)
            pass
    cls = create_exception_cls(name if name.isidentifier() else "Exception",
                               "pikku_celery.recorded")
    exc: BaseException = cls(message)
    return exc


def log_fields(run_id: str, step_name: str, attempt: int | None) -> dict[str, Any]:
    """The structured fields (``observe.logs``) of a line a step task logs once its attempt
    has ended (the attempt's own fields are gone by then)."""
    return {"run_id": run_id, "step": step_name, "attempt": attempt}


def recordable_task_id(task_id: object) -> str | None:
    """The task id to record with the attempt: Celery's ids are UUIDs, but a caller may
    choose one, and a forged message must not store an arbitrarily large one."""
    if isinstance(task_id, str) and 0 < len(task_id) <= MAX_TASK_ID_CHARS:
        return task_id
    return None


def retry_of(run_id: str, step_name: str, outcome: StepOutcome) -> Retry:
    """The task's end for an attempt that failed with attempts left: Celery's RETRY state,
    and one WARNING line rather than ``ERROR ... raised unexpected`` and a traceback."""
    error = outcome.error
    assert error is not None and outcome.retry_at is not None
    text = f"{type(error).__name__}: {error}"
    if len(text) > 500:
        text = text[:500] + "..."
    when = outcome.retry_at.isoformat(timespec="milliseconds")
    log.warning("pikku: step %r of run %s attempt %d of %d failed (%s); attempt %d runs at "
                "%s", step_name, run_id, outcome.attempt, outcome.max_attempts, text,
                outcome.attempt + 1, when, extra=log_fields(run_id, step_name, outcome.attempt))
    return Retry(message=f"attempt {outcome.attempt} of {outcome.max_attempts} failed "
                         f"({text}); pikku runs attempt {outcome.attempt + 1} at {when}",
                 exc=error, when=outcome.retry_at)


def register_internal_tasks(app: Celery, engine_ref: Callable[[], Engine]) -> None:
    """Register ``app``'s own pikku tasks under its names (``internal_task_names``). Their
    names come from the app's configuration, which a Flask factory or Django sets after
    ``PikkuCelery(app)``: so they are made when the app is finalized (its first
    ``app.tasks``, a worker's start), as Celery makes the tasks of its ``@app.task``
    decorators, unless it is finalized already."""
    from celery.local import PromiseProxy

    def register() -> None:
        names = internal_task_names(app)
        _register(app, engine_ref, names)
        setattr(app, _NAMES_ATTR, names)

    if app.finalized:
        register()
    else:  # evaluated by ``app.finalize()``, in order with the app's pending tasks
        app._pending.append(PromiseProxy(register))


def _register(app: Celery, engine_ref: Callable[[], Engine], names: dict[str, str]) -> None:
    @app.task(name=names[ORCHESTRATE_KIND], bind=True, shared=False, acks_late=True,
              reject_on_worker_lost=True,
              serializer="json", throws=(LeaseTakenError, LeaseLostError))
    def orchestrate(task: Task, run_id: str, step_name: str | None = None) -> str:
        # ``step_name``: the step whose change sent this message (the pass reads it); none
        # from the reaper, a resume or a start (the pass reads whatever may have changed).
        check_message(run_id) if step_name is None else check_message(run_id, step_name)
        engine = engine_ref()
        try:
            return engine.advance(run_id, step_name=step_name)
        except LeaseTakenError:
            # Another orchestrator holds the run: this message left it a mark, and it passes
            # again before it lets go (or a watch wakes the run should it die first). No
            # retry is spent and nothing is re-sent.
            return "marked"
        except LeaseLostError:
            # Our pass lost the lease: whoever holds the run now may have missed this
            # message's news, so wake the run again shortly, without spending the retry
            # budget this task keeps for real failures.
            engine.dispatcher.wake_run(run_id, countdown_s=RUN_LEASE_RETRY_S)
            return "rewake"
        except WorkflowRunNotFoundError:
            log.warning("pikku: orchestrator message for unknown run %r dropped", run_id)
            raise Ignore() from None

    @app.task(name=names[TIMER_KIND], shared=False, acks_late=True, serializer="json")
    def timer(run_id: str, step_name: str) -> str:
        check_message(run_id, step_name)
        return engine_ref().fire_timer(run_id, step_name)

    @app.task(name=names[REAP_KIND], shared=False, serializer="json")
    def reap() -> dict[str, int]:
        return engine_ref().reap()

    del orchestrate, timer, reap


class WorkerReaper:
    """Runs the reaper inside a worker's main process every ``interval_s``.

    Only one process on the whole cluster sweeps per interval (it takes a short Redis lease
    first); more would be harmless, since a dispatch only asks for a claim."""

    def __init__(self, engine_ref: Callable[[], Engine], interval_s: float) -> None:
        self._engine = engine_ref
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder = uuid.uuid4().hex
        self._stand_aside = False

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="pikku-reaper",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def _deadline_s(self) -> float:
        return max(self.interval_s, SWEEP_DEADLINE_MIN_S)

    def _loop(self) -> None:
        # First thing, at worker start: one clear line per service that does not answer,
        # rather than "ready" and then a traceback every interval.
        outages = OutageLog(self._probe, self.interval_s)
        outages.at_start()
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception as exc:
                outages.failed(exc)
            else:
                outages.succeeded()

    def _probe(self) -> dict[str, str | None]:
        """Each service that can tell (``describe``/``ping``): ``None`` when it answers,
        else why not."""
        engine = self._engine()
        found: dict[str, str | None] = {}
        for service in (engine.store, engine.leases):
            describe, ping = getattr(service, "describe", None), getattr(service, "ping", None)
            if describe is None or ping is None:
                continue  # in-memory: nothing to reach
            name = describe()
            try:
                with deadline(self._deadline_s):  # a stalled primary must not hold the loop
                    ping()
                found[name] = None
            except Exception as exc:
                why = str(exc)
                # The log line names the service: a driver's timeout does not.
                found[name] = why if name in why else f"{name} does not answer: {why}"
        return found

    def sweep_once(self) -> dict[str, int] | None:
        """Sweep if this process wins the reaper lease. A process whose sweep failed gives
        the role up and stands aside for one interval: the live holder re-acquires its own
        lease, so a process whose MongoDB calls fail fast would otherwise keep the role
        (and nobody would sweep) for as long as it stays broken."""
        engine = self._engine()
        if self._stand_aside:
            self._stand_aside = False
            return None
        ttl_ms = max(1, int(self.interval_s * 1000 * 0.9))
        lease = engine.leases.acquire(keys.REAPER_LEASE_KEY, self._holder, ttl_ms)
        if lease is None:
            return None
        try:
            # A sweep stuck on a primary that stopped answering would stop this worker's
            # reaper until pymongo gives the node up (every worker's, all stuck on it).
            with deadline(self._deadline_s):
                counts = engine.reap()
        except BaseException:
            self._stand_aside = True
            with contextlib.suppress(Exception):  # unreleased, it lapses within the interval
                engine.leases.release(lease)
            raise
        if any(counts.values()):
            log.info("pikku reaper: %s", counts)
        sweep_hooks.run(engine)  # adapters' work (contrib.django drains its start intents)
        return counts


class OutageLog:
    """One line when a service stops answering and one when it answers again, instead of a
    traceback every reaper interval for as long as it is down.

    A failed sweep asks each service to answer (``ping``): when one does not, the failure is
    that outage, logged at ERROR once, then at DEBUG on every sweep until it ends. When all
    answer, the failure is the sweep's own: logged with its traceback once, and again only
    if it changes or after a sweep succeeded."""

    def __init__(self, probe: Callable[[], dict[str, str | None]], interval_s: float) -> None:
        self._probe = probe
        self._interval_s = interval_s
        self._down: dict[str, str] = {}  # service -> why it does not answer
        self._last_error: str | None = None

    def at_start(self) -> None:
        found = self._probe()
        self._update(found)
        if found and not self._down:
            log.info("pikku: %s answer%s; the reaper sweeps every %g s",
                     " and ".join(found), "" if len(found) > 1 else "s", self._interval_s)

    def failed(self, exc: Exception) -> None:
        self._update(self._probe())
        if self._down:
            log.debug("pikku reaper: sweep failed while %s does not answer: %s",
                      " and ".join(self._down), exc)
            return
        text = f"{type(exc).__name__}: {exc}"
        if text == self._last_error:
            log.debug("pikku reaper: sweep failed again: %s", text)
            return
        self._last_error = text
        log.error("pikku reaper sweep failed (logged again only if the error changes)",
                  exc_info=exc)

    def succeeded(self) -> None:
        self._last_error = None
        if self._down:  # a sweep that stood aside proves nothing: ask the services
            self._update(self._probe())

    def _update(self, found: dict[str, str | None]) -> None:
        down = {service: why for service, why in found.items() if why is not None}
        for service, why in down.items():
            if service not in self._down:
                log.error("pikku: %s. Runs cannot start or advance until it answers; the "
                          "worker keeps running and retries every %g s, quietly (one line "
                          "when it answers again)", why.rstrip("."), self._interval_s)
        for service in self._down:
            if service not in down:
                log.warning("pikku: %s answers again; the reaper resumed", service)
        self._down = down
