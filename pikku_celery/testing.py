"""The test kit: test your workflows with no broker, no Redis, no MongoDB and no waiting.

    # conftest.py
    pytest_plugins = ["pikku_celery.testing"]

    # test_orders.py
    def test_an_order_ships(pikku_inline):
        run_id = pikku.start("order", {"order_id": "o-1"})
        assert pikku.get_run(run_id).status == "completed"
        assert [a.status for a in pikku_inline.attempts(run_id, "charge")] == [
            "failed", "succeeded"]

For one test, the fixture ``pikku_inline`` gives every ``PikkuCelery`` of the process (the
ones that exist and the ones the test creates) an engine of its own on an in-memory store
and in-memory leases, whose dispatcher runs the work at once in the calling thread instead
of sending Celery messages: ``pikku.start`` returns when the run has ended (or is
suspended), ``pikku.resume`` and ``pikku.cancel`` likewise. Timers (``wf.sleep``, retry
delays, a re-wake) never wait: the kit's clock jumps to the next one when nothing else is
left to do, so a one-hour sleep and three retries take milliseconds. Everything else is the
engine your workers run: the claim layer, fencing, replay, history, signals.
``inline(pikku)`` does the same for one instance, as a context manager.

To see a run wait (decide an approval before its expiry, assert a sleep has not ended yet),
hold the timers: ``inline(pikku, hold_timers=True)``, ``@pytest.mark.pikku_hold_timers`` on a
test using ``pikku_inline``, or ``kit.hold_timers()``. The clock then only moves as real time
does and by ``kit.advance("10m")``, which fires every timer due and runs what it wakes;
``kit.release_timers()`` goes back to jumping. ``time.sleep`` in a step body is real time
either way: the kit's clock is not Python's.

Schedules (``pikku.schedule``) tick when the clock advances: ``kit.advance("1h")`` starts
the run of each tick in that hour, in order (``InlineKit.advance``), as workers that stayed
up would; ``wf.scheduled_for`` is the tick.

Nothing is connected, configured or read from ``app.conf``'s URLs: a project whose Celery
app is configured for production imports and tests as it is. After the test, each instance
goes back to the engine it had, and the kit's store is dropped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pikku_celery.engine.facade import Engine
from pikku_celery.leases.memory import InMemoryLeaseService, wall_clock_ms
from pikku_celery.model.durations import Duration, to_ms
from pikku_celery.model.errors import WorkflowRunNotFoundError
from pikku_celery.model.records import StepAttempt, StepState, WorkflowRun
from pikku_celery.schedules.firing import Scheduler
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.worker import shared
from pikku_celery.worker.inline import DrivingDispatcher

if TYPE_CHECKING:
    from pikku_celery.app import EngineFactory, PikkuCelery

MAX_TICKS = 10_000  # schedule ticks one ``advance`` fires at most


class VirtualClock:
    """Real time, plus every wait the kit skipped: it runs forward as time does, and
    ``sleep_until`` jumps instead of sleeping. Never goes back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start_ms = wall_clock_ms()
        self._start_monotonic = time.monotonic()
        self._skipped_ms = 0

    def now_ms(self) -> int:
        with self._lock:
            return self._now_locked()

    def _now_locked(self) -> int:
        elapsed_ms = int((time.monotonic() - self._start_monotonic) * 1000)
        return self._start_ms + elapsed_ms + self._skipped_ms

    def observe(self, server_ms: int, sent_monotonic: float) -> None:
        """Nothing to learn: the leases read this very clock."""

    def sleep_until(self, due_ms: int) -> None:
        with self._lock:
            self._skipped_ms += max(0, due_ms - self._now_locked())

    def advance(self, duration: Duration) -> None:
        """Move the clock forward by ``duration`` (seconds, ``timedelta`` or ``"1h"``)."""
        with self._lock:
            self._skipped_ms += to_ms(duration, what="advance")

    def advance_to(self, when_ms: int) -> None:
        """Move the clock forward to ``when_ms`` (nothing when it is there already)."""
        with self._lock:
            self._skipped_ms += max(0, when_ms - self._now_locked())

    @property
    def skipped_s(self) -> float:
        """How much time the kit skipped so far, in seconds."""
        with self._lock:
            return self._skipped_ms / 1000


class InlineKit:
    """What ``pikku_inline`` and ``inline(pikku)`` give a test: the clock, its timers and
    the readers."""

    def __init__(self, *, hold_timers: bool = False) -> None:
        self.clock = VirtualClock()
        self._lock = threading.Lock()
        self._engines: list[Engine] = []
        self._hold = hold_timers
        self._instances: list[PikkuCelery] = []
        self._schedulers: dict[int, Scheduler] = {}  # by id of the engine

    # --- timers -------------------------------------------------------------------------

    @property
    def timers_held(self) -> bool:
        """Whether the clock waits for ``advance`` instead of jumping to the next timer."""
        return self._hold

    def hold_timers(self) -> None:
        """From now on the clock no longer jumps: runs stop at their sleeps, retry delays
        and expiring approvals (a gate can be decided before its expiry) until ``advance``
        moves the clock past them. What ``hold_timers=True`` and the ``pikku_hold_timers``
        marker do from the start."""
        self._hold = True

    def release_timers(self) -> None:
        """Let the clock jump again, and run every waiting run on to its end (or to a
        suspension) at once, as the kit does by default."""
        self._hold = False
        self._drive()
        self.advance(0)  # and the schedules' ticks the jumps made due

    def advance(self, duration: Duration) -> None:
        """Move the clock forward by ``duration`` (seconds, ``timedelta`` or ``"10m"``),
        then fire every timer now due and run what it wakes, in this thread, until the runs
        wait again (for a later timer, a gate, a resume) or end.

        Schedules (``pikku.schedule``) tick on the way, as on workers that stay up: the
        clock stops at each tick up to the new time, in order, fires the timers due by
        then, and starts the tick's run (which runs here, to its end or its first wait).
        Every tick counts (none is "missed": the kit's workers never stopped), at most
        ``MAX_TICKS`` per call. Ticks that fall due beyond the new time, when the clock
        jumps to a later timer (timers not held), fire at the next ``advance``
        (``advance(0)`` fires what is due now)."""
        step_ms = to_ms(duration, what="advance")
        # The instances' engines first: building one saves its schedules, whose first tick
        # follows the time of that save. The target is read just after, so a day advanced
        # holds a day of ticks however long the build took (read before it, a build that
        # ran past a tick lost that tick: 2,879 runs of a 30 s schedule in a day, once).
        self._build_engines()
        target = self.clock.now_ms() + step_ms
        ticks = 0
        next_ms = self._fire_schedules()
        while next_ms is not None and next_ms <= target:
            ticks += 1
            if ticks > MAX_TICKS:
                raise RuntimeError(f"the test kit fired more than {MAX_TICKS} schedule ticks "
                                   f"in one advance; advance less at a time, or pause the "
                                   f"schedules the test does not need")
            self.clock.advance_to(next_ms)
            self._drive()
            next_ms = self._fire_schedules()
        self.clock.advance_to(target)
        self._drive()

    def _build_engines(self) -> None:
        """Build the kit engine of every instance with schedules (saving its schedules)."""
        with self._lock:
            instances = list(self._instances)
        for pikku in instances:
            if pikku.registry.schedules:
                pikku.engine  # noqa: B018

    def _fire_schedules(self) -> int | None:
        """Fire the due ticks of every instance's schedules; the earliest next tick."""
        self._build_engines()
        with self._lock:
            schedulers = list(self._schedulers.values())
        found = [t for s in schedulers if (t := s.fire_due(every_tick=True)) is not None]
        return min(found, default=None)

    def adopt(self, pikku: PikkuCelery) -> None:
        """Fire ``pikku``'s schedules too (the kit's ``inline`` and fixture do it)."""
        with self._lock:
            self._instances.append(pikku)

    def _drive(self) -> None:
        while True:
            with self._lock:
                ready = [d for e in self._engines
                         if isinstance(d := e.dispatcher, DrivingDispatcher)
                         and not d.working_here and d.has_work()]
            if not ready:
                return
            for dispatcher in ready:
                dispatcher.drain()

    # --- reading runs -------------------------------------------------------------------

    def run(self, run_id: str) -> WorkflowRun:
        """The run, from whichever instance holds it."""
        return self._engine_of(run_id).get_run(run_id)

    def steps(self, run_id: str) -> dict[str, StepState]:
        """The run's steps by step name, in creation order."""
        return {s.step_name: s for s in self._engine_of(run_id).get_steps(run_id)}

    def attempts(self, run_id: str, step_name: str | None = None) -> list[StepAttempt]:
        """Every attempt of the run (of one step with ``step_name``), in order."""
        return [a for a in self._engine_of(run_id).get_history(run_id)
                if step_name is None or a.step_name == step_name]

    @property
    def skipped_s(self) -> float:
        """How much waiting (sleeps, retry delays) the kit skipped, in seconds."""
        return self.clock.skipped_s

    # --- binding ------------------------------------------------------------------------

    def engine_factory(self) -> EngineFactory:
        def build(pikku: PikkuCelery) -> Engine:
            engine = pikku.make_engine(
                store=InMemoryWorkflowStore(),
                leases=InMemoryLeaseService(clock_ms=self.clock.now_ms),
                clock=self.clock, dispatcher=lambda engine: DrivingDispatcher(
                    engine, holds_timers=lambda: self._hold))
            scheduler = Scheduler(engine)
            scheduler.sync()  # its schedules tick from now on the kit's clock
            with self._lock:
                self._engines.append(engine)
                self._schedulers[id(engine)] = scheduler
            return engine
        return build

    def close(self) -> None:
        with self._lock:
            engines, self._engines = self._engines, []
        for engine in engines:
            engine.heartbeat.stop()

    def _engine_of(self, run_id: str) -> Engine:
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            if engine.store.get_run(run_id) is not None:
                return engine
        raise WorkflowRunNotFoundError(run_id)


@contextlib.contextmanager
def inline(pikku: PikkuCelery, *, hold_timers: bool = False) -> Iterator[InlineKit]:
    """For the ``with`` block, ``pikku`` runs every started run inline to its end on an
    in-memory store and leases, with a virtual clock (see the module docstring); with
    ``hold_timers=True`` the clock moves only by ``kit.advance``."""
    kit = InlineKit(hold_timers=hold_timers)
    kit.adopt(pikku)
    previous = pikku._override_engine(kit.engine_factory())
    try:
        yield kit
    finally:
        pikku._override_engine(*previous)
        kit.close()


@contextlib.contextmanager
def inline_everywhere(*, hold_timers: bool = False) -> Iterator[InlineKit]:
    """``inline`` for every ``PikkuCelery`` of the process, existing and created within
    the block: what the ``pikku_inline`` fixture does."""
    kit = InlineKit(hold_timers=hold_timers)
    factory = kit.engine_factory()
    restore: list[tuple[PikkuCelery, Any]] = []
    lock = threading.Lock()

    def enter(pikku: PikkuCelery) -> None:
        kit.adopt(pikku)
        previous = pikku._override_engine(factory)
        with lock:
            restore.append((pikku, previous))

    stop = shared.on_every_instance(enter)
    try:
        yield kit
    finally:
        stop()
        with lock:
            entered = list(reversed(restore))
        for pikku, previous in entered:
            pikku._override_engine(*previous)
        kit.close()


if TYPE_CHECKING or importlib.util.find_spec("pytest") is not None:
    import pytest

    HOLD_TIMERS_MARKER = "pikku_hold_timers"

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers", f"{HOLD_TIMERS_MARKER}: pikku_inline's clock does not jump to the "
                       "next timer; the test moves it with pikku_inline.advance(duration)")

    @pytest.fixture
    def pikku_inline(request: pytest.FixtureRequest) -> Iterator[InlineKit]:
        """Every ``PikkuCelery`` of the process runs inline, in memory, on a virtual clock
        for this test; the value reads runs' steps and attempts (``InlineKit``). Under
        ``@pytest.mark.pikku_hold_timers`` the clock waits for ``advance``."""
        held = request.node.get_closest_marker(HOLD_TIMERS_MARKER) is not None
        with inline_everywhere(hold_timers=held) as kit:
            yield kit


__all__ = ["InlineKit", "VirtualClock", "inline", "inline_everywhere", "pikku_inline"]
