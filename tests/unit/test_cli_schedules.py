"""Schedules in the ``pikku`` commands (issue 26 item 2): ``pikku schedules [--json]``
lists the stored schedules (timing, time zone, catch-up, paused or active, "not declared",
next tick, latest tick and its run; whole values in a pipe, and the schedules declared
here that no worker saved yet); ``pikku schedule pause|resume|trigger NAME`` act on one
(an unknown name, pausing a paused one, resuming an active one: one line and exit 1;
trigger prints the run id alone); ``runs`` and ``show`` show a scheduled run's schedule
and tick; a ``queued`` run (concurrency limits) is listed and filtered like any other."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner

from pikku_celery import PikkuCelery
from pikku_celery.model import records
from pikku_celery.operate.cli import bound
from pikku_celery.store.base import NewRun
from pikku_celery.testing import InlineKit, inline
from tests.support.operate import now_ms
from tests.unit.test_cli import one_line_error, run_cli
from tests.unit.test_contrib import make_pikku

# Half a day from now, so "nightly" never ticks inside a test's hour of virtual time
# (a fixed 03:30 ticked when the suite ran at that hour).
NIGHTLY_HOUR = (datetime.now(ZoneInfo("Europe/Helsinki")).hour + 12) % 24
NIGHTLY = f"30 {NIGHTLY_HOUR} * * *"


@pytest.fixture
def pikku() -> PikkuCelery:
    pikku = make_pikku()
    pikku.schedule("nightly", "sum", cron=NIGHTLY, tz="Europe/Helsinki",
                   data={"a": 1, "b": 2})
    pikku.schedule("often", "sum", every="10m", data={"a": 2, "b": 2}, catch_up="all")
    return pikku


@pytest.fixture
def kit(pikku: PikkuCelery) -> Iterator[InlineKit]:
    with inline(pikku, hold_timers=True) as kit:
        yield kit


def rows(output: str) -> dict[str, list[str]]:
    """The table's rows by their first cell, split on whitespace."""
    return {line.split()[0]: line.split() for line in output.splitlines()[1:]
            if line.strip()}


def test_schedules_declared_but_not_saved_yet_are_named(pikku: PikkuCelery) -> None:
    fresh = run_cli(pikku, "schedules")
    assert fresh.exit_code == 0, fresh.output
    assert fresh.output.splitlines() == [
        "no schedules",
        "declared here but not in the store yet (a worker saves them when it starts): "
        "nightly, often"]
    assert json.loads(run_cli(pikku, "schedules", "--json").output) == {"schedules": []}
    pikku.get_schedule("often")  # saved
    assert rows(run_cli(pikku, "schedules").output).keys() == {"often", "declared"}


def test_schedules_lists_each_with_its_timing_state_and_ticks(pikku: PikkuCelery,
                                                              kit: InlineKit) -> None:
    kit.advance("10m")  # the kit saved the schedules; "often" ticks once
    listed = run_cli(pikku, "schedules")
    assert listed.exit_code == 0, listed.output
    assert listed.output.splitlines()[0].split() == [
        "schedule", "workflow", "timing", "tz", "catch", "up", "state", "next", "tick",
        "(UTC)", "last", "tick", "(UTC)", "last", "run"]
    found = rows(listed.output)
    assert sorted(found) == ["nightly", "often"]
    nightly = found["nightly"]
    assert nightly[1:8] == ["sum", "cron", *NIGHTLY.split()]
    assert nightly[8:11] == ["Europe/Helsinki", "latest", "active"]
    assert nightly[-2:] == ["-", "-"]  # no tick yet, no run
    often = found["often"]
    last_run = pikku.get_schedule("often").last_run_id
    assert last_run is not None and pikku.get_run(last_run).schedule == "often"
    assert often[1:7] == ["sum", "every", "10m", "UTC", "all", "active"]
    assert often[-1] == last_run  # whole, in a pipe
    assert "declared here" not in listed.output

    pikku.registry.schedules.pop("often")  # the code no longer declares it
    assert run_cli(pikku, "schedule", "pause", "nightly").exit_code == 0
    found = rows(run_cli(pikku, "schedules").output)
    assert found["often"][6:9] == ["active,", "not", "declared"]
    assert found["nightly"][10:13] == ["paused", "-", "-"]  # no next tick while paused

    data = json.loads(run_cli(pikku, "schedules", "--json").output)["schedules"]
    assert [(s["name"], s["timing"], s["paused"], s["declared"]) for s in data] == [
        ("nightly", f"cron {NIGHTLY}", True, True),
        ("often", "every 10m", False, False)]
    assert data[1]["every"] == 600 and data[1]["last_run_id"] == last_run
    assert data[0]["data"] == {"a": 1, "b": 2} and data[0]["tz"] == "Europe/Helsinki"


def test_pause_resume_and_trigger(pikku: PikkuCelery, kit: InlineKit) -> None:
    paused = run_cli(pikku, "schedule", "pause", "often")
    assert (paused.exit_code, paused.output) == (0, "paused schedule often\n")
    assert pikku.get_schedule("often").paused
    assert one_line_error(run_cli(pikku, "schedule", "pause", "often")) == \
        "Error: schedule often is already paused: nothing to pause"
    kit.advance("1h")
    assert pikku.list_runs() == []  # paused: no tick started a run

    triggered = run_cli(pikku, "schedule", "trigger", "often")
    assert triggered.exit_code == 0, triggered.output
    run_id = triggered.output.strip()
    assert triggered.output == run_id + "\n"  # the id alone: $(pikku schedule trigger x)
    run = pikku.get_run(run_id)
    assert (run.schedule, run.status, run.output) == ("often", "completed", 4)
    assert pikku.get_schedule("often").paused  # a trigger does not resume it

    resumed = run_cli(pikku, "schedule", "resume", "often")
    assert resumed.exit_code == 0, resumed.output
    assert resumed.output.startswith("resumed schedule often; next tick 20")
    assert not pikku.get_schedule("often").paused
    assert one_line_error(run_cli(pikku, "schedule", "resume", "often")) == \
        "Error: schedule often is not paused: nothing to resume"


@pytest.mark.parametrize("verb", ["pause", "resume", "trigger"])
def test_an_unknown_schedule_is_one_line_and_exit_1(pikku: PikkuCelery, verb: str) -> None:
    line = one_line_error(run_cli(pikku, "schedule", verb, "nope"))
    assert line.startswith("Error: no schedule named 'nope'"), line
    assert pikku.list_runs() == []


def test_runs_and_show_show_a_scheduled_runs_schedule_and_tick(pikku: PikkuCelery) -> None:
    plain = pikku.start("sum", {"a": 1, "b": 1}, run_id="plain-1")
    assert "schedule" not in run_cli(pikku, "runs").output  # no column without one
    assert "schedule" not in run_cli(pikku, "show", plain).output
    run_id = pikku.trigger_schedule("nightly")
    tick = pikku.get_run(run_id).scheduled_for
    assert tick is not None
    shown_tick = tick.strftime("%Y-%m-%d %H:%M:%S.") + f"{tick.microsecond // 1000:03d}Z"
    listed = run_cli(pikku, "runs")
    header = listed.output.splitlines()[0]
    assert "schedule" in header and "scheduled for (UTC)" in header
    found = rows(listed.output)
    assert found[run_id][7:10] == ["nightly", *shown_tick.split()]
    assert found[plain][7] == "-"
    shown = run_cli(pikku, "show", run_id)
    assert shown.exit_code == 0, shown.output
    lines = [line.split() for line in shown.output.splitlines()]
    assert ["schedule", "nightly"] in lines
    assert ["scheduled", "for", *shown_tick.split()] in lines
    data = json.loads(run_cli(pikku, "runs", "--json").output)["runs"]
    assert {r["run_id"]: (r["schedule"], r["scheduled_for"]) for r in data} == {
        run_id: ("nightly", tick.isoformat()), plain: (None, None)}
    assert json.loads(run_cli(pikku, "show", run_id, "--json").output)["run"][
        "schedule"] == "nightly"


def test_a_queued_run_is_listed_and_filtered(pikku: PikkuCelery) -> None:
    store = pikku.engine.store
    store.create_run(NewRun("q-1", "sum", {"a": 1, "b": 1}), now_ms())
    assert store.transition_run("q-1", ["running"], "queued", now_ms())
    pikku.start("sum", {"a": 2, "b": 2}, run_id="r-1")
    listed = run_cli(pikku, "runs", "--status", "queued")
    assert listed.exit_code == 0, listed.output
    assert sorted(rows(listed.output)) == ["q-1"]
    assert rows(listed.output)["q-1"][2] == "queued"
    assert rows(run_cli(pikku, "runs").output)["q-1"][2] == "queued"
    assert "queued" in run_cli(pikku, "runs", "--help").output
    from pikku_celery.operate import _terminal

    assert _terminal.STATUS_STYLE["queued"]  # styled, as every run status
    assert set(records.RUN_STATUSES) <= set(_terminal.STATUS_STYLE)


def test_the_bound_group_of_django_and_flask_has_the_schedule_commands(
        pikku: PikkuCelery) -> None:
    group = bound(lambda: pikku)
    pikku.get_schedule("often")  # saved
    listed = CliRunner().invoke(group, ["schedules"])
    assert listed.exit_code == 0, listed.output
    assert sorted(rows(listed.output)) == ["declared", "often"]  # nightly: not saved
    paused = CliRunner().invoke(group, ["schedule", "pause", "often"])
    assert (paused.exit_code, paused.output) == (0, "paused schedule often\n")
