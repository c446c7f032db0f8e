"""``shared_step`` / ``shared_workflow``: declared without an instance (a reusable Django
app's ``workflows.py``), bound to every ``PikkuCelery`` of the process, created before or
after the declaration."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery, current_app

from pikku_celery import (
    InMemoryLeaseService,
    InMemoryWorkflowStore,
    InvalidInputError,
    PikkuCelery,
    shared_schedule,
    shared_step,
    shared_workflow,
)


def _pikku() -> PikkuCelery:
    return PikkuCelery(Celery(f"shared-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False)


def test_shared_declarations_bind_to_instances_created_before_and_after() -> None:
    tag = uuid.uuid4().hex[:8]
    before = _pikku()

    @shared_step(name=f"shared.{tag}.double", retries=1)
    def double(n: int) -> int:
        return n * 2

    @shared_workflow(f"shared-{tag}")
    def doubled(wf: Any, n: int) -> int:
        return int(wf.do("double", double, n))

    after = _pikku()
    for pikku in (before, after):
        assert f"shared.{tag}.double" in pikku.app.tasks  # a real task on each app
        assert pikku.registry.steps[f"shared.{tag}.double"].retries == 1
        run_id = pikku.start(f"shared-{tag}", 21, inline=True)  # by name
        assert pikku.get_run(run_id).output == 42
        run_id = pikku.start(doubled, 4, inline=True)  # by function
        assert pikku.get_run(run_id).output == 8
    assert before.app.tasks[double.name] is not after.app.tasks[double.name]


def test_a_shared_step_default_name_and_the_current_apps_task() -> None:
    pikku = _pikku()

    @shared_step()
    def ship(order: dict[str, Any]) -> str:
        """Ships an order."""
        return "shipped"

    assert ship.name == f"{__name__}.ship"
    assert ship.__doc__ == "Ships an order." and ship.pikku_step.fn({}) == "shipped"
    assert ship.task(pikku.app).pikku_step is ship.pikku_step
    previous = current_app._get_current_object()
    pikku.app.set_current()  # like shared_task's proxy: the current app's task
    try:
        assert ship.acks_late is True  # a step task's option, read from the task
        with pytest.raises(InvalidInputError, match="is a pikku step"):
            ship.delay({"id": 1})
    finally:
        previous.set_current()


def test_a_shared_workflow_name_taken_by_another_function_is_refused() -> None:
    tag = uuid.uuid4().hex[:8]

    @shared_workflow(f"taken-{tag}")
    def first(wf: Any, data: Any) -> None:
        return None

    with pytest.raises(InvalidInputError, match=f"taken-{tag}"):
        @shared_workflow(f"taken-{tag}")
        def second(wf: Any, data: Any) -> None:
            return None


# --- shared_schedule (issue 36): a schedule a Flask factory's PikkuCelery knows -----------


@pytest.fixture
def shared_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """What these tests declare binds to the instances made until they end, not to every
    later test's: a schedule left behind would fire in other tests' workers."""
    from pikku_celery.worker import shared

    for name in ("_hooks", "_shared_workflows", "_shared_schedules"):
        monkeypatch.setattr(shared, name, type(getattr(shared, name))(getattr(shared, name)))


def test_a_flask_factory_knows_a_schedule_declared_with_shared_schedule(shared_here: None) -> None:
    """As docs/guide/flask.md declares it: the workflow module declares the workflow and its
    schedule without an instance; the factory builds the Celery app, ``PikkuFlask`` binds a
    ``PikkuCelery`` to it, and that instance knows the schedule (a worker writes it to the
    store and fires it)."""
    from flask import Flask

    from pikku_celery.contrib.flask import PikkuFlask, current_pikku
    from pikku_celery.testing import inline

    tag = uuid.uuid4().hex[:8]

    @shared_step(name=f"shared.{tag}.report")
    def report(data: dict[str, Any]) -> str:
        return f"report for {data['team']}"

    @shared_workflow(f"nightly-{tag}")
    def nightly(wf: Any, data: dict[str, Any]) -> str:
        return str(wf.do("report", report, data))

    declared = shared_schedule(f"nightly-{tag}", nightly, cron="0 2 * * *",
                               data={"team": "ops"}, tz="Europe/Helsinki")

    def create_app() -> Flask:
        app = Flask(f"factory_{tag}")
        app.config.update(PIKKU_URL_PREFIX=None, PIKKU_MONGO_URL="mongodb://127.0.0.1:1/x",
                          PIKKU_REDIS_URL="redis://127.0.0.1:1/0")
        app.extensions["celery"] = Celery(app.name, broker="memory://",
                                          set_as_current=False)
        PikkuFlask().init_app(app)
        return app

    with create_app().app_context():
        pikku = current_pikku()
    assert pikku.registry.schedules[f"nightly-{tag}"] == declared
    assert (declared.workflow, declared.cron, declared.tz) == (
        f"nightly-{tag}", "0 2 * * *", "Europe/Helsinki")
    with inline(pikku):  # on in-memory services: a tick of now runs the workflow
        run_id = pikku.trigger_schedule(f"nightly-{tag}")
        assert pikku.get_run(run_id).output == "report for ops"


def test_a_shared_schedule_binds_to_instances_created_before_and_after(shared_here: None) -> None:
    tag = uuid.uuid4().hex[:8]
    before = _pikku()

    @shared_workflow(f"sweep-{tag}")
    def sweep(wf: Any, data: Any) -> Any:
        return data

    shared_schedule(f"sweep-{tag}", f"sweep-{tag}", every="15m")  # by name
    shared_schedule(f"sweep-{tag}", sweep, every="15m")  # the same again: a re-import
    after = _pikku()
    for pikku in (before, after):
        assert pikku.registry.schedules[f"sweep-{tag}"].every_ms == 15 * 60 * 1000


def test_a_shared_schedule_is_checked_where_it_is_declared(shared_here: None) -> None:
    tag = uuid.uuid4().hex[:8]
    pikku = _pikku()

    @pikku.workflow(f"own-{tag}")
    def own(wf: Any, data: Any) -> Any:
        return data

    with pytest.raises(InvalidInputError, match=f"no shared workflow named 'own-{tag}'"):
        shared_schedule(f"own-{tag}", own, every="1h")  # one instance's: pikku.schedule

    @shared_workflow(f"shared-{tag}")
    def shared(wf: Any, data: Any) -> Any:
        return data

    with pytest.raises(InvalidInputError, match="exactly one of cron"):
        shared_schedule(f"bad-{tag}", shared)
    with pytest.raises(InvalidInputError, match="cron"):
        shared_schedule(f"bad-{tag}", shared, cron="61 * * * *")
    shared_schedule(f"hourly-{tag}", shared, every="1h")
    with pytest.raises(InvalidInputError, match="already declared with another definition"):
        shared_schedule(f"hourly-{tag}", shared, every="2h")
    assert pikku.registry.schedules[f"hourly-{tag}"].every_ms == 3600 * 1000
    assert f"bad-{tag}" not in pikku.registry.schedules and f"own-{tag}" not in (
        pikku.registry.schedules)
    later = _pikku()  # a refused declaration left nothing behind for later instances
    assert set(later.registry.schedules) >= {f"hourly-{tag}"}
    assert f"bad-{tag}" not in later.registry.schedules
