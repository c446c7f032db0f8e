"""``PikkuCelery``: binds a Celery app to a workflow store and a lease service."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from celery import Celery, signals

from pikku_celery.definitions import (
    DEFAULT_RETRIES,
    Registry,
    StepDefinition,
    WorkflowDefinition,
    make_step,
    make_workflow,
)
from pikku_celery.durations import Duration, to_ms, to_seconds
from pikku_celery.engine import Engine, Settings
from pikku_celery.errors import InvalidInputError
from pikku_celery.graph import build_graph, run_graph
from pikku_celery.inline import run_inline
from pikku_celery.leases.base import LeaseService
from pikku_celery.records import StepAttempt, StepState, WorkflowRun
from pikku_celery.replay import WorkflowContext
from pikku_celery.routing import Routing
from pikku_celery.store.base import WorkflowStore
from pikku_celery.tasks import (
    REAP,
    CeleryDispatcher,
    WorkerReaper,
    make_step_task,
    register_internal_tasks,
)

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_MAX_COUNTDOWN_S = 300.0


class PikkuCelery:
    """Durable, fenced workflows on ``celery_app``.

    Registers pikku's tasks (``pikku.orchestrate``, ``pikku.timer``, ``pikku.reap``) on the
    app, so ``celery -A proj worker`` runs steps, orchestration and the reaper with no
    extra process. The instance is reachable as ``celery_app.pikku``.

    Args:
        store: where runs and steps live (``MongoWorkflowStore`` in production).
        leases: the lease service (``RedisLeaseService``); its clock is the one clock all
            lease deadlines use.
        step_lease: how long a step attempt is held without a heartbeat before another
            worker may claim it (renewed every third of it while the body runs).
        run_lease: the run lease's TTL for one orchestration pass.
        reaper_interval: how often each worker sweeps for lost work (default: half the
            step lease). A dead worker's step runs again within ``step_lease +
            reaper_interval``.
        max_countdown: the longest single broker ETA pikku uses; longer sleeps and retry
            delays are chained. Keep it well under the Redis transport's
            ``visibility_timeout``.
        undispatched_after: a ``pending`` step no worker picked up for this long has its
            message sent again (the first one was lost with a dead worker's prefetch).
        stalled_after: a running run that no pass touched for this long, and on which
            nothing is in flight, is woken again (its wake-up message was lost).
        continue_in_place: after a step succeeds, replay the run in the same worker (under
            the run lease) instead of sending an orchestrator message; falls back to the
            message when another pass holds the run.
        queue: a queue of pikku's own (default: the ``pikku_queue`` setting, else none:
            pikku's tasks are routed like any task). With one, pikku's messages go there
            unless your routing names another destination, a worker without ``-Q`` also
            consumes it, and a worker that consumes only it gets prefetch multiplier 1
            unless you set one (see ``pikku_celery.routing``). Binding never changes
            ``app.conf``.
    """

    def __init__(self, celery_app: Celery, *, store: WorkflowStore, leases: LeaseService,
                 step_lease: Duration = 60.0, run_lease: Duration = 30.0,
                 reaper_interval: Duration | None = None,
                 max_countdown: Duration = DEFAULT_MAX_COUNTDOWN_S,
                 undispatched_after: Duration = 30.0, stalled_after: Duration = 30.0,
                 continue_in_place: bool = False, worker_reaper: bool = True,
                 queue: str | None = None) -> None:
        self.app = celery_app
        self.registry = Registry()
        settings = Settings(
            step_lease_ms=_positive_ms(step_lease, "step_lease"),
            run_lease_ms=_positive_ms(run_lease, "run_lease"),
            undispatched_after_ms=to_ms(undispatched_after, what="undispatched_after"),
            stalled_after_ms=to_ms(stalled_after, what="stalled_after"),
            continue_in_place=continue_in_place)
        self.reaper_interval_s = (to_seconds(reaper_interval, what="reaper_interval")
                                  if reaper_interval is not None
                                  else settings.step_lease_ms / 2000)
        self.routing = Routing(celery_app, queue)
        dispatcher = CeleryDispatcher(celery_app, lambda: self.engine,
                                      to_seconds(max_countdown, what="max_countdown"),
                                      route=self.routing.options)
        adopt_prefix = getattr(leases, "adopt_prefix", None)
        if adopt_prefix is not None:  # a lease service built without a key_prefix
            adopt_prefix(celery_app.main)
        self.engine = Engine(store, leases, self.registry, dispatcher, settings,
                             worker=socket.gethostname())
        self._reaper = WorkerReaper(lambda: self.engine, self.reaper_interval_s)
        register_internal_tasks(celery_app, lambda: self.engine)
        # No app-wide setting (a prefetch of 1 for every task hung the app's own expiring
        # tasks): a worker that consumes only pikku's queue gets it, see routing.py.
        self.routing.connect()
        if worker_reaper:
            signals.worker_ready.connect(self._on_worker_ready, weak=False)
            signals.worker_shutdown.connect(self._on_worker_shutdown, weak=False)
        celery_app.pikku = self

    # --- decorators -----------------------------------------------------------------------

    def step(self, name: str | None = None, *, retries: int = DEFAULT_RETRIES,
             retry_delay: Duration | None = None, lease: Duration | None = None,
             bind: bool = False, no_retry_for: tuple[type[BaseException], ...] = (),
             **task_options: Any) -> Callable[[F], Any]:
        """Turn ``fn(data)`` (or ``fn(ctx, data)`` with ``bind=True``) into a Celery task
        that is also a workflow step. ``retries`` (default 3) gives ``retries + 1``
        attempts; ``retry_delay`` is fixed when given, else 1 s doubling per attempt. An
        exception of a ``no_retry_for`` class fails the step at once (a declined card).
        Extra keyword arguments are Celery task options (``queue``, ``acks_late``...)."""
        def decorate(fn: F) -> Any:
            task_name = name or self.app.gen_task_name(fn.__name__, fn.__module__)
            definition = make_step(fn, task_name, retries=retries, retry_delay=retry_delay,
                                   lease=lease, bind=bind, no_retry_for=tuple(no_retry_for))
            self.registry.add_step(definition)
            task = make_step_task(self.app, lambda: self.engine, task_name, task_options)
            task.pikku_step = definition
            return task
        return decorate

    def workflow(self, name: str | None = None) -> Callable[[F], F]:
        """Register ``fn(wf, data) -> result`` as a workflow named ``name`` (default: the
        function's name)."""
        def decorate(fn: F) -> F:
            definition = make_workflow(fn, name or fn.__name__)
            self.registry.add_workflow(definition)
            fn.pikku_workflow = definition  # type: ignore[attr-defined]
            return fn
        return decorate

    def graph(self, name: str, *, nodes: Mapping[str, Any], edges: Sequence[tuple[str, str]],
              branch: Mapping[str, Callable[[Any], Iterable[str]]] | None = None
              ) -> WorkflowDefinition:
        """Register a graph workflow: ``nodes`` maps node names to steps, ``edges`` are
        ``(from, to)`` pairs (a DAG), ``branch`` optionally maps a node to a function of its
        result returning the successors to run. Start it like any workflow, by name."""
        spec = build_graph(name, nodes, edges, branch)
        for node, step in spec.nodes.items():
            if not isinstance(getattr(step, "pikku_step", None), StepDefinition):
                raise InvalidInputError(f"graph {name!r}: node {node!r} is not a pikku step")

        def graph_workflow(wf: WorkflowContext, data: Any) -> dict[str, Any]:
            return run_graph(spec, wf, data)

        definition = make_workflow(graph_workflow, name, source=spec.describe())
        self.registry.add_workflow(definition)
        return definition

    # --- runs -----------------------------------------------------------------------------

    def start(self, workflow: str | Callable[..., Any], data: Any = None, *,
              run_id: str | None = None, inline: bool = False) -> str:
        """Start a run and return its id. With ``run_id`` the start is idempotent: the same
        id returns the same run. With ``inline=True`` the run is orchestrated and its steps
        executed in this process (still under the run lease and the claim layer), and this
        call returns once it has ended."""
        run, _ = self.engine.create_run(workflow, data, run_id=run_id)
        if inline:
            run_inline(self.engine, run.run_id)
        elif not run.is_terminal:
            self.engine.dispatcher.wake_run(run.run_id)
        return run.run_id

    def get_run(self, run_id: str) -> WorkflowRun:
        return self.engine.get_run(run_id)

    def get_steps(self, run_id: str) -> list[StepState]:
        return self.engine.get_steps(run_id)

    def get_history(self, run_id: str) -> list[StepAttempt]:
        return self.engine.get_history(run_id)

    def wait(self, run_id: str, timeout: float) -> WorkflowRun:
        """Block until the run is completed, failed or cancelled and return it;
        ``TimeoutError`` only when ``timeout`` seconds pass first."""
        return self.engine.wait(run_id, timeout)

    def resume(self, run_id: str) -> bool:
        """Resume a run suspended by ``wf.suspend(reason)``. Returns ``False`` if it was not
        suspended."""
        return self.engine.resume(run_id)

    def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel the run durably; in-flight steps are fenced and told through their
        context. Returns ``False`` if the run had already ended."""
        return self.engine.cancel(run_id, reason)

    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50, created_before: WorkflowRun | None = None
                  ) -> list[WorkflowRun]:
        """Newest first, at most ``limit``; pass the last run of a page as
        ``created_before`` for the next page."""
        before_ms = before_id = None
        if created_before is not None:
            before_ms = round(created_before.created_at.timestamp() * 1000)
            before_id = created_before.run_id
        return self.engine.store.list_runs(workflow=workflow, status=status, limit=limit,
                                           created_before_ms=before_ms,
                                           before_run_id=before_id)

    def reap(self) -> dict[str, int]:
        """Sweep for lost work now (workers also do this every ``reaper_interval``)."""
        return self.engine.reap()

    def beat_schedule_entry(self, every: Duration | None = None) -> dict[str, Any]:
        """An optional beat entry: ``app.conf.beat_schedule = {"pikku-reaper":
        pikku.beat_schedule_entry()}``. Workers already reap without beat."""
        interval = self.reaper_interval_s if every is None else to_seconds(every)
        return {"task": REAP, "schedule": interval}

    # --- worker lifecycle -----------------------------------------------------------------

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is self.app:
            self._reaper.start()

    def _on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        self._reaper.stop()


def get_pikku(celery_app: Celery) -> PikkuCelery:
    """The ``PikkuCelery`` bound to ``celery_app`` (what a tool given ``-A proj`` needs)."""
    found = getattr(celery_app, "pikku", None)
    if not isinstance(found, PikkuCelery):
        raise LookupError(f"no PikkuCelery is bound to Celery app {celery_app.main!r}")
    return found


def _positive_ms(value: Duration, what: str) -> int:
    ms = to_ms(value, what=what)
    if ms <= 0:
        raise ValueError(f"invalid {what}: {value!r} (must be greater than zero)")
    return ms
