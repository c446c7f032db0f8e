"""A worker says once, when it starts, why steps will be sent as messages instead of run in
place (issue 34 item 2): an app-wide time limit, a limit on pikku's orchestrate task, a
step's own time limit or rate limit, or the settings; and says nothing when every step may
run in place."""

from __future__ import annotations

import logging
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.tasks import internal_task_names


def make(**conf: Any) -> PikkuCelery:
    app = Celery(f"notes-{uuid.uuid4().hex[:6]}", broker="memory://")
    app.conf.update(conf)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)

    @pikku.step(name="notes.plain")
    def plain(x: Any) -> Any:
        return x

    return pikku


def said_at_worker_start(pikku: PikkuCelery, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pikku_celery"):
        pikku.routing._on_worker_ready(sender=SimpleNamespace(app=pikku.app))
    return [r.getMessage() for r in caplog.records if "in place" in r.getMessage()]


def test_nothing_is_said_when_every_step_may_run_in_place(
        caplog: pytest.LogCaptureFixture) -> None:
    assert said_at_worker_start(make(), caplog) == []


@pytest.mark.parametrize("setting", ["task_time_limit", "task_soft_time_limit"])
def test_an_app_wide_time_limit_is_named(setting: str,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """A budget, not a reason to send (issue 34): the line says how long steps run in
    place and what pikku's messages carry."""
    (line,) = said_at_worker_start(make(**{setting: 300}), caplog)
    assert line.startswith(f"pikku: the app sets {setting}=300: steps run in place for the "
                           "first 10 s of each task"), line
    assert f"pikku's messages carry {setting}=310" in line, line


def test_a_limit_on_pikkus_orchestrate_task_is_named(caplog: pytest.LogCaptureFixture) -> None:
    pikku = make()
    name = internal_task_names(pikku.app)["orchestrate"]
    pikku.app.tasks[name].time_limit = 60
    (line,) = said_at_worker_start(pikku, caplog)
    assert line.endswith(f"none runs in place: {name} has time_limit=60")


def test_steps_with_their_own_limits_are_listed_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    pikku = make()

    @pikku.step(name="notes.slow", time_limit=10, soft_time_limit=8)
    def slow(x: Any) -> Any:
        return x

    @pikku.step(name="notes.rated", rate_limit="10/m")
    def rated(x: Any) -> Any:
        return x

    (line,) = said_at_worker_start(pikku, caplog)
    assert line.endswith("run in place (a step run in place would run inside the limits of "
                         "the task that runs it): notes.rated (rate_limit='10/m'), "
                         "notes.slow (time_limit=10, soft_time_limit=8)")
    assert "notes.plain" not in line


def test_running_in_place_turned_off_is_said(caplog: pytest.LogCaptureFixture) -> None:
    (line,) = said_at_worker_start(make(pikku_continue_in_place=False), caplog)
    assert line.endswith("none runs in place: pikku_continue_in_place is off")
    (line,) = said_at_worker_start(make(pikku_in_place_steps=0), caplog)
    assert line.endswith("none runs in place: pikku_in_place_steps is 0")


def test_another_apps_worker_is_told_nothing(caplog: pytest.LogCaptureFixture) -> None:
    pikku = make(task_time_limit=300)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pikku_celery"):
        pikku.routing._on_worker_ready(sender=SimpleNamespace(app=Celery("other")))
    assert not [r for r in caplog.records if "in place" in r.getMessage()]


def test_on_a_pool_that_enforces_no_time_limit_steps_run_in_place_and_it_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    pikku = make(task_time_limit=300)

    @pikku.step(name="notes.slow", time_limit=10, rate_limit="1/s")
    def slow(x: Any) -> Any:
        return x

    worker = SimpleNamespace(app=pikku.app, pool_cls="threads")
    pikku.routing._on_worker_init(sender=worker)
    try:
        lines = said_at_worker_start(pikku, caplog)
    finally:
        pikku.routing._on_worker_shutdown(sender=worker)
    assert lines == [
        "pikku: this worker's pool (threads) enforces no time limit, so task_time_limit=300 "
        "sends no step: steps run in place",
        "pikku: these steps are sent as tasks of their own, never run in place (a step run in "
        "place would run inside the limits of the task that runs it): notes.slow "
        "(rate_limit='1/s')"]
