"""Schedules (issue 26, item 2) in one process: the declaration refuses bad input with a
clear ``InvalidInputError``; ticks come from the definition alone; the test kit fires due
ticks as its clock advances; each tick starts one run however many workers fire it and
after a crash between the run and the tick's write; ``catch_up`` after an outage; pause,
resume and trigger; and the worker's ticker thread outlives a store outage."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from pikku_celery import PikkuCelery
from pikku_celery.model import keys
from pikku_celery.model.errors import InvalidInputError
from pikku_celery.schedules import firing
from pikku_celery.schedules.firing import MISSED_AFTER_MS, Scheduler
from pikku_celery.schedules.ticker import (
    MAX_BACKOFF_S,
    ROUND_DEADLINE_S,
    ScheduleTicker,
    WorkerTicker,
)
from pikku_celery.store.base import NewRun
from pikku_celery.testing import InlineKit, inline
from pikku_celery.workflow.schedule_spec import Timing

UTC = timezone.utc  # datetime.UTC is Python 3.11+; the package supports 3.10

TEN_MIN = 600_000


def _pikku() -> PikkuCelery:
    pikku = PikkuCelery(Celery(f"sched-{uuid.uuid4().hex[:8]}", broker="memory://"))

    @pikku.step("sched.echo")
    def echo(data: Any) -> Any:
        return data

    @pikku.workflow("report")
    def report(wf: Any, data: Any) -> dict[str, Any]:
        when = wf.scheduled_for
        echoed = wf.do("echo", echo, {"at": None if when is None else when.isoformat()})
        return {"at": echoed["at"], "data": data}

    @pikku.workflow("other")
    def other(wf: Any, data: Any) -> Any:
        return data

    return pikku


@pytest.fixture
def pikku() -> PikkuCelery:
    return _pikku()


@pytest.fixture
def kit(pikku: PikkuCelery) -> Iterator[InlineKit]:
    with inline(pikku, hold_timers=True) as kit:
        yield kit


def _ticks(pikku: PikkuCelery, name: str = "ten") -> list[int]:
    found = []
    for run in pikku.list_runs(limit=1000):
        tick = keys.scheduled_tick(run.run_id)
        if tick is not None and tick[0] == name:
            found.append(tick[1])
    return sorted(found)


def _next_ms(pikku: PikkuCelery, name: str = "ten") -> int:
    return round(pikku.get_schedule(name).next_at.timestamp() * 1000)


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


# --- the declaration ----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    ({"workflow": "nope", "every": "1m"}, r"no workflow named 'nope' is registered"),
    ({"cron": "61 * * * *"}, r"bad cron expression '61 \* \* \* \*'"),
    ({"cron": "not a cron"}, r"bad cron expression"),
    ({"cron": ""}, r"cron must be a cron expression"),
    ({"cron": "* * * * *", "every": "1m"}, r"exactly one of cron= .* got both"),
    ({}, r"exactly one of cron= .* got neither"),
    ({"cron": "0 2 * * *", "tz": "Mars/Olympus"}, r"unknown time zone 'Mars/Olympus'"),
    ({"cron": "0 2 * * *", "tz": 3}, r"tz must be a time zone name"),
    ({"every": "1m", "tz": "Europe/Helsinki"}, r"tz applies to cron schedules only"),
    ({"every": "1m", "catch_up": "some"}, r"catch_up must be one of 'latest', 'all', 'none'"),
    ({"every": "soon"}, r"every"),
    ({"every": "500ms"}, r"every must be at least 1 s"),
    ({"every": "1m", "data": {"$set": 1}}, r"data of schedule 'nightly'"),
    ({"every": "1m", "name": "no spaces"}, r"schedule name 'no spaces' must be 1 to 100"),
    ({"every": "1m", "name": "a@b"}, r"schedule name 'a@b'"),
])
def test_bad_declarations_are_refused_naming_what_is_wrong(
        pikku: PikkuCelery, args: dict[str, Any], message: str) -> None:
    call = {"name": "nightly", "workflow": "report", **args}
    with pytest.raises(InvalidInputError, match=message):
        pikku.schedule(call.pop("name"), call.pop("workflow"), **call)
    assert pikku.registry.schedules == {}


def test_a_name_is_one_definition(pikku: PikkuCelery) -> None:
    first = pikku.schedule("nightly", "report", cron="0 2 * * *", data={"a": 1})
    # The same declaration again (a module imported twice) is the same schedule.
    assert pikku.schedule("nightly", "report", cron="0 2 * * *", data={"a": 1}) == first
    with pytest.raises(InvalidInputError, match="'nightly' is already registered with "
                                                "another definition"):
        pikku.schedule("nightly", "report", cron="0 3 * * *", data={"a": 1})
    with pytest.raises(InvalidInputError, match="already registered"):
        pikku.schedule("nightly", "other", cron="0 2 * * *", data={"a": 1})
    assert pikku.registry.schedules == {"nightly": first}
    # A decorated workflow function names its workflow.
    fn = pikku.registry.workflows["report"].fn
    assert pikku.schedule("by-fn", fn, every="1h").workflow == "report"


def test_ticks_come_from_the_definition_alone() -> None:
    every = Timing(None, TEN_MIN)
    t = 1_800_000_123_456
    assert every.after(t) % TEN_MIN == 0 and every.after(t) - TEN_MIN < t < every.after(t)
    assert every.after(every.after(t)) == every.after(t) + TEN_MIN  # strictly after
    assert every.at_or_before(every.after(t)) == every.after(t)
    assert every.ticks(0, 3 * TEN_MIN, 10) == [0, TEN_MIN, 2 * TEN_MIN, 3 * TEN_MIN]
    assert every.back(3 * TEN_MIN + 5, 2) == 2 * TEN_MIN
    assert every.ticks(1, 3 * TEN_MIN, 2) == [TEN_MIN, 2 * TEN_MIN]
    five = Timing("*/5 * * * *", None)
    assert five.ticks(0, 900_000, 10) == [0, 300_000, 600_000, 900_000]
    assert five.ticks(1, 900_000, 2) == [300_000, 600_000]
    # 09:00 in Helsinki is 07:00 UTC in winter and 06:00 UTC in summer.
    helsinki = Timing("0 9 * * *", None, "Europe/Helsinki")
    winter = round(datetime(2026, 1, 10, tzinfo=UTC).timestamp() * 1000)
    summer = round(datetime(2026, 7, 10, tzinfo=UTC).timestamp() * 1000)
    assert _at(helsinki.after(winter)) == datetime(2026, 1, 10, 7, tzinfo=UTC)
    assert _at(helsinki.after(summer)) == datetime(2026, 7, 10, 6, tzinfo=UTC)
    assert _at(helsinki.back(summer, 2)) == datetime(2026, 7, 8, 6, tzinfo=UTC)


def test_a_tick_s_run_id_is_derived_from_it_and_no_caller_can_take_it(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    tick = 1_800_000_000_250
    run_id = keys.scheduled_run_id("ten", tick)
    assert run_id == "@ten@2027-01-15T08:00:00.250Z"
    assert keys.scheduled_tick(run_id) == ("ten", tick)
    assert keys.scheduled_tick(keys.child_run_id("r", "s")) is None
    assert keys.scheduled_tick("ten@2027-01-15T08:00:00.250Z") is None
    with pytest.raises(InvalidInputError):
        pikku.start("report", {}, run_id=run_id)
    plain = pikku.start("report", {})
    assert pikku.get_run(plain).output == {"at": None, "data": {}}  # wf.scheduled_for
    assert pikku.get_run(plain).scheduled_for is None


# --- the test kit ---------------------------------------------------------------------------


def test_a_schedule_runs_in_the_kit_once_per_tick_as_its_clock_advances(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m", data={"k": 1})
    kit.advance("1h")
    ticks = _ticks(pikku)
    assert len(ticks) == 6 and ticks == list(range(ticks[0], ticks[0] + 6 * TEN_MIN, TEN_MIN))
    for tick in ticks:
        run = pikku.get_run(keys.scheduled_run_id("ten", tick))
        assert run.status == "completed" and run.workflow == "report"
        assert run.output == {"at": _at(tick).isoformat(), "data": {"k": 1}}
        assert (run.schedule, run.scheduled_for) == ("ten", _at(tick))
    kit.advance("5m")
    kit.advance("5m")
    assert len(_ticks(pikku)) == 7  # one more tick in those ten minutes, started once
    [listed] = pikku.list_schedules()
    assert (listed.name, listed.workflow, listed.every, listed.paused, listed.declared) == (
        "ten", "report", 600.0, False, True)
    assert listed.last_at == _at(_ticks(pikku)[-1])
    assert listed.last_run_id == keys.scheduled_run_id("ten", _ticks(pikku)[-1])


def test_the_kit_fires_ticks_without_held_timers_too(pikku: PikkuCelery) -> None:
    pikku.schedule("ten", "report", every="10m")
    with inline(pikku) as kit:
        kit.advance("30m")
        assert len(_ticks(pikku)) == 3
        kit.advance(0)
        assert len(_ticks(pikku)) == 3


def test_the_kit_refuses_to_fire_a_flood_of_ticks(pikku: PikkuCelery, kit: InlineKit,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pikku_celery.testing.MAX_TICKS", 5)
    pikku.schedule("ten", "report", every="10m")
    with pytest.raises(RuntimeError, match="more than 5 schedule ticks in one advance"):
        kit.advance("2h")


# --- one run per tick -----------------------------------------------------------------------


def test_two_workers_firing_one_tick_start_one_run(pikku: PikkuCelery, kit: InlineKit
                                                   ) -> None:
    pikku.schedule("ten", "report", every="10m")
    engine = pikku.engine
    first, second = Scheduler(engine), Scheduler(engine)
    tick = _next_ms(pikku)
    stale = engine.store.get_schedule("ten")  # what both workers read
    assert stale is not None
    kit.clock.advance_to(tick)
    created: list[bool] = []
    original = engine.runs.create_run

    def spy(*args: Any, **kwargs: Any) -> Any:
        run, made = original(*args, **kwargs)
        created.append(made)
        return run, made

    engine.runs.create_run = spy  # type: ignore[method-assign]
    assert first._fire_schedule(stale, tick, False) == tick + TEN_MIN
    # The second read the schedule before the first moved it: it fires the same tick, its
    # claim (the move past the tick) loses, and it reads the schedule again.
    assert second._fire_schedule(stale, tick, False) == tick + TEN_MIN
    assert created == [True]
    assert _ticks(pikku) == [tick]
    assert _next_ms(pikku) == tick + TEN_MIN


@pytest.mark.parametrize("stops", ["before its run", "before started_tick"])
def test_a_firer_that_stops_after_claiming_a_tick_leaves_its_run_to_the_next(
        pikku: PikkuCelery, kit: InlineKit, monkeypatch: pytest.MonkeyPatch,
        stops: str) -> None:
    """A tick is claimed (the schedule moved past it) before its run is created: a firer
    that stops in between leaves it claimed, and the next round, of any worker, creates
    its run (once), long before the schedule's next tick is due."""
    pikku.schedule("ten", "report", every="10m")
    engine = pikku.engine
    store = engine.store
    tick = _next_ms(pikku)
    kit.clock.advance_to(tick + 1000)

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("the worker died here")

    if stops == "before its run":
        monkeypatch.setattr(engine.runs, "create_run", crash)
    else:
        monkeypatch.setattr(store, "started_tick", crash)
    with pytest.raises(ConnectionError):
        Scheduler(engine).fire_due()
    monkeypatch.undo()
    assert _next_ms(pikku) == tick + TEN_MIN  # claimed: no firer can fire it again
    assert _ticks(pikku) == ([] if stops == "before its run" else [tick])
    assert store.schedules_firing(["ten"])[0][1] == tick
    Scheduler(engine).fire_due()  # another worker, or the same one restarted
    assert _ticks(pikku) == [tick]  # one run of the tick
    assert store.schedules_firing(["ten"])[0][1] is None
    assert _next_ms(pikku) == tick + TEN_MIN


def test_a_tick_whose_run_exists_with_other_data_counts_as_fired(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m", data={"v": 1})
    engine = pikku.engine
    tick = _next_ms(pikku)
    # Another worker fired it with the data a newer deploy saved.
    engine.store.create_run(NewRun(keys.scheduled_run_id("ten", tick), "report", {"v": 2},
                                   schedule="ten", scheduled_ms=tick), tick)
    kit.clock.advance_to(tick)
    Scheduler(engine).fire_due()
    assert _ticks(pikku) == [tick] and _next_ms(pikku) == tick + TEN_MIN


def test_a_worker_that_lacks_the_stored_workflow_leaves_the_tick_to_others(
        pikku: PikkuCelery, kit: InlineKit, caplog: pytest.LogCaptureFixture) -> None:
    pikku.schedule("ten", "report", every="10m")
    pikku.schedule("also", "other", every="10m")
    engine = pikku.engine
    tick = _next_ms(pikku)
    # A newer deploy renamed the workflow; this worker does not have it.
    stored = pikku.registry.schedules["ten"].stored()
    engine.store.save_schedule(stored.__class__(**{**vars(stored), "workflow": "renamed"}),
                               tick, tick - 1)
    kit.clock.advance_to(tick)
    scheduler = Scheduler(engine)
    with caplog.at_level(logging.ERROR, "pikku_celery"):
        scheduler.fire_due()
        scheduler.fire_due()
    assert _ticks(pikku) == [] and _next_ms(pikku) == tick  # still due, for another worker
    assert _ticks(pikku, "also") == [tick]  # the other schedule fired
    assert caplog.text.count("cannot start its tick here") == 1  # logged once
    assert "'renamed'" in caplog.text


def test_a_schedule_missing_from_the_store_is_saved_again(pikku: PikkuCelery,
                                                          kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m")
    engine = pikku.engine
    engine.store._schedules.clear()  # type: ignore[attr-defined]  # deleted by hand
    Scheduler(engine).fire_due()
    assert engine.store.get_schedule("ten") is not None


def test_a_worker_start_saves_a_changed_timing_and_keeps_the_pause(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m")
    engine = pikku.engine
    assert pikku.pause_schedule("ten")
    pikku.registry.schedules.clear()
    pikku.schedule("ten", "report", every="15m", data={"new": True})  # the new deploy
    Scheduler(engine).sync()
    stored = pikku.get_schedule("ten")
    assert stored.paused and stored.every == 900.0 and stored.data == {"new": True}
    assert _next_ms(pikku) % 900_000 == 0


# --- catch_up -------------------------------------------------------------------------------


def _outage(pikku: PikkuCelery, kit: InlineKit, catch_up: str, *, ticks: int,
            past_last_ms: int) -> int:
    """No worker runs for ``ticks`` ticks of a ten-minute schedule; a worker starts
    ``past_last_ms`` after the last of them. Returns the first missed tick."""
    pikku.schedule("ten", "report", every="10m", catch_up=catch_up)
    first = _next_ms(pikku)
    kit.clock.advance_to(first + (ticks - 1) * TEN_MIN + past_last_ms)
    Scheduler(pikku.engine).fire_due()
    return first


@pytest.mark.parametrize("catch_up", ["latest", "all", "none"])
def test_ticks_missed_while_no_worker_ran_start_what_catch_up_says(
        pikku: PikkuCelery, kit: InlineKit, catch_up: str,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "pikku_celery"):
        first = _outage(pikku, kit, catch_up, ticks=6, past_last_ms=5 * 60_000)
    last = first + 5 * TEN_MIN
    expected = {"latest": [last], "all": [first + i * TEN_MIN for i in range(6)],
                "none": []}[catch_up]
    assert _ticks(pikku) == expected
    assert _next_ms(pikku) == last + TEN_MIN
    if catch_up != "all":
        assert "missed" in caplog.text and f"catch_up={catch_up!r}" in caplog.text
    if expected:
        assert "fired" in caplog.text and "late" in caplog.text


@pytest.mark.parametrize("catch_up", ["latest", "none"])
def test_a_tick_a_few_seconds_late_is_on_time_whatever_catch_up_says(
        pikku: PikkuCelery, kit: InlineKit, catch_up: str) -> None:
    # Two ticks, the latest found due 5 s after it: both on time? The older one is ten
    # minutes overdue (missed), the latest one on time: "none" starts the latest only.
    first = _outage(pikku, kit, catch_up, ticks=2, past_last_ms=MISSED_AFTER_MS // 2)
    assert _ticks(pikku) == [first + TEN_MIN]
    # A single tick a few seconds late starts its run.
    kit.clock.advance_to(_next_ms(pikku) + MISSED_AFTER_MS // 2)
    Scheduler(pikku.engine).fire_due()
    assert _ticks(pikku) == [first + TEN_MIN, first + 2 * TEN_MIN]


def test_catching_up_all_is_bounded_per_round_and_in_total(
        pikku: PikkuCelery, kit: InlineKit, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(firing, "PER_ROUND", 3)
    monkeypatch.setattr(firing, "MAX_CATCH_UP", 5)
    pikku.schedule("ten", "report", every="10m", catch_up="all")
    first = _next_ms(pikku)
    last = first + 9 * TEN_MIN
    kit.clock.advance_to(last + 60_000)
    scheduler = Scheduler(pikku.engine)
    with caplog.at_level(logging.WARNING, "pikku_celery"):
        assert scheduler.fire_due() == first + 7 * TEN_MIN  # still behind: due at once
    assert len(_ticks(pikku)) == 2  # the skip of the oldest five took one of the three
    assert "more than the most recent 5 missed ticks" in caplog.text
    scheduler.fire_due()
    assert _ticks(pikku) == [first + i * TEN_MIN for i in range(5, 10)]
    assert _next_ms(pikku) == last + TEN_MIN


# --- pause, resume, trigger -----------------------------------------------------------------


def test_a_paused_schedule_fires_nothing_and_resumes_from_its_next_tick(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m", catch_up="all")
    kit.advance("10m")
    assert len(_ticks(pikku)) == 1
    assert pikku.pause_schedule("ten") and not pikku.pause_schedule("ten")
    kit.advance("1h")
    assert len(_ticks(pikku)) == 1 and pikku.get_schedule("ten").paused
    assert pikku.resume_schedule("ten") and not pikku.resume_schedule("ten")
    # Nothing for the ticks of the pause, even with catch_up="all": the next tick fires.
    resumed_next = _next_ms(pikku)
    assert resumed_next > kit.clock.now_ms()
    kit.advance("10m")
    assert _ticks(pikku)[1:] == [resumed_next]


def test_trigger_starts_a_run_now_paused_or_not_and_keeps_the_ticks(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m", data={"d": 1})
    before = _next_ms(pikku)
    assert pikku.pause_schedule("ten")
    now = kit.clock.now_ms()
    run_id = pikku.trigger_schedule("ten")
    run = pikku.get_run(run_id)
    assert run.status == "completed" and run.schedule == "ten"
    assert now <= round(run.scheduled_for.timestamp() * 1000) <= kit.clock.now_ms()
    assert run.output["data"] == {"d": 1}
    assert _next_ms(pikku) == before and pikku.get_schedule("ten").paused


def test_operations_on_an_unknown_schedule_are_refused(pikku: PikkuCelery,
                                                       kit: InlineKit) -> None:
    for call in (pikku.pause_schedule, pikku.resume_schedule, pikku.trigger_schedule,
                 pikku.get_schedule):
        with pytest.raises(InvalidInputError, match="no schedule named 'nope'"):
            call("nope")


def test_a_schedule_no_process_declares_is_listed_as_such(pikku: PikkuCelery,
                                                          kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m")
    pikku.list_schedules()  # saved by the kit
    pikku.registry.schedules.clear()  # the code no longer declares it
    [listed] = pikku.list_schedules()
    assert listed.name == "ten" and not listed.declared
    kit.advance("1h")
    assert _ticks(pikku) == []  # and nothing fires it


# --- the worker's ticker --------------------------------------------------------------------


class _Flaky:
    """An engine reference that fails while ``down`` is set."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.down = True

    def __call__(self) -> Any:
        if self.down:
            raise ConnectionError("mongodb://db:27017 does not answer")
        return self.engine


def test_the_ticker_rides_out_an_outage_with_a_bounded_backoff_and_logs_it_once(
        pikku: PikkuCelery, kit: InlineKit, caplog: pytest.LogCaptureFixture) -> None:
    pikku.schedule("ten", "report", every="10m")
    ref = _Flaky(pikku.engine)
    ticker = ScheduleTicker(ref, refresh_s=2.0)
    with caplog.at_level(logging.DEBUG, "pikku_celery"):
        waits = [ticker.step() for _ in range(8)]
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
        assert max(waits) == MAX_BACKOFF_S
        # An outage: one WARNING line, no traceback (the reaper names the service once).
        assert caplog.text.count("no tick fires while a service does not answer") == 1
        assert "Traceback" not in caplog.text and "ERROR" not in caplog.text
        ref.down = False
        kit.clock.advance_to(_next_ms(pikku))
        assert 0 < ticker.step() <= 2.0
    assert "succeeded again after 8 failed" in caplog.text
    assert len(_ticks(pikku)) == 1 and ticker.failures == 0


def test_a_round_failing_on_its_own_is_logged_with_its_traceback_once(
        pikku: PikkuCelery, kit: InlineKit, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Any:
        raise RuntimeError("a bug in a round")
    ticker = ScheduleTicker(broken, refresh_s=2.0)
    with caplog.at_level(logging.DEBUG, "pikku_celery"):
        ticker.step()
        ticker.step()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "a round failed" in errors[0].getMessage()
    assert errors[0].exc_info is not None


def test_the_ticker_sleeps_until_the_next_tick_at_most_its_refresh(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    pikku.schedule("ten", "report", every="10m")
    ticker = ScheduleTicker(lambda: pikku.engine, refresh_s=2.0)
    kit.clock.advance_to(_next_ms(pikku) - 500)
    assert 0.3 < ticker.round() <= 0.5
    kit.clock.advance_to(_next_ms(pikku))
    assert ticker.round() == 2.0 and len(_ticks(pikku)) == 1
    assert ScheduleTicker(lambda: pikku.engine, refresh_s=2.0).round() == 2.0


def test_the_ticker_thread_never_ends_silently(caplog: pytest.LogCaptureFixture) -> None:
    class Fatal(BaseException):
        pass

    def boom() -> Any:
        raise Fatal

    ticker = ScheduleTicker(boom)
    done = threading.Event()

    def hook(args: Any) -> None:
        done.set()

    previous, threading.excepthook = threading.excepthook, hook
    try:
        with caplog.at_level(logging.CRITICAL, "pikku_celery"):
            ticker.start()
            assert done.wait(5)
    finally:
        threading.excepthook = previous
    assert "the schedule ticker of this worker stopped" in caplog.text


def test_every_worker_of_the_app_runs_a_ticker_unless_the_reaper_is_off(
        pikku: PikkuCelery, kit: InlineKit) -> None:
    class Sender:
        app = pikku.app

    hook = WorkerTicker(pikku)
    hook.ready(sender=object())  # another app's worker
    assert hook.ticker is None
    hook.ready(sender=Sender())
    assert hook.ticker is not None and hook.ticker.alive
    hook.shutdown()
    assert hook.ticker._thread is not None
    hook.ticker._thread.join(5)
    assert not hook.ticker.alive
    off = PikkuCelery(Celery(f"off-{uuid.uuid4().hex[:6]}", broker="memory://"),
                      worker_reaper=False)

    class OffSender:
        app = off.app

    quiet = WorkerTicker(off)
    quiet.ready(sender=OffSender())
    assert quiet.ticker is None


def test_every_round_of_the_ticker_runs_under_a_deadline(
        pikku: PikkuCelery, kit: InlineKit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled primary must not hold the ticker: every store call of a round is under a
    deadline (``store._concerns.deadline``: pymongo's timeout)."""
    pikku.schedule("ten", "report", every="10m")
    entered: list[float] = []
    inside: list[bool] = []

    @contextlib.contextmanager
    def deadline(seconds: float) -> Iterator[None]:
        entered.append(seconds)
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    engine = pikku.engine
    original = engine.store.schedules_firing
    calls: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(bool(inside))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.store, "schedules_firing", spy)
    monkeypatch.setattr("pikku_celery.schedules.ticker.deadline", deadline)
    ScheduleTicker(lambda: engine).round()
    assert entered == [ROUND_DEADLINE_S] and calls == [True]
