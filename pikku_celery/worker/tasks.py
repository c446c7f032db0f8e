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
from collections.abc import Callable
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
from pikku_celery.worker.dispatcher import CeleryDispatcher, Route, carried_claim
from pikku_celery.worker.task_names import (
    INTERNAL_KINDS,
    NAMES_ATTR,
    ORCHESTRATE,
    ORCHESTRATE_KIND,
    REAP,
    REAP_KIND,
    TIMER,
    TIMER_KIND,
    internal_task,
    internal_task_names,
)
from pikku_celery.worker.time_budget import task_started

if TYPE_CHECKING:
    from pikku_celery.engine.facade import Engine
    from pikku_celery.engine.outcomes import StepOutcome

# Re-exported: the dispatcher and the task names were this module's before they had their own.
__all__ = ["INTERNAL_KINDS", "ORCHESTRATE", "ORCHESTRATE_KIND", "REAP", "REAP_KIND", "TIMER",
           "TIMER_KIND", "CeleryDispatcher", "Route", "StepTask", "WorkerReaper",
           "check_message", "check_step_call", "internal_task", "internal_task_names",
           "make_step_task", "recorded_failure", "register_internal_tasks", "step_task_class"]

log = logging.getLogger("pikku_celery")

RUN_LEASE_RETRY_S = 1.0
# The shortest deadline of a reaper sweep (and of its service probe): long enough to ride out
# an election (pymongo waits 5 s for a server by default), so a routine failover is not a
# failed sweep; bounded, so a primary that stopped answering cannot hold the reaper.
SWEEP_DEADLINE_MIN_S = 10.0
# The deadline of the probe at worker start: a service that does not answer is named a few
# seconds after "ready", not a whole sweep deadline (30 s by default) later. As long as the
# store's own server-selection timeout by default, so its error says what was waited.
START_PROBE_DEADLINE_S = 5.0
# No ``queue`` here: a task attribute would beat the user's ``task_routes``. pikku's own
# queue, when configured, is chosen per message (routing.py), after the user's routing.
STEP_TASK_DEFAULTS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "serializer": "json",
    "throws": (WorkflowStepSupersededError,),
}


_NO_STEP = object()


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
        task_started(task.request.id)
        check_message(run_id, step_name)  # a forged message of the right shape
        engine = engine_ref()
        definition = engine.registry.steps[name]
        try:
            outcome = engine.execute_step(definition, run_id, step_name,
                                          task_id=recordable_task_id(task.request.id),
                                          expected=carried_claim(task.request))
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
        setattr(app, NAMES_ATTR, names)

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
        task_started(task.request.id)
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

    @app.task(name=names[TIMER_KIND], bind=True, shared=False, acks_late=True,
              serializer="json")
    def timer(task: Task, run_id: str, step_name: str) -> str:
        task_started(task.request.id)
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
        # rather than "ready" and then a traceback every interval; within a few seconds
        # (a pymongo call under a deadline waits the whole deadline for a server, whatever
        # its server-selection timeout says).
        outages = OutageLog(self._probe, self.interval_s)
        outages.at_start(lambda: self._probe(START_PROBE_DEADLINE_S))
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception as exc:
                outages.failed(exc)
            else:
                outages.succeeded()

    def _probe(self, deadline_s: float | None = None) -> dict[str, str | None]:
        """Each service that can tell (``describe``/``ping``): ``None`` when it answers,
        else why not, and which setting names it."""
        engine = self._engine()
        found: dict[str, str | None] = {}
        for service, setting in zip((engine.store, engine.leases), configured_by(engine),
                                    strict=True):
            describe, ping = getattr(service, "describe", None), getattr(service, "ping", None)
            if describe is None or ping is None:
                continue  # in-memory: nothing to reach
            name = describe()
            try:
                # A stalled primary must not hold the loop.
                with deadline(self._deadline_s if deadline_s is None else deadline_s):
                    ping()
                found[name] = None
            except Exception as exc:
                why = str(exc).rstrip(".")
                # The log line names the service: a driver's timeout does not.
                why = why if name in why else f"{name} does not answer: {why}"
                found[name] = f"{why} (check {setting})"
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


def configured_by(engine: Engine) -> tuple[str, str]:
    """What configures ``engine``'s store and lease service, for a line saying one does not
    answer: the setting (``pikku_mongo_url``, ``CELERY_PIKKU_MONGO_URL`` in settings read
    with a namespace), or the argument given to ``PikkuCelery``."""
    from pikku_celery.worker import shared

    found = ["the store given to PikkuCelery(store=...)",
             "the lease service given to PikkuCelery(leases=...)"]
    pikku: Any = next((p for p in shared.instances()
                       if getattr(p, "registry", None) is engine.registry), None)
    config = getattr(pikku, "_config", None)
    if config is None:
        return found[0], found[1]
    namespace = getattr(pikku.app, "namespace", None)
    for i, (argument, setting) in enumerate((("store", "mongo_url"), ("leases", "redis_url"))):
        given, _what = config.raw(argument)
        if given is None:
            name = f"pikku_{setting}"
            name = f"{namespace.rstrip('_')}_{name.upper()}" if namespace else name
            found[i] = f"the {name} setting"
    return found[0], found[1]


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

    def at_start(self, probe: Callable[[], dict[str, str | None]] | None = None) -> None:
        """The first probe, at worker start (``probe``: a quicker one than the sweeps')."""
        found = (probe or self._probe)()
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
