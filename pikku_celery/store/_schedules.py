"""What every store shares about schedules (``pikku.schedule``): the store's protocol for
them, the document a schedule is kept as, and its read model.

A schedule is one document of ``workflow_schedules`` (``_id``: its name) holding its
definition (workflow, cron or every, tz, data, catch_up), ``paused``, ``next_ms`` (the next
tick not yet started), ``last_ms`` (the latest tick fired) and ``firing_ms`` (a tick fired
whose run may not exist yet, ``FIRING``). Every write that moves a schedule on is guarded
on what its writer read: a tick advance on the ``next_ms`` it read and on no tick being
started (so of two workers firing one tick, one moves the schedule and the other's write
does nothing), a pause on the schedule being live, a resume on it being paused, a change of
timing on the timing read. The run a tick starts has an id derived from the tick
(``keys.scheduled_run_id``), so it is created once however many workers start it
(``pikku_celery.schedules``).

A tick is fired in three writes: the advance that moves the schedule past it records it
in ``firing_ms`` (the claim: one firer wins it), then its run is created, then
``started_tick`` clears ``firing_ms``. While it is set no advance is possible: whoever
finds it set creates that tick's run first (``schedules_firing``). So the runs of a schedule's
ticks are created in the order of its ticks, and a tick that a later decision skipped
(``catch_up``) can never start a run after the tick that decision fired.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.keys import ScheduleField as F
from pikku_celery.model.records import CATCH_UPS, WorkflowSchedule
from pikku_celery.model.validate import check_name, check_value

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

Doc = dict[str, Any]
MAX_LISTED = 1000  # schedules one listing returns at most
FIRING = "firing_ms"  # the tick fired whose run may not exist yet (null, or absent: none)


@dataclass(frozen=True)
class NewSchedule:
    """A schedule's definition as a store keeps it (``every_ms``: ms, or ``None``)."""

    name: str
    workflow: str
    cron: str | None
    every_ms: int | None
    tz: str
    data: Any
    catch_up: str

    def same_timing(self, doc: Doc) -> bool:
        """Whether the stored ``doc`` ticks as this definition does."""
        return (doc.get(F.CRON), doc.get(F.EVERY), doc.get(F.TZ)) == (
            self.cron, self.every_ms, self.tz)


@runtime_checkable
class ScheduleStore(Protocol):
    """The schedules part of the store contract (``store._schedules``)."""

    def save_schedule(self, schedule: NewSchedule, next_ms: int, now_ms: int
                      ) -> tuple[WorkflowSchedule, bool]:
        """Keep ``schedule``: insert it (live, its first tick ``next_ms``), or bring the
        stored one to this definition, keeping whether it is paused and its next tick
        unless its timing (cron, every, tz) changed: then its next tick becomes
        ``next_ms`` (guarded on the timing read: of two writers of one new timing, the
        first sets the tick). Returns the schedule as stored and whether this call wrote."""
        ...

    def get_schedule(self, name: str) -> WorkflowSchedule | None: ...

    def list_schedules(self, names: Collection[str] | None = None,
                       limit: int = MAX_LISTED) -> list[WorkflowSchedule]:
        """The schedules named in ``names`` (every schedule when ``None``), by name, at
        most ``limit``."""
        ...

    def advance_schedule(self, name: str, from_ms: int, to_ms: int, now_ms: int, *,
                         fired_ms: int | None = None) -> bool:
        """Move the live schedule's next tick from ``from_ms`` to ``to_ms``; with
        ``fired_ms``, also move its latest fired tick up to it and record it as the tick
        being started (``schedules_firing``) until ``started_tick``. One write guarded on
        ``next_ms == from_ms``, the schedule not paused and no tick being started.
        ``False`` (nothing written) when another writer moved it first, it was paused
        meanwhile, or a tick fired before is still being started."""
        ...

    def schedules_firing(self, names: Collection[str]
                         ) -> list[tuple[WorkflowSchedule, int | None]]:
        """What a firer reads (one read): the schedules named in ``names``, by name, each
        with the tick an advance fired whose ``started_tick`` has not been written (its
        run may not exist: its firer may have stopped between the two), or ``None``."""
        ...

    def started_tick(self, name: str, tick_ms: int, now_ms: int) -> bool:
        """The run of ``tick_ms`` exists: clear it as the tick being started (guarded on it
        being that tick). ``False`` when it was not (another firer cleared it first)."""
        ...

    def pause_schedule(self, name: str, now_ms: int) -> bool:
        """Pause a live schedule; ``False`` when it was paused already (or is unknown)."""
        ...

    def resume_schedule(self, name: str, next_ms: int, now_ms: int) -> bool:
        """Resume a paused schedule, its next tick ``next_ms``; ``False`` when it was not
        paused (or is unknown)."""
        ...


def check_new(schedule: NewSchedule, next_ms: int, now_ms: int) -> None:
    if not keys.is_schedule_name(schedule.name):
        raise InvalidInputError(f"schedule name {schedule.name!r} must be 1 to 100 "
                                f"{keys.SCHEDULE_NAME_CHARS}")
    check_name("workflow name", schedule.workflow)
    if schedule.catch_up not in CATCH_UPS:
        raise InvalidInputError(f"catch_up must be one of {CATCH_UPS}, got "
                                f"{schedule.catch_up!r}")
    check_value(f"data of schedule {schedule.name!r}", schedule.data)
    for what, value in (("next_ms", next_ms), ("now_ms", now_ms)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"{what} must be an int, got {value!r}")


def check_names(names: Collection[str] | None, limit: int) -> list[str] | None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LISTED:
        raise InvalidInputError(f"limit must be an int from 1 to {MAX_LISTED}, got {limit!r}")
    if names is None:
        return None
    if isinstance(names, str):
        raise InvalidInputError("names must be a collection of schedule names, not a string")
    return sorted({check_name("schedule name", n) for n in names})


def new_doc(schedule: NewSchedule, next_ms: int, now_ms: int) -> Doc:
    return {F.ID: schedule.name, **definition_fields(schedule), F.PAUSED: False,
            F.NEXT: next_ms, F.LAST: None, FIRING: None, F.CREATED: now_ms,
            F.UPDATED: now_ms}


def definition_fields(schedule: NewSchedule) -> Doc:
    return {F.WORKFLOW: schedule.workflow, F.CRON: schedule.cron, F.EVERY: schedule.every_ms,
            F.TZ: schedule.tz, F.DATA: schedule.data, F.CATCH_UP: schedule.catch_up}


def timing_filter(doc: Doc) -> Doc:
    """The part of a write's filter that repeats the timing read from ``doc``."""
    return {F.CRON: doc.get(F.CRON), F.EVERY: doc.get(F.EVERY), F.TZ: doc.get(F.TZ)}


def differs(schedule: NewSchedule, doc: Doc) -> bool:
    """Whether the stored ``doc`` holds another definition than ``schedule``."""
    return any(doc.get(k) != v for k, v in definition_fields(schedule).items())


def to_datetime(ms: int | None) -> datetime | None:
    # ``_docs.to_datetime``, which this module cannot import (``_docs`` imports ``base``,
    # which imports this module).
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def schedule_from_doc(doc: Doc) -> WorkflowSchedule:
    every = doc.get(F.EVERY)
    last = doc.get(F.LAST)
    next_at, created, updated = (to_datetime(doc[f]) for f in (F.NEXT, F.CREATED, F.UPDATED))
    assert next_at is not None and created is not None and updated is not None
    return WorkflowSchedule(
        name=doc[F.ID], workflow=doc[F.WORKFLOW], cron=doc.get(F.CRON),
        every=None if every is None else every / 1000, tz=doc.get(F.TZ) or "UTC",
        data=doc.get(F.DATA), catch_up=doc[F.CATCH_UP], paused=bool(doc.get(F.PAUSED)),
        next_at=next_at, last_at=to_datetime(last),
        last_run_id=None if last is None else keys.scheduled_run_id(doc[F.ID], last),
        created_at=created, updated_at=updated)
