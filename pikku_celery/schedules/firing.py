"""``Scheduler``: fires a process's due schedule ticks, and the operations on schedules
(pause, resume, trigger, list). Stateless but for what it has logged: the ticker thread,
the test kit and ``PikkuCelery``'s operations each make one on their engine.

A tick is **on time** when it is found due at most ``MISSED_AFTER_MS`` (10 s) after its
instant; each tick on time starts its run, oldest first, whatever ``catch_up`` says (a busy
worker or a store call that took a few seconds skips nothing). A tick found due longer ago
was **missed**: no worker ran while it fell due (every worker was stopped, or could not
reach the store). ``catch_up`` decides what missed ticks start:

* ``"latest"`` (the default): only the most recent missed tick starts a run; the others
  are skipped (logged);
* ``"all"``: every missed tick starts its run, oldest first, at most ``PER_ROUND`` (100)
  per schedule per round of the ticker (a round follows at once while a schedule is
  behind), and at most the ``MAX_CATCH_UP`` (1000) most recent ones: older ones are
  skipped (logged), so a long outage of a frequent schedule cannot flood the workers;
* ``"none"``: no missed tick starts a run; the schedule goes on from its next tick (the
  latest tick still starts one if it is on time).

Pausing stops a schedule's ticks; resuming it goes on from the first tick after the resume.
The ticks that fell due while it was paused start nothing, whatever ``catch_up`` says:
``catch_up`` is for ticks nobody chose to miss, a pause is a choice. A tick fired as the
pause lands still starts its run (it was claimed before the pause; should its firer stop
before creating the run, the next round of any worker creates it, paused or not).
``trigger`` starts a run now, outside the ticks (paused or not), as a tick of this instant.

Firers disagree near the catch-up boundary: one that read the time (or the schedule)
earlier finds the next tick on time and fires it, one that read it later finds it missed
and fires only the latest. Each fires what it decided only after winning the tick's claim
(the advance past it, ``store._schedules``), and no claim is possible while a tick fired
before has no run yet. So one run per tick, and the ticks' runs are created oldest first:
a tick that a ``catch_up`` decision skipped never starts a run after the tick it fired.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime, timezone
from typing import Any, Protocol

from pikku_celery.engine.protocols import Dispatcher, Emit, no_emit
from pikku_celery.model.errors import (
    InvalidInputError,
    WorkflowNotFoundError,
    WorkflowRunConflictError,
)
from pikku_celery.model.keys import scheduled_run_id
from pikku_celery.model.records import CATCH_UP_ALL, CATCH_UP_LATEST, WorkflowRun, WorkflowSchedule
from pikku_celery.store.base import WorkflowStore
from pikku_celery.workflow.definitions import Registry
from pikku_celery.workflow.schedule_spec import ScheduleDefinition, Timing

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

log = logging.getLogger("pikku_celery")

MISSED_AFTER_MS = 10_000  # a tick found due longer ago than this was missed
PER_ROUND = 100  # ticks one schedule fires per round at most
MAX_CATCH_UP = 1000  # "all" fires at most this many missed ticks, the most recent ones


class _CreatesRuns(Protocol):
    def create_run(self, workflow: Any, data: Any, *, run_id: str | None = None,
                   parent: tuple[str, str] | None = None,
                   scheduled: tuple[str, int] | None = None) -> tuple[WorkflowRun, bool]: ...


class SchedulerHost(Protocol):
    """What the scheduler uses of the engine (``engine.Engine``, which this module does not
    import: the engine's modules import nothing of schedules, and this keeps it so)."""

    @property
    def store(self) -> WorkflowStore: ...

    @property
    def dispatcher(self) -> Dispatcher: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def runs(self) -> _CreatesRuns: ...

    def now_ms(self) -> int: ...


def timing_of(schedule: WorkflowSchedule) -> Timing:
    every_ms = None if schedule.every is None else round(schedule.every * 1000)
    return Timing(schedule.cron, every_ms, schedule.tz)


def _ms(schedule: WorkflowSchedule) -> int:
    return round(schedule.next_at.timestamp() * 1000)


class Scheduler:
    def __init__(self, host: SchedulerHost) -> None:
        self.host = host
        self._logged: set[str] = set()

    # --- the declared schedules in the store ----------------------------------------------

    def sync(self) -> None:
        """Write every schedule this process declares to the store (``save_schedule``):
        the stored definition becomes the declared one, its paused flag kept, and its next
        tick too unless the timing changed. What a worker does when it starts."""
        now = self.host.now_ms()
        for definition in self.host.registry.schedules.values():
            self._save(definition, now)

    def _save(self, definition: ScheduleDefinition, now: int) -> WorkflowSchedule:
        state, wrote = self.host.store.save_schedule(definition.stored(),
                                                     definition.timing.after(now), now)
        if wrote:
            log.info("pikku: schedule %s of %s saved; next tick %s%s", state.name,
                     state.workflow, state.next_at.isoformat(),
                     " (paused)" if state.paused else "")
        return state

    def _stored(self, name: str) -> WorkflowSchedule:
        """The stored schedule ``name`` (saved first when this process declares it and the
        store has none yet); ``InvalidInputError`` for a schedule nobody declared."""
        state = self.host.store.get_schedule(name)
        if state is not None:
            return state
        declared = self.host.registry.schedules.get(name)
        if declared is None:
            known = sorted(self.host.registry.schedules)
            raise InvalidInputError(f"no schedule named {name!r}; declared here: "
                                    f"{', '.join(known) or 'none'}")
        return self._save(declared, self.host.now_ms())

    # --- firing ---------------------------------------------------------------------------

    def fire_due(self, *, every_tick: bool = False) -> int | None:
        """One round: fire the due ticks of every live schedule this process declares
        (saving those the store lacks), as ``catch_up`` says (the module's docstring).
        ``every_tick``: every due tick counts as on time (the test kit, whose clock jumps
        while its "workers" run). Returns the earliest next tick (epoch ms) of those
        schedules, or ``None`` when none is live: when to look again."""
        declared = self.host.registry.schedules
        if not declared:
            return None
        now = self.host.now_ms()
        found = {s.name: (s, firing)
                 for s, firing in self.host.store.schedules_firing(sorted(declared))}
        for name in sorted(set(declared) - set(found)):  # new, or deleted by hand
            found[name] = (self._save(declared[name], now), None)
        earliest: int | None = None
        for name in sorted(found):
            state, firing = found[name]
            try:
                if firing is not None:  # claimed, its run maybe not created (paused or not)
                    self._started(state, firing, now)
                if state.paused:
                    continue
                next_ms = self._fire_schedule(state, now, every_tick)
            except (WorkflowNotFoundError, InvalidInputError) as exc:
                # This process cannot start the run (a workflow it does not have, data a
                # newer deploy saved that it cannot take): the tick stays due for another.
                self._once(f"{name}:{exc}", logging.ERROR, "pikku: schedule %s: cannot "
                           "start its tick here: %s", name, exc)
                next_ms = _ms(state)
            if next_ms is not None and (earliest is None or next_ms < earliest):
                earliest = next_ms
        return earliest

    def _fire_schedule(self, state: WorkflowSchedule, now: int, every_tick: bool
                       ) -> int | None:
        """Fire ``state``'s due ticks (at most ``PER_ROUND``); return its next tick.

        A tick is claimed before its run is created: the advance past it (one firer wins)
        records it as being started, and no advance is possible until ``started_tick``
        says its run exists. Creating the run first let a firer whose decision was stale
        (the module's docstring) start a tick that another had skipped, after the run of
        the latest tick that other one fired."""
        self.host.registry.workflow(state.workflow)  # one this process lacks: claim nothing
        timing, next_ms = timing_of(state), _ms(state)
        for _ in range(PER_ROUND):
            if next_ms > now:
                break
            tick, to_ms = self._decide(state, timing, next_ms, now, every_tick)
            if self.host.store.advance_schedule(state.name, next_ms, to_ms, now,
                                                fired_ms=tick):
                if tick is not None:
                    self._started(state, tick, now)
                next_ms = to_ms
                continue
            # Moved or paused by another writer, or a tick fired before still has no run.
            current = self._finish_firing(state.name, now)
            if current is None or current.paused:
                return None
            state, timing, next_ms = current, timing_of(current), _ms(current)
        return next_ms

    def _started(self, state: WorkflowSchedule, tick: int, now: int) -> None:
        """Create the claimed ``tick``'s run, then record that it exists. A firer stopping
        in between leaves the tick claimed: the next firer creates its run (once)."""
        self._start(state, tick, now)
        self.host.store.started_tick(state.name, tick, now)

    def _finish_firing(self, name: str, now: int) -> WorkflowSchedule | None:
        """Start the tick still being started, if any (its firer stopped, or is slow:
        the run is created once either way); the schedule as it stands then."""
        read = self.host.store.schedules_firing([name])
        if not read:
            return None
        current, firing = read[0]
        if firing is None:
            return current
        self._started(current, firing, now)
        return self.host.store.get_schedule(name)

    def _decide(self, state: WorkflowSchedule, timing: Timing, next_ms: int, now: int,
                every_tick: bool) -> tuple[int | None, int]:
        """The tick to fire (``None``: none) and the next tick to move to."""
        if every_tick or now - next_ms <= MISSED_AFTER_MS:
            return next_ms, timing.after(next_ms)
        latest = timing.at_or_before(now)
        if state.catch_up == CATCH_UP_ALL:
            oldest = timing.back(now, MAX_CATCH_UP)
            if next_ms < oldest:
                self._skipped(state, next_ms, oldest, "more than the most recent "
                              f"{MAX_CATCH_UP} missed ticks")
                return None, oldest
            return next_ms, timing.after(next_ms)
        on_time = now - latest <= MISSED_AFTER_MS
        if state.catch_up == CATCH_UP_LATEST or on_time:
            self._skipped(state, next_ms, latest, f"catch_up={state.catch_up!r}")
            return latest, timing.after(latest)
        self._skipped(state, next_ms, timing.after(latest), "catch_up='none'")
        return None, timing.after(latest)

    def _skipped(self, state: WorkflowSchedule, from_ms: int, to_ms: int, why: str) -> None:
        """Log the ticks from ``from_ms`` up to (not including) ``to_ms`` as skipped."""
        if to_ms <= from_ms:
            return
        count = len(timing_of(state).ticks(from_ms, to_ms - 1, 1000))
        log.warning("pikku: schedule %s missed %s tick(s) from %s while no worker ran; "
                    "skipped (%s)", state.name, count if count < 1000 else "1000+",
                    _iso(from_ms), why)

    def _start(self, state: WorkflowSchedule, tick: int, now: int) -> str:
        """Create (and wake) the tick's run, once however often it is asked; its id."""
        try:
            run, created = self.host.runs.create_run(state.workflow, state.data,
                                                     scheduled=(state.name, tick))
        except WorkflowRunConflictError:
            # The tick's run exists with other input: the schedule's data changed since
            # another worker fired it. The tick has its run.
            return scheduled_run_id(state.name, tick)
        if created:
            late_ms = now - tick
            if late_ms > MISSED_AFTER_MS:
                log.warning("pikku: schedule %s: tick %s fired %.1f s late: run %s",
                            state.name, _iso(tick), late_ms / 1000, run.run_id)
            else:
                log.info("pikku: schedule %s: tick %s started run %s", state.name,
                         _iso(tick), run.run_id)
            self.host.dispatcher.wake_run(run.run_id)
            emit: Emit = getattr(self.host, "emit", no_emit)  # the engine's
            if emit is not no_emit:
                emit("schedule_fired", state.name, schedule=state.name,
                     workflow=state.workflow, run_id=run.run_id, tick_ms=tick,
                     lag=max(0.0, (self.host.now_ms() - tick) / 1000))
        return run.run_id

    def _once(self, key: str, level: int, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message, *args)

    # --- operations -----------------------------------------------------------------------

    def list(self) -> list[WorkflowSchedule]:
        """Every stored schedule by name, each marked whether this process declares it."""
        declared = self.host.registry.schedules
        return [dataclasses.replace(s, declared=s.name in declared)
                for s in self.host.store.list_schedules()]

    def get(self, name: str) -> WorkflowSchedule:
        state = self._stored(name)
        return dataclasses.replace(state, declared=name in self.host.registry.schedules)

    def pause(self, name: str) -> bool:
        self._stored(name)
        return self.host.store.pause_schedule(name, self.host.now_ms())

    def resume(self, name: str) -> bool:
        state = self._stored(name)
        now = self.host.now_ms()
        return self.host.store.resume_schedule(name, timing_of(state).after(now), now)

    def trigger(self, name: str) -> str:
        state = self._stored(name)
        now = self.host.now_ms()
        return self._start(state, now, now)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat()
