"""``ScheduleTicker``: the thread in every worker's main process that fires the schedules'
ticks, beside the reaper (started on Celery's ``worker_ready``, stopped on
``worker_shutdown``: ``PikkuCelery`` connects both).

Each round reads the process's declared schedules (one query by ``_id``), fires the due
ticks (``firing.Scheduler``) and sleeps until the earliest next tick, at most
``REFRESH_S`` (so a pause, a resume or a schedule saved by another worker is seen within
that), on the lease service's clock (``engine.now_ms()``), the clock every worker shares:
a 2 s schedule fires on time on a worker whose own clock is off. No lease: every worker
fires every due tick, and the tick's derived run id makes that one run. Several workers
thus also cover for each other at once: a killed worker's ticks are fired by the others.

Liveness: a round that fails (the store or Redis not answering, a stalled primary: every
round runs under a deadline) is logged once, with its traceback, and retried with a
backoff from 1 s doubling to ``MAX_BACKOFF_S``, quietly, until a round succeeds (one line
then). Anything else that escapes is logged before the thread ends; the thread never dies
silently. When the worker starts, the round first writes the process's declarations to the
store (``Scheduler.sync``), and tries again each round until that succeeds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import redis
from celery import signals
from pymongo.errors import ConnectionFailure

from pikku_celery.schedules.firing import Scheduler, SchedulerHost
from pikku_celery.store._concerns import deadline

log = logging.getLogger("pikku_celery")

REFRESH_S = 2.0  # the longest sleep between rounds
MIN_WAIT_S = 0.01
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
ROUND_DEADLINE_S = 30.0  # every store call of one round ends within this


class ScheduleTicker:
    def __init__(self, engine_ref: Callable[[], SchedulerHost], *,
                 refresh_s: float = REFRESH_S) -> None:
        self._engine = engine_ref
        self.refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scheduler: Scheduler | None = None
        self._synced = False
        self.failures = 0  # rounds failed in a row

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pikku-schedules",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._stop.wait(self.step())
        except BaseException:
            log.critical("pikku: the schedule ticker of this worker stopped; no schedule "
                         "tick fires from it until the worker restarts", exc_info=True)
            raise

    def step(self) -> float:
        """One round, its failure logged; returns how long to wait before the next."""
        try:
            wait_s = self.round()
        except Exception as exc:
            self.failures += 1
            self._report(exc)
            backoff = float(min(MAX_BACKOFF_S, BACKOFF_S * 2.0 ** min(self.failures - 1, 16)))
            if self.failures == 1 and _outage(exc):
                # The worker's reaper names the service that does not answer, once: the
                # ticks only say they wait for it, with no traceback.
                log.warning("pikku: schedules: no tick fires while a service does not "
                            "answer (%s: %s); retrying with a backoff up to %g s, quietly",
                            type(exc).__name__, exc, MAX_BACKOFF_S)
            elif self.failures == 1:
                log.error("pikku: schedules: a round failed; retrying with a backoff up to "
                          "%g s, quietly (one line when a round succeeds again)",
                          MAX_BACKOFF_S, exc_info=exc)
            else:
                log.debug("pikku: schedules: round failed again: %s", exc)
            return backoff
        if self.failures:
            log.warning("pikku: schedules: a round succeeded again after %d failed; "
                        "ticks fire again", self.failures)
            self.failures = 0
        return wait_s

    def _report(self, exc: Exception) -> None:
        """A failed round, told to the engine's observers (``service_error``)."""
        try:
            emit = getattr(self._engine(), "emit", None)
            if emit is not None:
                emit("service_error", "schedules", where="schedules", exception=exc)
        except Exception:  # no engine (a setting missing): the round's own log says why
            pass

    def round(self) -> float:
        """Fire what is due; return the time to the earliest next tick, in seconds
        (``MIN_WAIT_S`` to ``refresh_s``). Raises what a store or lease call raised."""
        engine = self._engine()
        scheduler = self._scheduler
        if scheduler is None or scheduler.host is not engine:
            scheduler = self._scheduler = Scheduler(engine)
            self._synced = False
        with deadline(ROUND_DEADLINE_S):  # a stalled primary must not hold the thread
            if not self._synced:
                scheduler.sync()
                self._synced = True
            next_ms = scheduler.fire_due()
        if next_ms is None:
            return self.refresh_s
        wait_s = (next_ms - engine.now_ms()) / 1000
        return float(min(self.refresh_s, max(MIN_WAIT_S, wait_s)))


class _Bound(Protocol):
    """What the worker hook uses of ``PikkuCelery`` (which imports this module)."""

    @property
    def app(self) -> Any: ...

    @property
    def settings(self) -> Any: ...

    @property
    def engine(self) -> Any: ...


class WorkerTicker:
    """Runs a ``ScheduleTicker`` in every worker of ``pikku``'s Celery app that runs the
    reaper (``worker_reaper``, on by default): started on ``worker_ready``, in the worker's
    main process, stopped on ``worker_shutdown``. ``connect`` wires it."""

    def __init__(self, pikku: _Bound) -> None:
        self._pikku = pikku
        self.ticker: ScheduleTicker | None = None

    def connect(self) -> WorkerTicker:
        uid = f"pikku-ticker-{id(self)}"  # Celery < 5.7: one bound method per function else
        signals.worker_ready.connect(self.ready, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self.shutdown, weak=False, dispatch_uid=uid)
        return self

    def ready(self, sender: Any = None, **_: Any) -> None:
        pikku = self._pikku
        if getattr(sender, "app", None) is not pikku.app:
            return
        try:
            enabled = bool(pikku.settings.worker_reaper)
        except Exception:  # pikku's own worker_ready handler names what is missing
            return
        if not enabled:
            return
        if self.ticker is None:
            self.ticker = ScheduleTicker(lambda: pikku.engine)
        self.ticker.start()

    def shutdown(self, sender: Any = None, **_: Any) -> None:
        if self.ticker is not None:
            self.ticker.stop()


def _outage(exc: BaseException) -> bool:
    """A service that does not answer (MongoDB, Redis, the network), not a fault of the
    round's own."""
    return isinstance(exc, (ConnectionFailure, redis.exceptions.ConnectionError,
                            redis.exceptions.TimeoutError, ConnectionError, TimeoutError))
