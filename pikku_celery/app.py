"""``PikkuCelery``: binds a Celery app to a workflow store and a lease service."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from celery import Celery, signals

from pikku_celery.engine.facade import Dispatcher, Engine
from pikku_celery.leases.base import LeaseService
from pikku_celery.model._fork import reset_in_forked_child
from pikku_celery.model.clock import Clock
from pikku_celery.model.durations import Duration, to_seconds
from pikku_celery.model.records import RUN_QUEUED
from pikku_celery.model.validate import check_name
from pikku_celery.observe import serve
from pikku_celery.operations import RunOperations
from pikku_celery.schedules.ticker import WorkerTicker
from pikku_celery.store.base import WorkflowStore
from pikku_celery.worker import on_commit, shared
from pikku_celery.worker.config import Resolved
from pikku_celery.worker.config import Settings as Configuration
from pikku_celery.worker.inline import DrivingDispatcher, run_inline
from pikku_celery.worker.routing import Routing
from pikku_celery.worker.signals import SignalSender
from pikku_celery.worker.tasks import (
    CeleryDispatcher,
    WorkerReaper,
    internal_task_names,
    make_step_task,
    register_internal_tasks,
)
from pikku_celery.workflow.declare import attach_workflow, graph_definition
from pikku_celery.workflow.definitions import (
    Registry,
    StepDefinition,
    WorkflowDefinition,
    make_step,
    make_workflow,
)
from pikku_celery.workflow.retry import Errors
from pikku_celery.workflow.typed import P, R, Step, Workflow

EngineFactory = Callable[["PikkuCelery"], Engine]
log = logging.getLogger("pikku_celery")


class PikkuCelery(RunOperations):
    """Durable, fenced workflows on ``celery_app``.

    Registers pikku's tasks (``<namespace>.orchestrate``, ``.timer``, ``.reap``: the
    ``pikku_task_namespace`` setting, default ``pikku.<main>``) on the app, so ``celery -A
    proj worker`` runs steps, orchestration, the reaper and the ticks of schedules
    (``schedule``) with no extra process. Reachable as ``celery_app.pikku``.

    Every argument is optional and wins over the setting of the same name in the Celery
    app's configuration, ``pikku_<name>`` (``CELERY_PIKKU_<NAME>`` in Django settings read
    with ``namespace="CELERY"``). Settings are read, and the store and lease service built,
    at first use (a ``start``, a task, a worker's start), never here: configure the Celery
    app after building this, as a Flask factory or Django does. See ``pikku_celery.worker.config``.

    Args:
        store: where runs and steps live (default: a ``MongoWorkflowStore`` on the
            ``pikku_mongo_url`` setting).
        leases: the lease service (default: a ``RedisLeaseService`` on ``pikku_redis_url``,
            key prefix ``pikku_key_prefix``, else the app's main name); its clock is the one
            clock all lease deadlines use.
        step_lease: how long a step attempt is held without a heartbeat before another
            worker may claim it (renewed every third of it while the body runs; 60 s).
        run_lease: the run lease's TTL for one orchestration pass (30 s).
        reaper_interval: how often each worker sweeps for lost work (default: half the
            step lease). A dead worker's step runs again within ``step_lease +
            reaper_interval``.
        max_countdown: the longest single broker ETA pikku uses (300 s); longer sleeps and
            retry delays are chained. Keep it well under the Redis transport's
            ``visibility_timeout``.
        undispatched_after: a ``pending`` step no worker picked up for this long (30 s) has
            its message sent again (the first one was lost with a dead worker's prefetch).
        stalled_after: a running run that no pass touched for this long (30 s), and on
            which nothing is in flight, is woken again (its wake-up message was lost).
        continue_in_place: after a step settles, replay the run in the same worker (under
            the run lease) instead of sending an orchestrator message; when another pass
            holds the run, leave it a mark instead (it passes again before it lets go).
            Default ``True``: fewer messages and round trips; ``False`` sends a
            orchestrator message per settled step.
        in_place_steps: with ``continue_in_place``, a pass in a worker runs the next step
            itself when it would go to the queue its own task came from (docs/internals/
            how-it-works.md), at most this many in a row (100; 0: never),
        in_place_for: and for at most this long (10 s).
        worker_reaper: run the reaper in every worker of the app (default ``True``).
        max_events_per_run: the events a run keeps at most (10,000; 0: no limit).
        max_event_bytes: an event's largest payload, as JSON (256 KiB; 0: no limit).
        queue: a queue of pikku's own (default: the ``pikku_queue`` setting, else none:
            pikku's tasks are routed like any task). With one, pikku's messages go there
            unless your routing names another destination, a worker without ``-Q`` also
            consumes it, and a worker that consumes only it gets prefetch multiplier 1
            unless you set one (see ``pikku_celery.worker.routing``). Binding never changes
            ``app.conf``.
        redact_error: your own redaction of recorded errors: a callable ``(text) -> str``
            (or its dotted path) given each error's message and traceback after pikku's
            built-in masking of credentials, before the error is stored.
        redact_value: your own redaction of each value the web API and the dashboard
            show (never of what is stored): a callable ``(value, where) -> value`` (or its
            dotted path). Both: see ``pikku_celery.model.redaction``.
    """

    def __init__(self, celery_app: Celery, *, store: WorkflowStore | None = None,
                 leases: LeaseService | None = None, step_lease: Duration | None = None,
                 run_lease: Duration | None = None, reaper_interval: Duration | None = None,
                 max_countdown: Duration | None = None, undispatched_after: Duration | None = None,
                 stalled_after: Duration | None = None, continue_in_place: bool | None = None,
                 in_place_steps: int | None = None, in_place_for: Duration | None = None,
                 worker_reaper: bool | None = None, queue: str | None = None,
                 redact_error: Callable[[str], str] | str | None = None,
                 redact_value: Callable[[Any, str], Any] | str | None = None,
                 max_events_per_run: int | None = None, max_event_bytes: int | None = None
                 ) -> None:
        self.app = celery_app
        self.registry = Registry()
        explicit: dict[str, Any] = {
            "store": store, "leases": leases, "step_lease": step_lease, "run_lease": run_lease,
            "reaper_interval": reaper_interval, "max_countdown": max_countdown,
            "undispatched_after": undispatched_after, "stalled_after": stalled_after,
            "continue_in_place": continue_in_place, "in_place_steps": in_place_steps,
            "in_place_for": in_place_for, "worker_reaper": worker_reaper,
            "redact_error": redact_error, "redact_value": redact_value,
            "max_events_per_run": max_events_per_run, "max_event_bytes": max_event_bytes}
        self._config = Configuration(celery_app, explicit)
        self._config.check_explicit()  # a bad argument fails here, as before
        adopt_prefix = getattr(leases, "adopt_prefix", None)
        if adopt_prefix is not None:  # a lease service built without a key_prefix
            adopt_prefix(celery_app.main)
        self.routing = Routing(celery_app, queue)
        self._resolved: Resolved | None = None
        self._engine: Engine | None = None
        # The test kit's engine for one test: built by its factory at first use.
        self._override: Engine | None = None
        self._override_factory: EngineFactory | None = None
        self._engine_lock = threading.Lock()
        reset_in_forked_child(self)
        self._reaper: WorkerReaper | None = None
        register_internal_tasks(celery_app, lambda: self.engine)
        self.routing.connect()  # no app-wide prefetch of 1 (it hung expiring tasks)
        serve.connect(celery_app)  # the metrics on pikku_metrics_port, read at worker start
        if worker_reaper is not False:
            uid = f"pikku-app-{id(self)}"  # Celery < 5.7: one bound method per function else
            signals.worker_ready.connect(self._on_worker_ready, weak=False, dispatch_uid=uid)
            signals.worker_shutdown.connect(self._on_worker_shutdown, weak=False,
                                            dispatch_uid=uid)
            self._ticker = WorkerTicker(self).connect()
        celery_app.pikku = self
        shared.bind(self)  # steps and workflows declared with shared_step/shared_workflow

    def _after_fork_in_child(self) -> None:
        self._engine_lock = threading.Lock()  # it may have been copied held

    # --- the engine, built at first use ---------------------------------------------------

    @property
    def settings(self) -> Resolved:
        """Every setting, explicit arguments merged with the Celery app's configuration
        (read at the first call)."""
        resolved = self._resolved
        if resolved is None:
            resolved = self._resolved = self._config.resolve()
        return resolved

    @property
    def engine(self) -> Engine:
        """The engine, built at its first use from the arguments and the app's settings.
        Building it opens no connection: the store and lease service connect at their
        first call. Raises ``PikkuConfigurationError`` naming a missing setting."""
        engine = self._override or self._engine
        if engine is None or (self._override_factory is not None and self._override is None):
            with self._engine_lock:  # threads pool: two first uses build one engine
                if self._override_factory is not None:
                    if self._override is None:
                        self._override = self._override_factory(self)
                    return self._override
                if self._engine is None:
                    self._engine = self.make_engine()
                engine = self._engine
        return engine

    def make_engine(self, *, store: WorkflowStore | None = None,
                    leases: LeaseService | None = None, clock: Clock | None = None,
                    dispatcher: Callable[[Engine], Dispatcher] | None = None) -> Engine:
        """A new engine for this instance's workflows (what ``engine`` builds once; the
        test kit builds its own on in-memory services). Store and leases default to the
        configured ones, the dispatcher to Celery messages."""
        resolved = self.settings
        store = store if store is not None else self._config.store()
        leases = leases if leases is not None else self._config.leases()
        celery_dispatcher = CeleryDispatcher(self.app, lambda: self.engine,
                                             resolved.max_countdown_s,
                                             route=self.routing.options)
        engine = Engine(store, leases, self.registry, celery_dispatcher,
                        resolved.engine_settings(), worker=self.routing.worker_host,
                        clock=clock, emit=SignalSender(self))
        if dispatcher is not None:
            engine.dispatcher = dispatcher(engine)
        return engine

    def _override_engine(self, factory: EngineFactory | None,
                         engine: Engine | None = None) -> tuple[EngineFactory | None,
                                                                Engine | None]:
        """Until called again, this instance's engine is the one ``factory`` builds at
        first use (or ``engine``); ``None`` and ``None`` go back to the configured engine.
        Returns the previous pair, to restore it (what ``pikku_celery.testing`` does)."""
        with self._engine_lock:
            previous = (self._override_factory, self._override)
            self._override_factory, self._override = factory, engine
        return previous

    @property
    def reaper_interval_s(self) -> float:
        return self.settings.reaper_interval_s

    # --- decorators -----------------------------------------------------------------------

    def step(self, name: str | None = None, *, retries: int | None = None,
             max_retries: int | None = None, retry_delay: Duration | None = None,
             autoretry_for: Errors | None = None, no_retry_for: Errors = (),
             retry_backoff: bool | Duration | None = None,
             retry_backoff_max: Duration | None = None, retry_jitter: bool | None = None,
             lease: Duration | None = None, bind: bool = False, transactional: bool = False,
             **task_options: Any) -> Callable[[Callable[P, R]], Step[P, R]]:
        """Turn ``fn(data)`` (or ``fn(ctx, data)`` with ``bind=True``) into a Celery task
        that is also a workflow step, typed by ``fn`` (a ``Step``). Its body's error is not
        retried unless it asks, as in Celery (``retries``, ``autoretry_for``... and the
        ``pikku_step_*`` settings: ``pikku_celery.workflow.retry``); a lost worker's attempt
        runs again. ``transactional=True``: its writes commit with its settle. Other
        keyword arguments are Celery task options (``queue``...)."""
        def decorate(fn: Callable[P, R]) -> Step[P, R]:
            definition = make_step(
                fn, name or self.app.gen_task_name(fn.__name__, fn.__module__),
                retries=retries, max_retries=max_retries, retry_delay=retry_delay,
                autoretry_for=autoretry_for, no_retry_for=no_retry_for,
                retry_backoff=retry_backoff, retry_backoff_max=retry_backoff_max,
                retry_jitter=retry_jitter, lease=lease, bind=bind, transactional=transactional)
            return cast("Step[P, R]", self.add_step(definition, task_options))
        return decorate

    def add_step(self, definition: StepDefinition, task_options: dict[str, Any]) -> Any:
        """Register a step definition and its Celery task on this app (what ``step`` and
        ``shared_step`` do); returns the task."""
        self.registry.add_step(definition)
        # ``pikku_step`` as a task option, not set on the returned task: on an app not yet
        # finalized that is a promise, and setting an attribute on it would build the task
        # now, reading the app's configuration before a Flask factory or Django set it.
        return make_step_task(self.app, lambda: self.engine, definition.name,
                              {**task_options, "pikku_step": definition})

    def workflow(self, name: str | None = None, *, concurrency: int | None = None,
                 concurrency_key: Callable[[Any], Any] | None = None
                 ) -> Callable[[Callable[P, R]], Workflow[P, R]]:
        """Register ``fn(wf, data) -> result`` as a workflow named ``name`` (default: the
        function's name); ``concurrency=N``: at most N runs at once per
        ``concurrency_key(input)``, the others ``queued`` (``pikku_celery.engine.concurrency``)."""
        def decorate(fn: Callable[P, R]) -> Workflow[P, R]:
            definition = make_workflow(fn, name or fn.__name__, concurrency=concurrency,
                                       concurrency_key=concurrency_key)
            self.add_workflow(definition)
            return attach_workflow(fn, definition)
        return decorate

    def add_workflow(self, definition: WorkflowDefinition) -> None:
        """Register a workflow definition (what ``workflow`` and ``shared_workflow`` do)."""
        self.registry.add_workflow(definition)

    def graph(self, name: str, *, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
              branch: Mapping[str, Callable[[Any], Iterable[str]]] | None = None,
              on_error: Mapping[str, str] | None = None,
              for_each: Mapping[str, Any] | None = None,
              max_visits: Mapping[str, int] | None = None) -> WorkflowDefinition:
        """Register a graph workflow: ``nodes`` maps node names to steps, ``edges`` are
        ``(from, to)`` pairs, ``branch`` optionally maps a node to a function of its
        result returning the successors to run, ``on_error`` maps a node to the handler node
        run (with ``{"error", "input"}``) instead of failing the run when it fails for good,
        ``for_each`` maps a node to the predecessor whose list it runs once per item over
        (``{"over": pred, "sequential": True}`` for one at a time). An edge back to an
        earlier node is a loop: each visit is its own step (``node#2``, ...), at most
        ``max_visits`` (default 10) per node. Start it like any workflow, by name."""
        definition = graph_definition(name, nodes, edges, branch, on_error, for_each,
                                      max_visits)
        self.registry.add_workflow(definition)
        return definition

    # --- runs -----------------------------------------------------------------------------

    def start(self, workflow: str | Callable[..., Any], data: Any = None, *,
              run_id: str | None = None, inline: bool = False) -> str:
        """Start a run and return its id. With ``run_id`` the start is idempotent: the same
        id returns the same run. With ``inline=True`` the run is orchestrated and its steps
        executed in this process (still under the run lease and the claim layer), and this
        call returns once it has ended."""
        engine = self.engine
        run, _ = engine.create_run(workflow, data, run_id=run_id)
        if isinstance(engine.dispatcher, DrivingDispatcher):
            engine.dispatcher.wake_run(run.run_id)  # the test kit: runs it here, to its end
        elif inline:
            run_inline(engine, run.run_id)
        elif not run.is_terminal and run.status != RUN_QUEUED:  # queued: admission wakes it
            engine.dispatcher.wake_run(run.run_id)
        return run.run_id

    def start_on_commit(self, workflow: str | Callable[..., Any], data: Any = None, *,
                        run_id: str | None = None, using: str | None = None) -> str:
        """Return the run id (``run_id`` or a fresh one) at once, and create and dispatch
        the run after the current transaction on database ``using`` commits (at once
        outside a transaction), like Celery's ``delay_on_commit``. The transaction is the
        web framework's: its adapter registers how to wait for the commit
        (``pikku_celery.contrib.django``, loaded from ``INSTALLED_APPS``; see
        ``pikku_celery.worker.on_commit``). Everything that can be checked before the commit is
        (the workflow is registered, the run id and the input can be stored), so a bad
        call fails inside the transaction and rolls back with it."""
        record_start = on_commit.registered_record_start()  # raises without an adapter
        definition = self.registry.workflow(workflow)
        run_id = check_name("run id", run_id) if run_id is not None else str(uuid.uuid4())
        record_start(self, definition.name, data, run_id, using)
        return run_id

    def beat_schedule_entry(self, every: Duration | None = None) -> dict[str, Any]:
        """An optional beat entry: ``app.conf.beat_schedule = {"pikku-reaper":
        pikku.beat_schedule_entry()}``. Workers already reap without beat."""
        interval = self.reaper_interval_s if every is None else to_seconds(every)
        return {"task": internal_task_names(self.app)["reap"], "schedule": interval}

    # --- worker lifecycle -----------------------------------------------------------------

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self.app:
            return
        try:  # the worker's configuration is loaded by now: say at once what is missing
            settings, _engine = self.settings, self.engine
        except Exception as exc:
            log.error("pikku is not configured, so this worker can run no workflow: %s", exc)
            return
        if not settings.worker_reaper:
            return
        if self._reaper is None:
            self._reaper = WorkerReaper(lambda: self.engine, settings.reaper_interval_s)
        self._reaper.start()

    def _on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        if self._reaper is not None:
            self._reaper.stop()


def get_pikku(celery_app: Celery) -> PikkuCelery:
    """The ``PikkuCelery`` bound to ``celery_app`` (what a tool given ``-A proj`` needs)."""
    found = getattr(celery_app, "pikku", None)
    if not isinstance(found, PikkuCelery):
        raise LookupError(f"no PikkuCelery is bound to Celery app {celery_app.main!r}")
    return found
