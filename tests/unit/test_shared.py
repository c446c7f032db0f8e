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
