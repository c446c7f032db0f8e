"""pikku's routing and worker set-up (``pikku_celery/worker/routing.py``), on in-process apps and
unstarted ``WorkController`` instances (built exactly as ``celery worker`` builds one, up to
its consumer; nothing connects). The same behaviour on real worker processes and brokers is
in ``tests/integration/test_non_interference.py``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.worker import WorkController

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.routing import conf_sets
from pikku_celery.worker.tasks import internal_task, internal_task_names

DEFAULT_PREFETCH = 4
CONCURRENCY = 2


def make_app(queue: str | None = None, *, config: object = None, namespace: str | None = None,
             **conf: Any) -> Celery:
    app = Celery("routing", broker="memory://", set_as_current=False)
    if config is not None:
        app.config_from_object(config, namespace=namespace)
    app.conf.update(conf)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        queue=queue)

    @pikku.step("r.step")
    def step(data: Any) -> Any:
        return data

    return app


@pytest.fixture
def workers() -> Iterator[list[WorkController]]:
    made: list[WorkController] = []
    yield made
    for worker in made:
        worker.app.close()


def worker_of(app: Celery, made: list[WorkController], **kwargs: Any) -> WorkController:
    # Never started: no event loop (a hub would become kombu's global one for later tests).
    worker = WorkController(app=app, pool="solo", concurrency=CONCURRENCY,
                            use_eventloop=False, **kwargs)
    made.append(worker)
    return worker


def consumed(app: Celery) -> list[str]:
    return sorted(app.amqp.queues.consume_from)


# --- binding changes nothing ---------------------------------------------------------------


def test_binding_writes_no_setting_and_declares_no_queue() -> None:
    plain = Celery("routing", broker="memory://", set_as_current=False)
    bound = make_app()
    plain.conf.finalize()
    bound.conf.finalize()
    assert dict(bound.conf.changes) == dict(plain.conf.changes)
    assert bound.conf.worker_prefetch_multiplier == DEFAULT_PREFETCH
    assert set(bound.amqp.queues) == set(plain.amqp.queues) == {"celery"}


def test_without_a_queue_pikkus_messages_are_routed_like_any_task() -> None:
    app = make_app()
    assert app.pikku.routing.options("r.step", ("run", "s"), app.tasks["r.step"]) == {}


def test_a_plain_worker_is_unchanged_when_no_queue_is_configured(
        workers: list[WorkController]) -> None:
    app = make_app()
    worker = worker_of(app, workers)
    assert consumed(app) == ["celery"]
    assert worker.prefetch_multiplier == DEFAULT_PREFETCH
    assert worker.consumer.initial_prefetch_count == CONCURRENCY * DEFAULT_PREFETCH


def test_a_worker_of_the_default_queue_only_keeps_its_prefetch_without_a_pikku_queue(
        workers: list[WorkController]) -> None:
    app = make_app()
    worker = worker_of(app, workers, queues=["celery"])
    assert worker.prefetch_multiplier == DEFAULT_PREFETCH


# --- pikku's queue: where messages go ------------------------------------------------------


def test_pikkus_messages_go_to_its_queue() -> None:
    app = make_app("wf")
    options = app.pikku.routing.options("r.step", ("run", "s"), app.tasks["r.step"])
    assert options["queue"].name == "wf"
    orchestrate = internal_task(app, "orchestrate")
    assert orchestrate.name == "pikku.routing.orchestrate"  # the app's main name: routing
    assert app.pikku.routing.options(orchestrate.name, ("run",),
                                     orchestrate)["queue"].name == "wf"
    # A step task whose module is not imported here is sent by name: routed all the same.
    assert app.pikku.routing.options("elsewhere.step", ("run", "s"))["queue"].name == "wf"


def test_the_users_task_routes_win_task_by_task() -> None:
    app = make_app("wf", task_routes={"r.step": {"queue": "steps"},
                                      "pikku.routing.timer": "timers"})
    routing = app.pikku.routing
    timer, orchestrate = internal_task(app, "timer"), internal_task(app, "orchestrate")
    assert routing.options("r.step", ("run", "s"), app.tasks["r.step"]) == {}
    assert routing.options(timer.name, ("run", "s"), timer) == {}
    assert "queue" in routing.options(orchestrate.name, ("run",), orchestrate)


@pytest.mark.parametrize(("routes", "conf", "routed"), [
    # A glob route on pikku's prefix still takes every one of pikku's tasks.
    ({"pikku.*": {"queue": "wf-pikku"}}, {}, {"orchestrate", "timer", "reap"}),
    # An exact route on an old name does not match the app's names...
    ({"pikku.timer": {"queue": "timers"}}, {}, set()),
    # ...unless the namespace is set back to "pikku": the old names exactly.
    ({"pikku.timer": {"queue": "timers"}}, {"pikku_task_namespace": "pikku"}, {"timer"}),
    # The app's own names, as internal_task_names gives them.
    ({"pikku.routing.reap": {"queue": "reaps"}}, {}, {"reap"}),
])
def test_the_users_routes_for_pikkus_own_tasks(routes: dict[str, Any], conf: dict[str, Any],
                                              routed: set[str]) -> None:
    app = make_app(task_routes=routes, **conf)
    names = internal_task_names(app)
    found = {kind for kind, name in names.items()
             if app.amqp.router.route({}, name, (), {}, app.tasks[name]).get("queue").name
             != app.conf.task_default_queue}
    assert found == routed, names


@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")  # 'queue' attr
def test_a_steps_own_queue_option_wins() -> None:
    app = make_app("wf")

    @app.pikku.step("r.own_queue", queue="mine")
    def own_queue(data: Any) -> Any:
        return data

    assert app.pikku.routing.options("r.own_queue", ("run", "s"),
                                     app.tasks["r.own_queue"]) == {}


def test_the_pikku_queue_setting_is_read_when_used() -> None:
    app = make_app()
    app.conf.pikku_queue = "from-settings"  # after binding, as config_from_object may be
    assert app.pikku.routing.options("r.step", ("r", "s"))["queue"].name == "from-settings"


def test_pikkus_queue_works_without_create_missing_queues() -> None:
    app = make_app("wf", task_create_missing_queues=False)
    queue = app.pikku.routing.options("r.step", ("run", "s"))["queue"]
    assert queue.name == "wf" and queue.routing_key == "wf"


def test_a_declared_queue_is_used_as_declared() -> None:
    from kombu import Exchange, Queue

    declared = Queue("wf", Exchange("wf-x", type="topic"), routing_key="wf.#")
    app = make_app("wf", task_queues=[Queue("celery"), declared])
    assert app.pikku.routing.options("r.step", ("run", "s"))["queue"] is app.amqp.queues["wf"]
    assert app.amqp.queues["wf"].exchange.name == "wf-x"


# --- pikku's queue: which workers consume it, and their prefetch -------------------------


def test_a_worker_without_queues_consumes_pikkus_queue_with_the_apps_prefetch(
        workers: list[WorkController]) -> None:
    app = make_app("wf")
    worker = worker_of(app, workers)
    assert consumed(app) == ["celery", "wf"]
    assert worker.prefetch_multiplier == DEFAULT_PREFETCH


def test_a_worker_of_pikkus_queue_alone_gets_prefetch_1(
        workers: list[WorkController], caplog: pytest.LogCaptureFixture) -> None:
    app = make_app("wf")
    worker = worker_of(app, workers, queues=["wf"])
    assert consumed(app) == ["wf"]
    assert worker.prefetch_multiplier == 1
    assert worker.consumer.initial_prefetch_count == CONCURRENCY
    assert app.conf.worker_prefetch_multiplier == DEFAULT_PREFETCH  # the worker's, not the app's
    with caplog.at_level(logging.INFO, logger="pikku_celery"):
        app.pikku.routing._on_worker_ready(sender=worker.consumer)
    assert "consumes only pikku's queue 'wf': prefetch multiplier 1" in caplog.text


def test_a_worker_of_other_queues_is_told_it_runs_no_workflows(
        workers: list[WorkController], caplog: pytest.LogCaptureFixture) -> None:
    app = make_app("wf")
    worker = worker_of(app, workers, queues=["celery"])
    assert consumed(app) == ["celery"]
    assert worker.prefetch_multiplier == DEFAULT_PREFETCH
    with caplog.at_level(logging.INFO, logger="pikku_celery"):
        app.pikku.routing._on_worker_ready(sender=worker.consumer)
    assert "does not consume pikku's queue 'wf'" in caplog.text


def test_pikkus_queue_as_the_default_queue_gives_plain_workers_prefetch_1(
        workers: list[WorkController]) -> None:
    """An app that only runs workflows can make pikku's queue its default queue."""
    app = make_app("only", task_default_queue="only")
    worker = worker_of(app, workers)
    assert consumed(app) == ["only"]
    assert worker.prefetch_multiplier == 1


@pytest.mark.parametrize("source", ["keyword", "changes", "object", "django", "old name"])
def test_the_users_prefetch_wins_from_any_source(workers: list[WorkController],
                                                 source: str) -> None:
    class Settings:
        CELERY_WORKER_PREFETCH_MULTIPLIER = 3

    kwargs: dict[str, Any] = {}
    if source == "keyword":  # an in-process worker given prefetch_multiplier=3
        app, kwargs = make_app("wf"), {"prefetch_multiplier": 3}
    elif source == "changes":
        app = make_app("wf", worker_prefetch_multiplier=3)
    elif source == "object":
        app = make_app("wf", config={"worker_prefetch_multiplier": 3})
    elif source == "django":
        app = make_app("wf", config=Settings, namespace="CELERY")
    else:
        app = make_app("wf", config={"CELERYD_PREFETCH_MULTIPLIER": 3})
    worker = worker_of(app, workers, queues=["wf"], **kwargs)
    assert worker.prefetch_multiplier == 3


def test_an_explicit_default_value_still_wins(workers: list[WorkController]) -> None:
    """4 is Celery's default: only where it came from tells the user's 4 from it."""
    app = make_app("wf", config={"worker_prefetch_multiplier": DEFAULT_PREFETCH})
    assert worker_of(app, workers, queues=["wf"]).prefetch_multiplier == DEFAULT_PREFETCH


def test_conf_sets_sees_every_layer_but_the_defaults() -> None:
    app = Celery("routing", broker="memory://", set_as_current=False)
    assert not conf_sets(app.conf, "worker_prefetch_multiplier")
    app.conf.worker_prefetch_multiplier = 2
    assert conf_sets(app.conf, "worker_prefetch_multiplier")
    from_object = Celery("routing", broker="memory://", set_as_current=False)
    from_object.config_from_object({"worker_prefetch_multiplier": 2})
    assert "worker_prefetch_multiplier" not in from_object.conf.changes  # item 17's trap
    assert conf_sets(from_object.conf, "worker_prefetch_multiplier")


# --- the ``celery worker`` command's own worker class ----------------------------------------


def cli_worker_of(app: Celery, made: list[WorkController], **kwargs: Any) -> WorkController:
    """``celery.apps.worker.Worker``, what ``celery worker`` builds: it sends ``celeryd_init``
    before selecting the queues, so pikku's queue is declared first and ``-Q``/``-X`` apply
    to it as to any queue."""
    app.conf.worker_hijack_root_logger = False
    worker = app.Worker(pool="solo", concurrency=CONCURRENCY, quiet=True, use_eventloop=False,
                        **kwargs)
    made.append(worker)
    return worker


@pytest.mark.filterwarnings("ignore::celery.exceptions.SecurityWarning")  # tests run as root
def test_the_worker_command_applies_q_and_x_to_pikkus_queue(
        workers: list[WorkController]) -> None:
    plain = make_app("wf")
    cli_worker_of(plain, workers)
    assert consumed(plain) == ["celery", "wf"]
    excluded = make_app("wf")
    assert cli_worker_of(excluded, workers, exclude_queues=["wf"]).prefetch_multiplier == 4
    assert consumed(excluded) == ["celery"]
    dedicated = make_app("wf")
    assert cli_worker_of(dedicated, workers, queues=["wf"]).prefetch_multiplier == 1
    assert consumed(dedicated) == ["wf"]


@pytest.mark.filterwarnings("ignore::celery.exceptions.SecurityWarning")  # tests run as root
def test_the_worker_command_selects_pikkus_queue_without_create_missing_queues(
        workers: list[WorkController]) -> None:
    app = make_app("wf", task_create_missing_queues=False)
    assert cli_worker_of(app, workers, queues=["wf"]).prefetch_multiplier == 1
    assert consumed(app) == ["wf"]
