"""A worker serves its metrics: when ``pikku_metrics_port`` is set, the worker's main
process starts prometheus-client's HTTP server on Celery's ``worker_ready`` (and stops it
on ``worker_shutdown``), serving the counts of ``metrics.py`` and the runs waiting in the
store, read at scrape time (``RunsCollector``).

A prefork worker's steps run in its child processes: their counts reach the main process's
server only through prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
an empty directory per worker, set before the worker starts). With it, the server sums
every process's files; without it, it serves the main process's registry alone, and a
prefork worker says so at start."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery import signals

from pikku_celery.model.records import RUN_QUEUED, RUN_RUNNING, RUN_SUSPENDED
from pikku_celery.observe.metrics import _client, driver_error, metrics_for

log = logging.getLogger("pikku_celery")
CACHE_S = 10.0  # a scrape reads the store at most this often (per worker)
COUNT_LIMIT = 100_000  # the store's counts stop there (index-served)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class RunsCollector:
    """``pikku_runs_queued{workflow}`` and ``pikku_runs_active{workflow,status}``: counts
    the store holds, read at scrape time (at most every ``CACHE_S``) for the workflows this
    process declares. A gauge counted from events would drift: a run's start and end are
    seen by different processes, and a worker started after a run began never saw it start.
    Every worker serves the same counts: aggregate with ``max``, not ``sum``."""

    def __init__(self, engine: Callable[[], Any], workflows: Callable[[], list[str]],
                 *, cache_s: float = CACHE_S, clock: Callable[[], float] = time.monotonic,
                 registry: Any = None) -> None:
        self._engine = engine
        self._registry = registry  # where a failed count is counted (None: the default)
        self._workflows = workflows
        self._cache_s = cache_s
        self._clock = clock
        self._read_at: float | None = None
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        counts = self._read()
        queued = GaugeMetricFamily("pikku_runs_queued", "Runs waiting for a slot of their "
                                   "workflow's concurrency limit, as the store holds them",
                                   labels=["workflow"])
        active = GaugeMetricFamily("pikku_runs_active", "Runs not ended (running, "
                                   "suspended), as the store holds them",
                                   labels=["workflow", "status"])
        for (workflow, status), count in sorted(counts.items()):
            if status == RUN_QUEUED:
                queued.add_metric([workflow], count)
            else:
                active.add_metric([workflow, status], count)
        yield queued
        yield active

    def describe(self) -> list[Any]:
        return []  # no store read when registered

    def _read(self) -> dict[tuple[str, str], int]:
        with self._lock:  # two scrapes at once read the store once
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self._cache_s:
                return self._counts
            try:
                engine = self._engine()
                counts: dict[tuple[str, str], int] = {}
                for workflow in sorted(self._workflows()):
                    for status in (RUN_QUEUED, RUN_RUNNING, RUN_SUSPENDED):
                        counts[workflow, status] = engine.store.count_runs(
                            status=status, workflow=workflow, limit=COUNT_LIMIT)
            except Exception as exc:  # the scrape shows the last counts read
                log.warning("pikku: metrics: could not count the runs in the store (%s: "
                            "%s)", type(exc).__name__, exc)
                found = metrics_for(self._registry)
                error = driver_error(exc)
                if found is not None and error is not None:
                    found.child("pikku_service_errors", *error, "metrics").inc()
                return self._counts
            self._counts, self._read_at = counts, now
            return counts


class _Forward:
    """A registry served as it is, beside the collectors the server adds (the user's
    registry is left as it was)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        return iter(self._registry.collect())

    def describe(self) -> list[Any]:
        return []


def served_registry(pikku: Any) -> Any:
    """What a worker of ``pikku`` serves: every process's counts (multiprocess mode) or
    this process's registry, and the runs the store holds."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    served = CollectorRegistry(auto_describe=False)
    registry = pikku.settings.metrics_registry
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(served)  # type: ignore[no-untyped-call]
    else:
        found = metrics_for(registry)
        assert found is not None  # prometheus-client is installed: the caller checked
        served.register(_Forward(found.registry))
    served.register(RunsCollector(lambda: pikku.engine, lambda: list(pikku.registry.workflows),
                                  registry=registry))
    return served


class MetricsServer:
    """Serves ``pikku``'s metrics from a worker's main process (the module's docstring);
    ``connect`` wires it to the worker's signals."""

    def __init__(self, pikku_of: Callable[[], Any], app: Any) -> None:
        self._pikku_of = pikku_of  # the PikkuCelery of ``app``: read when the worker starts
        self._app = app
        self.server: Any = None
        self.port: int | None = None

    def connect(self) -> MetricsServer:
        uid = f"pikku-metrics-{id(self)}"  # Celery < 5.7: one bound method per function else
        signals.worker_ready.connect(self.ready, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self.shutdown, weak=False, dispatch_uid=uid)
        return self

    def ready(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not self._app or self.server is not None:
            return
        pikku = self._pikku_of()
        try:
            port, addr = pikku.settings.metrics_port, pikku.settings.metrics_addr
        except Exception:  # pikku's own worker_ready handler names the bad setting
            return
        if port is None:
            return
        client = _client()
        if client is None:
            log.error("pikku: pikku_metrics_port is set but prometheus-client is not "
                      "installed (pip install pikku-celery[metrics]): no metrics served")
            return
        if not os.environ.get(MULTIPROC_ENV) and _prefork(sender):
            log.warning("pikku: metrics: this prefork worker serves its main process's "
                        "counts only; set %s to an empty directory before starting it to "
                        "count its child processes' work", MULTIPROC_ENV)
        self.start(port, addr)

    def start(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve now; the port served on (``port`` 0: a free one)."""
        from prometheus_client import start_http_server

        self.server, _ = start_http_server(port, addr, registry=served_registry(
            self._pikku_of()))
        self.port = int(self.server.server_port)
        log.info("pikku: metrics served on http://%s:%d/metrics%s", addr, self.port,
                 f" (multiprocess: {os.environ[MULTIPROC_ENV]})"
                 if os.environ.get(MULTIPROC_ENV) else "")
        return self.port

    def shutdown(self, sender: Any = None, **_: Any) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _prefork(sender: Any) -> bool:
    pool = getattr(getattr(sender, "controller", None), "pool", None)
    return "prefork" in type(pool).__module__ if pool is not None else False


def connect(app: Any) -> MetricsServer:
    """Serve the metrics of the ``PikkuCelery`` bound to ``app`` (``app.pikku``) from its
    workers when ``pikku_metrics_port`` is set."""
    return MetricsServer(lambda: app.pikku, app).connect()
