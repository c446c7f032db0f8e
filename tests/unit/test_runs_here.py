"""``CeleryDispatcher.runs_here``: when the task running in a worker may run a step in place
(issue 24). Only when the step's message would go where this task's came from, through the
same task class call, with no time limit on either that the worker's pool enforces and no
rate limit on the step, in a worker that is not stopping. Each refusal is a case here that
would pass without it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task
from celery._state import _task_stack
from celery.worker import state as worker_state

from pikku_celery import InMemoryLeaseService, PikkuCelery
from pikku_celery.store.memory import InMemoryWorkflowStore
from pikku_celery.worker import pool_limits, time_budget
from pikku_celery.worker.dispatcher import CeleryDispatcher
from pikku_celery.worker.tasks import internal_task


def _pikku(task_cls: Any = None, **conf: Any) -> tuple[Celery, PikkuCelery]:
    app = Celery("runs-here", broker="memory://", set_as_current=False,
                 **({} if task_cls is None else {"task_cls": task_cls}))
    app.conf.update(task_default_queue="work", **conf)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    return app, pikku


@pytest.fixture
def running() -> Iterator[Any]:
    """Make ``task`` the task a worker runs now, delivered from ``queue``."""
    pushed: list[Task] = []

    def run(task: Task, args: tuple[Any, ...], queue: str = "work", **request: Any) -> None:
        request.setdefault("timelimit", (None, None))
        task.push_request(args=list(args), kwargs={}, called_directly=False, is_eager=False,
                          delivery_info={"exchange": "", "routing_key": queue}, **request)
        _task_stack.push(task)
        pushed.append(task)

    yield run
    for task in pushed:
        _task_stack.pop()
        task.pop_request()


def _dispatcher(app: Celery, pikku: PikkuCelery) -> CeleryDispatcher:
    dispatcher = pikku.engine.dispatcher
    assert isinstance(dispatcher, CeleryDispatcher)
    return dispatcher


def test_outside_a_worker_task_nothing_runs_in_place() -> None:
    app, pikku = _pikku()
    pikku.step(name="rh.step")(lambda data: data)
    assert not _dispatcher(app, pikku).runs_here("rh.step", "run", "s")


def test_a_step_for_the_same_queue_runs_in_place(running: Any) -> None:
    app, pikku = _pikku()
    pikku.step(name="rh.step")(lambda data: data)
    running(internal_task(app, "orchestrate"), ("run",))
    assert _dispatcher(app, pikku).runs_here("rh.step", "run", "s")
    # From a step's own task too.
    running(app.tasks["rh.step"], ("run", "s0"))
    assert _dispatcher(app, pikku).runs_here("rh.step", "run", "s")


def test_a_step_routed_to_another_queue_is_sent(running: Any) -> None:
    app, pikku = _pikku(task_routes={"rh.gpu": {"queue": "gpu"}})
    pikku.step(name="rh.gpu")(lambda data: data)
    pikku.step(name="rh.step")(lambda data: data)
    running(internal_task(app, "orchestrate"), ("run",))
    dispatcher = _dispatcher(app, pikku)
    assert not dispatcher.runs_here("rh.gpu", "run", "s")
    assert dispatcher.runs_here("rh.step", "run", "s")


def test_time_limits_and_rate_limits_send_the_step(running: Any) -> None:
    app, pikku = _pikku()
    pikku.step(name="rh.limited", time_limit=30)(lambda data: data)
    pikku.step(name="rh.soft", soft_time_limit=30)(lambda data: data)
    pikku.step(name="rh.rated", rate_limit="10/m")(lambda data: data)
    pikku.step(name="rh.step")(lambda data: data)
    running(internal_task(app, "orchestrate"), ("run",))
    dispatcher = _dispatcher(app, pikku)
    for name in ("rh.limited", "rh.soft", "rh.rated"):
        assert not dispatcher.runs_here(name, "run", "s"), name
    assert dispatcher.runs_here("rh.step", "run", "s")
    # A limit on the task running now (its message's own), or app-wide: nothing in place.
    running(internal_task(app, "orchestrate"), ("run",), timelimit=(60, None))
    assert not dispatcher.runs_here("rh.step", "run", "s")


def _started(task: Task, ago_s: float) -> None:
    """The body of the task running now started ``ago_s`` seconds ago."""
    time_budget._started.task = (task.request.id, time.monotonic() - ago_s)


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_an_app_wide_time_limit_is_a_budget(running: Any, pool: str) -> None:
    """Issue 34: under ``task_time_limit=300`` on a pool that enforces it, a step runs in
    place while the running task's remaining limit (its message's: 300 + the 10 s margin)
    covers the step's 300 s; after that it is sent."""
    app, pikku = _pikku(task_time_limit=300, task_soft_time_limit=240)
    pikku.step(name="rh.step")(lambda data: data)
    pool_limits.note_worker_pool(app, pool)
    orchestrate = internal_task(app, "orchestrate")
    dispatcher = _dispatcher(app, pikku)
    running(orchestrate, ("run",), id="t1", timelimit=(310, 250))
    for ago_s, in_place in ((0.0, True), (9.5, True), (10.0, False), (60.0, False)):
        _started(orchestrate, ago_s)
        assert dispatcher.runs_here("rh.step", "run", "s") is in_place, ago_s
    # A start this thread never noted (not one of pikku's tasks): no budget known.
    time_budget._started.task = ("another task", time.monotonic())
    assert not dispatcher.runs_here("rh.step", "run", "s")
    # A message with the app's limit and no margin (not sent by pikku): no time to spare.
    running(orchestrate, ("run",), id="t2", timelimit=(300, 240))
    _started(orchestrate, 0.0)
    assert not dispatcher.runs_here("rh.step", "run", "s")


def test_only_the_limits_the_step_would_have_count(running: Any) -> None:
    """A running task with a limit the step would not have (its message's own hard limit,
    none app-wide) cannot lend it time: the step would be cut short where its own task
    would not."""
    app, pikku = _pikku(task_soft_time_limit=60)
    pikku.step(name="rh.step")(lambda data: data)
    orchestrate = internal_task(app, "orchestrate")
    running(orchestrate, ("run",), id="t1", timelimit=(600, 66))
    _started(orchestrate, 0.0)
    assert not _dispatcher(app, pikku).runs_here("rh.step", "run", "s")
    running(orchestrate, ("run",), id="t2", timelimit=(None, 66))
    _started(orchestrate, 0.0)
    assert _dispatcher(app, pikku).runs_here("rh.step", "run", "s")


def test_pikkus_messages_carry_the_apps_limits_plus_the_margin() -> None:
    app, pikku = _pikku(task_time_limit=300, task_soft_time_limit=20)
    pikku.step(name="rh.step")(lambda data: data)
    pikku.step(name="rh.own", time_limit=30)(lambda data: data)
    orchestrate = internal_task(app, "orchestrate")
    # The margin: the smaller of pikku_in_place_for (10 s) and a tenth of the least limit.
    assert time_budget.message_limits(orchestrate, 10_000) == {
        "time_limit": 302.0, "soft_time_limit": 22.0}
    assert time_budget.message_limits(app.tasks["rh.step"], 1_000) == {
        "time_limit": 301.0, "soft_time_limit": 21.0}
    # A step with a limit of its own keeps it exactly (Celery puts it in the message).
    assert time_budget.message_limits(app.tasks["rh.own"], 10_000) == {}
    sent: list[dict[str, Any]] = []
    for task in (orchestrate, app.tasks["rh.step"]):
        task.apply_async = lambda *a, **options: sent.append(options)  # type: ignore[method-assign]
    dispatcher = _dispatcher(app, pikku)
    dispatcher.wake_run("run")
    dispatcher.dispatch_step("rh.step", "run", "s")
    assert [(o["time_limit"], o["soft_time_limit"]) for o in sent] == [(302.0, 22.0)] * 2


def test_with_running_in_place_off_messages_keep_the_apps_limits() -> None:
    app, pikku = _pikku(task_time_limit=300, pikku_in_place_steps=0)
    sent: list[dict[str, Any]] = []
    orchestrate = internal_task(app, "orchestrate")
    orchestrate.apply_async = lambda *a, **options: sent.append(options)  # type: ignore[method-assign]
    _dispatcher(app, pikku).wake_run("run")
    assert "time_limit" not in sent[0]


@pytest.mark.parametrize(("pool", "in_place"), [
    ("threads", True), ("solo", True), ("prefork", False), ("gevent", False)])
def test_time_limits_send_steps_only_where_the_pool_enforces_them(
        running: Any, pool: str, in_place: bool) -> None:
    """The threads and solo pools ignore Celery's time limits: a step sent as a task there
    would run unlimited too, so it runs in place (issue 34). A rate limit still sends it."""
    app, pikku = _pikku(task_time_limit=300, task_soft_time_limit=240)
    pikku.step(name="rh.step")(lambda data: data)
    pikku.step(name="rh.limited", time_limit=30)(lambda data: data)
    pikku.step(name="rh.rated", rate_limit="10/m")(lambda data: data)
    pool_limits.note_worker_pool(app, pool)
    assert pool_limits.enforces_time_limits(app) is not in_place
    running(internal_task(app, "orchestrate"), ("run",), timelimit=(60, 30))
    dispatcher = _dispatcher(app, pikku)
    assert dispatcher.runs_here("rh.step", "run", "s") is in_place
    assert dispatcher.runs_here("rh.limited", "run", "s") is in_place
    assert not dispatcher.runs_here("rh.rated", "run", "s")


def test_a_worker_learns_its_pool_at_init_and_forgets_it_at_shutdown() -> None:
    app, pikku = _pikku()
    worker = type("Worker", (), {"app": app, "pool_cls": "threads"})()
    pikku.routing._on_worker_init(sender=worker)
    assert not pool_limits.enforces_time_limits(app) and pool_limits.pool_name(app) == "threads"
    pikku.routing._on_worker_shutdown(sender=worker)
    assert pool_limits.enforces_time_limits(app) and pool_limits.pool_name(app) is None


class Traced(Task):  # type: ignore[misc]
    """An app's task class with a ``__call__`` of its own (Flask's app context, a tracer)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


def test_steps_take_the_apps_task_class_and_run_in_place_under_it(running: Any) -> None:
    """With the app's task class around pikku's tasks and steps alike (issue 25 item 1),
    a step runs in place inside it."""
    app, pikku = _pikku(task_cls=Traced)
    pikku.step(name="rh.step")(lambda data: data)
    assert type(app.tasks["rh.step"]).__call__ is Traced.__call__
    running(internal_task(app, "orchestrate"), ("run",))
    assert _dispatcher(app, pikku).runs_here("rh.step", "run", "s")


def test_a_step_under_another_task_class_call_is_sent(running: Any) -> None:
    """A pass run by a task of another class (a user's own task advancing a run): a step
    does not run in place inside a ``__call__`` other than its own."""
    app, pikku = _pikku()
    pikku.step(name="rh.step")(lambda data: data)
    def users_task() -> None:
        return None

    running(app.task(name="rh.users", base=Traced, shared=False)(users_task), ())
    assert not _dispatcher(app, pikku).runs_here("rh.step", "run", "s")


def test_a_stopping_worker_sends_the_step(running: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    app, pikku = _pikku()
    pikku.step(name="rh.step")(lambda data: data)
    running(internal_task(app, "orchestrate"), ("run",))
    monkeypatch.setattr(worker_state, "should_stop", 0)  # warm shutdown, exit code 0
    assert not _dispatcher(app, pikku).runs_here("rh.step", "run", "s")
