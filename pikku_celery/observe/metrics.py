"""Prometheus metrics (``pip install pikku-celery[metrics]``): what the engine reports
(``engine.protocols.Emit``), counted into prometheus-client's default registry whenever it is
installed, or the registry the Celery setting ``pikku_metrics_registry`` names.

Counted in the process that did the work, as the events are sent: a step run in place in the
worker process whose pass ran it, a sent step in the process whose task ran it. A Celery
prefork worker is several processes, so its counts are only whole with prometheus-client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, to an empty directory, before the
worker starts): every process writes its samples there and the worker's main process serves
their sums (``serve.py``). Labels are bounded: workflow and step task names, outcomes,
statuses and kinds, never a run id nor a step name (a loop's step names grow).

The names and meanings are documented in ``docs/guide/observability.md``; ``FAMILIES`` is
the one list of them."""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

from pikku_celery.observe import Observer

log = logging.getLogger("pikku_celery")

# Seconds: a step in place takes a few milliseconds, a sent one tens, a body may take minutes.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 300.0)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
               21600.0, 86400.0)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

#: (kind, name, help, labels, buckets) of every family this module counts into.
FAMILIES: tuple[tuple[str, str, str, tuple[str, ...], tuple[float, ...] | None], ...] = (
    ("counter", "pikku_step_attempts", "Step attempts that ended, by outcome: succeeded, "
     "failed, superseded (its outcome refused), lease_expired (its worker stopped; found "
     "by the reaper)", ("step", "outcome"), None),
    ("histogram", "pikku_step_attempt_duration_seconds", "Time from an attempt's claim to "
     "its outcome", ("step", "outcome"), STEP_BUCKETS),
    ("counter", "pikku_step_attempts_started", "Step attempts claimed", ("step", "in_place"),
     None),
    ("counter", "pikku_runs_started", "Runs created", ("workflow",), None),
    ("counter", "pikku_runs_finished", "Runs ended, by status (completed, failed, "
     "cancelled)", ("workflow", "status"), None),
    ("histogram", "pikku_run_duration_seconds", "Time from a run's creation to its end",
     ("workflow", "status"), RUN_BUCKETS),
    ("histogram", "pikku_pass_duration_seconds", "Orchestration passes, by workflow and "
     "outcome (ended, waiting, busy, lost, error)", ("workflow", "outcome"), STEP_BUCKETS),
    ("counter", "pikku_reaper_recoveries", "Lost work the reaper resumed, by kind (lapsed, "
     "due, stalled, slots, events, children)", ("kind",), None),
    ("histogram", "pikku_schedule_lag_seconds", "Time from a schedule's tick to the start "
     "of its run", ("schedule",), LAG_BUCKETS),
    ("counter", "pikku_events_sent", "Events sent to runs (wf.wait_for_event)", (), None),
    ("counter", "pikku_events_taken", "Events runs took", (), None),
    ("counter", "pikku_service_errors", "MongoDB and Redis errors, by service, kind (the "
     "exception's class) and where", ("service", "kind", "where"), None),
)

#: Where a step task's event comes from: the sender names the step's task.
_ATTEMPT_ENDS = ("step_attempt_finished", "step_attempt_superseded")


def _client() -> Any:
    """prometheus_client, or None when it is not installed."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        return None


class Metrics:
    """The families of ``FAMILIES`` in one registry (one set per registry and process:
    prometheus-client refuses a name registered twice, and every ``PikkuCelery`` of a
    process shares them)."""

    def __init__(self, client: Any, registry: Any) -> None:
        self.registry = registry
        self.families: dict[str, Any] = {}
        for kind, name, doc, labels, buckets in FAMILIES:
            cls = client.Counter if kind == "counter" else client.Histogram
            extra = {} if buckets is None else {"buckets": buckets}
            self.families[name] = cls(name, doc, labels, registry=registry, **extra)
        self._children: dict[tuple[str, ...], Any] = {}
        self.local = threading.local()  # per thread: the workflows of the passes it runs

    def child(self, name: str, *labels: str) -> Any:
        """The child of family ``name`` for ``labels`` (the family itself when it has no
        labels)."""
        key = (name, *labels)
        found = self._children.get(key)
        if found is None:
            family = self.families[name]
            found = self._children[key] = family.labels(*labels) if labels else family
        return found

    def __call__(self, event: str, sender: str, fields: dict[str, Any]) -> None:
        handler = _HANDLERS.get(event)
        if handler is not None:
            handler(self, sender, fields)


def _attempt_started(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    in_place = fields.get("in_place")
    m.child("pikku_step_attempts_started",
        sender, "unknown" if in_place is None else str(bool(in_place)).lower()).inc()


def _attempt_ended(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    outcome = str(fields.get("status") or "unknown")
    m.child("pikku_step_attempts", sender, outcome).inc()
    duration = fields.get("duration")
    if duration is not None:
        m.child("pikku_step_attempt_duration_seconds", sender, outcome).observe(duration)


def _lease_expired(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    m.child("pikku_step_attempts", sender, "lease_expired").inc()


def _run_started(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    m.child("pikku_runs_started", fields.get("workflow") or sender).inc()


def _run_finished(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    _seen(m, fields)
    workflow, status = fields.get("workflow") or sender, str(fields.get("status"))
    m.child("pikku_runs_finished", workflow, status).inc()
    duration = fields.get("duration")
    if duration is not None:
        m.child("pikku_run_duration_seconds", workflow, status).observe(duration)


def _pass_started(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    _seen(m, fields)


def _seen(m: Metrics, fields: dict[str, Any]) -> None:
    """Note the workflow of a run a pass in this thread works on (from the pass's start,
    or the run's end inside it): a pass's end may not know it."""
    workflow = fields.get("workflow")
    if workflow:
        workflows = m.local.__dict__.setdefault("workflows", {})
        if len(workflows) >= 64:  # a run ended outside a pass (a cancel) is never popped
            workflows.clear()
        workflows[fields.get("run_id")] = workflow


def _pass_finished(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    noted = m.local.__dict__.get("workflows", {}).pop(fields.get("run_id"), None)
    # ``unknown``: a pass that never read its run (one that found it held by another).
    workflow = str(fields.get("workflow") or noted or "unknown")
    m.child("pikku_pass_duration_seconds", workflow, str(fields.get("outcome"))).observe(
        fields.get("duration") or 0.0)
    exception = fields.get("exception")
    if exception is not None:
        _count_error(m, exception, "pass")


def _recovered(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    count = int(fields.get("count") or 0)
    if count > 0:
        m.child("pikku_reaper_recoveries", str(fields.get("kind"))).inc(count)


def _schedule_fired(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    m.child("pikku_schedule_lag_seconds", sender).observe(max(0.0, fields.get("lag") or 0.0))


def _event_sent(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    m.child("pikku_events_sent").inc()


def _event_taken(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    m.child("pikku_events_taken").inc()


def _service_error(m: Metrics, sender: str, fields: dict[str, Any]) -> None:
    _count_error(m, fields.get("exception"), str(fields.get("where") or sender))


def driver_error(exception: BaseException | None) -> tuple[str, str] | None:
    """``(service, kind)`` for an error of MongoDB's or Redis's driver: the first exception
    of ``exception``'s chain (itself, then what it was raised from) whose class is theirs,
    and that class's name; ``None`` for any other error (only the services' are counted)."""
    for _ in range(5):
        if exception is None:
            return None
        module = type(exception).__module__ or ""
        if module.startswith(("pymongo", "bson")):
            return "mongodb", type(exception).__name__
        if module.startswith("redis"):
            return "redis", type(exception).__name__
        exception = exception.__cause__ or exception.__context__
    return None


def _count_error(m: Metrics, exception: Any, where: str) -> None:
    found = driver_error(exception) if isinstance(exception, BaseException) else None
    if found is not None:
        m.child("pikku_service_errors", found[0], found[1], where).inc()


_HANDLERS = {
    "step_attempt_started": _attempt_started,
    "step_attempt_finished": _attempt_ended,
    "step_attempt_superseded": _attempt_ended,
    "step_lease_expired": _lease_expired,
    "run_started": _run_started,
    "run_finished": _run_finished,
    "pass_started": _pass_started,
    "pass_finished": _pass_finished,
    "reaper_recovered": _recovered,
    "schedule_fired": _schedule_fired,
    "event_sent": _event_sent,
    "event_taken": _event_taken,
    "service_error": _service_error,
}

_BY_REGISTRY: dict[int, Metrics] = {}
_LOCK = threading.Lock()


def metrics_for(registry: Any) -> Metrics | None:
    """The families in ``registry`` (``None``: prometheus-client's default one), made once
    per registry and process; ``None`` when prometheus-client is not installed."""
    client = _client()
    if client is None:
        return None
    if registry is None:
        registry = client.REGISTRY
    with _LOCK:
        found = _BY_REGISTRY.get(id(registry))
        if found is None or found.registry is not registry:
            found = _BY_REGISTRY[id(registry)] = Metrics(client, registry)
        return found


def install(pikku: Any) -> Observer | None:
    """The observer counting ``pikku``'s events into the configured registry; ``None``
    when prometheus-client is not installed."""
    if _client() is None:
        return None
    return metrics_for(pikku.settings.metrics_registry)
