"""A schedule's definition, checked when it is declared, and its ticks.

Ticks depend on the definition alone, never on when or where a worker started, so every
worker and every restart agree on them (and so on the run id each tick starts):

* ``cron``: the instants the expression names (5 fields, or 6 with seconds first; the
  ``cronsim`` parser, which reads ``L``, ``W``, ``#`` and ``@daily``-style names too), in
  the time zone ``tz``, across daylight-saving changes as cron does;
* ``every``: the multiples of the interval since the Unix epoch, so ``every="1h"`` ticks on
  the hour (UTC) and ``every="15m"`` at :00, :15, :30, :45. ``tz`` does not apply (an
  interval is the same length in every zone); use ``cron`` for local times of day.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from pikku_celery.model import keys
from pikku_celery.model.durations import to_ms
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.model.records import CATCH_UPS
from pikku_celery.model.validate import as_stored, check_value
from pikku_celery.store._schedules import NewSchedule

MIN_EVERY_MS = 1000  # a tick is a run: more than one a second is a queue, not a schedule


@dataclass(frozen=True)
class Timing:
    """When a schedule ticks: ``cron`` in ``tz``, or every ``every_ms`` since the epoch.
    Every method takes and gives epoch milliseconds."""

    cron: str | None
    every_ms: int | None
    tz: str = "UTC"

    def after(self, ms: int) -> int:
        """The first tick strictly after ``ms``."""
        if self.every_ms is not None:
            return (ms // self.every_ms + 1) * self.every_ms
        return _ms(next(self._cron(ms, reverse=False)))

    def at_or_before(self, ms: int) -> int:
        """The latest tick at or before ``ms``."""
        if self.every_ms is not None:
            return ms // self.every_ms * self.every_ms
        return _ms(next(self._cron(ms + 1, reverse=True)))

    def ticks(self, start_ms: int, end_ms: int, limit: int) -> list[int]:
        """The ticks from ``start_ms`` to ``end_ms`` (both included), oldest first, at
        most ``limit``."""
        if self.every_ms is not None:
            first = self.after(start_ms - 1)
            last = min(self.at_or_before(end_ms), first + (limit - 1) * self.every_ms)
            return list(range(first, last + 1, self.every_ms)) if limit > 0 else []
        found: list[int] = []
        it = self._cron(start_ms - 1, reverse=False)  # one parse for every tick
        while len(found) < limit and (tick := _ms(next(it))) <= end_ms:
            found.append(tick)
        return found

    def back(self, end_ms: int, n: int) -> int:
        """The ``n``-th latest tick at or before ``end_ms`` (``n`` 1: the latest)."""
        if self.every_ms is not None:
            return self.at_or_before(end_ms) - (n - 1) * self.every_ms
        it = self._cron(end_ms + 1, reverse=True)
        tick = 0
        for _ in range(n):
            tick = _ms(next(it))
        return tick

    def _cron(self, ms: int, *, reverse: bool) -> CronSim:
        assert self.cron is not None
        return CronSim(self.cron, datetime.fromtimestamp(ms / 1000, tz=_zone(self.tz)),
                       reverse=reverse)


@dataclass(frozen=True)
class ScheduleDefinition(NewSchedule):
    """A schedule as declared (``pikku.schedule``): the same in every process that imports
    the app module; its fields are those the store keeps (``NewSchedule``)."""

    @property
    def timing(self) -> Timing:
        return Timing(self.cron, self.every_ms, self.tz)

    def stored(self) -> NewSchedule:
        return NewSchedule(**{f.name: getattr(self, f.name) for f in fields(NewSchedule)})


def make_schedule(name: Any, workflow: str, *, cron: Any = None, every: Any = None,
                  data: Any = None, tz: Any = "UTC", catch_up: Any = "latest",
                  workflow_known: Callable[[str], bool] = lambda _: True
                  ) -> ScheduleDefinition:
    """Check a declaration; every refusal is an ``InvalidInputError`` naming the schedule
    and what was wrong with it."""
    if not keys.is_schedule_name(name):
        raise InvalidInputError(f"schedule name {name!r} must be 1 to 100 "
                                f"{keys.SCHEDULE_NAME_CHARS} (it is part of each tick's "
                                f"run id)")
    what = f"schedule {name!r}"
    if not workflow_known(workflow):
        raise InvalidInputError(f"{what}: no workflow named {workflow!r} is registered "
                                f"(declare the workflow before its schedule)")
    if (cron is None) == (every is None):
        raise InvalidInputError(f"{what}: give exactly one of cron= (an expression) and "
                                f"every= (an interval), got "
                                f"{'both' if cron is not None else 'neither'}")
    if catch_up not in CATCH_UPS:
        raise InvalidInputError(f"{what}: catch_up must be one of "
                                f"{', '.join(map(repr, CATCH_UPS))}, got {catch_up!r}")
    if not isinstance(tz, str):
        raise InvalidInputError(f"{what}: tz must be a time zone name such as "
                                f"'Europe/Helsinki', got {tz!r}")
    try:
        _zone(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidInputError(f"{what}: unknown time zone {tz!r} ({exc})") from None
    every_ms = None
    if every is not None:
        if tz != "UTC":
            raise InvalidInputError(f"{what}: tz applies to cron schedules only (every= "
                                    f"ticks on multiples of the interval since the epoch); "
                                    f"use cron= for a local time of day")
        try:
            every_ms = to_ms(every, what="every")
        except ValueError as exc:
            raise InvalidInputError(f"{what}: {exc}") from None
        if every_ms < MIN_EVERY_MS:
            raise InvalidInputError(f"{what}: every must be at least 1 s, got {every!r}")
    else:
        _check_cron(what, cron, tz)
    check_value(f"data of {what}", data)
    return ScheduleDefinition(name=name, workflow=workflow, cron=cron, every_ms=every_ms,
                              tz=tz, data=as_stored(data), catch_up=catch_up)


def _check_cron(what: str, cron: Any, tz: str) -> None:
    if not isinstance(cron, str) or not cron.strip():
        raise InvalidInputError(f"{what}: cron must be a cron expression such as "
                                f"'0 2 * * *', got {cron!r}")
    try:
        Timing(cron, None, tz).after(0)  # parsed, and it has a tick
    except (CronSimError, StopIteration, ValueError) as exc:
        raise InvalidInputError(f"{what}: bad cron expression {cron!r}: "
                                f"{exc or 'it never ticks'}") from None


def _zone(tz: str) -> tzinfo:
    return ZoneInfo(tz)


def _ms(when: datetime) -> int:
    return round(when.timestamp() * 1000)
