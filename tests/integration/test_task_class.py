"""Steps run through the app's task class (issue 25 item 1): with Flask's documented
pattern, ``Celery(app.name, task_cls=FlaskTask)`` whose ``__call__`` pushes the app
context, a step body that reads ``flask.current_app`` works, whether it runs as a task of
its own or in place inside pikku's orchestrator task, on a real (in-process) worker."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery, Task
from celery.contrib.testing.worker import start_worker
from celery.signals import task_prerun
from flask import Flask, current_app

from pikku_celery import InMemoryLeaseService, PikkuCelery
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.worker.tasks import StepTask, internal_task
from tests.conftest import REDIS_URL


def _flask_celery(key_prefix: str) -> tuple[Celery, PikkuCelery]:
    flask_app = Flask("shop")
    flask_app.config["GREETING"] = "hello"

    class FlaskTask(Task):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with flask_app.app_context():
                return self.run(*args, **kwargs)

    app = Celery(flask_app.name, broker=REDIS_URL, task_cls=FlaskTask, set_as_current=False)
    app.conf.update(task_default_queue=f"{key_prefix}-q",
                    broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"})
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    return app, pikku


def test_step_tasks_take_the_apps_task_class(key_prefix: str) -> None:
    app, pikku = _flask_celery(key_prefix)
    pikku.step(name="shop.plain")(lambda data: data)
    task = app.tasks["shop.plain"]
    assert isinstance(task, StepTask) and isinstance(task, app.Task)
    assert type(task).__call__ is type(internal_task(app, "orchestrate")).__call__


def test_a_step_reads_the_flask_app_context_on_a_worker(key_prefix: str) -> None:
    app, pikku = _flask_celery(key_prefix)

    @pikku.step(name="shop.greet")
    def greet(name: str) -> str:
        return f"{current_app.config['GREETING']} {name}"  # outside a context: RuntimeError

    @pikku.workflow("shop.flow")
    def flow(wf: Any, name: str) -> list[str]:
        return [wf.do("a", greet, name), wf.do("b", greet, f"{name}!")]

    @pikku.workflow("shop.sent")
    def sent(wf: Any, name: str) -> list[str]:  # a fan-out: each step a task of its own
        return wf.gather(*(wf.call(f"c{i}", greet, f"{name}{i}") for i in range(2)))

    ran_as_tasks: set[str] = set()

    def ran(task_id: str | None = None, **_: Any) -> None:
        ran_as_tasks.add(str(task_id))

    task_prerun.connect(ran, weak=False)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      shutdown_timeout=10):
        in_place = pikku.start(flow, "ann")
        assert pikku.wait(in_place, 30).output == ["hello ann", "hello ann!"]
        tasks = pikku.start(sent, f"bo-{uuid.uuid4().hex[:4]}")
        run = pikku.wait(tasks, 30)
    task_prerun.disconnect(ran)
    assert run.status == "completed", run
    # Run in place: a task id of their own each (issue 33), no task of Celery's ran them.
    ids = [h.task_id for h in pikku.get_history(in_place)]
    assert all(ids) and not set(ids) & ran_as_tasks, (ids, ran_as_tasks)
    assert all(h.task_id for h in pikku.get_history(tasks))  # ran as tasks of their own
