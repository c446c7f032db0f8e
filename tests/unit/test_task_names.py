"""pikku's own tasks are named per app (issue 25 item 6): ``<namespace>.orchestrate``,
``.timer`` and ``.reap``, the namespace being the ``pikku_task_namespace`` setting (default
``pikku.<main>``), so another app's worker on the same broker never runs one; and what an
orchestrator pass returns (Celery logs it) says what the pass did."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.worker.tasks import (
    ORCHESTRATE,
    REAP,
    TIMER,
    internal_task,
    internal_task_names,
)
from tests.unit.test_engine import Recorder

KINDS = ("orchestrate", "timer", "reap")


def bound(main: str | None = "shop", **conf: Any) -> Celery:
    app = Celery(main, broker="memory://", set_as_current=False)
    app.conf.update(conf)
    PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                worker_reaper=False)
    return app


def names(namespace: str) -> dict[str, str]:
    return {kind: f"{namespace}.{kind}" for kind in KINDS}


# --- the names -----------------------------------------------------------------------------


@pytest.mark.parametrize(("main", "namespace"), [
    ("shop", "pikku.shop"),
    ("proj.celery", "pikku.proj.celery"),
    ("my-app", "pikku.my-app"),
    ("my app/v2", "pikku.my_app_v2"),  # what a name cannot hold becomes '_'
    ("..", "pikku"),
    (None, "pikku"),  # Celery(): no main name
    ("__main__", "pikku"),  # a script's app: its worker imports it under another name
])
def test_the_names_derive_from_the_apps_main_name(main: str | None, namespace: str) -> None:
    app = bound(main)
    assert internal_task_names(app) == names(namespace)
    assert set(names(namespace).values()) <= set(app.tasks)
    assert internal_task(app, "orchestrate").name == f"{namespace}.orchestrate"


def test_two_apps_share_no_task_name() -> None:
    a, b = bound("shop"), bound("billing")
    assert set(internal_task_names(a).values()).isdisjoint(internal_task_names(b).values())
    assert not set(internal_task_names(b).values()) & set(a.tasks)
    assert not {ORCHESTRATE, TIMER, REAP} & (set(a.tasks) | set(b.tasks))


def test_the_namespace_pikku_gives_the_names_of_before() -> None:
    app = bound(pikku_task_namespace="pikku")
    assert internal_task_names(app) == {"orchestrate": ORCHESTRATE, "timer": TIMER,
                                        "reap": REAP}
    assert {ORCHESTRATE, TIMER, REAP} <= set(app.tasks)


def test_the_setting_is_read_when_the_app_is_finalized() -> None:
    """Configured after ``PikkuCelery(app)``, as a Flask factory or Django does it."""
    app = Celery("shop", broker="memory://", set_as_current=False)
    PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                worker_reaper=False)
    assert internal_task_names(app) == names("pikku.shop")  # what the configuration says now
    app.conf.pikku_task_namespace = "shop.workflows"
    assert internal_task_names(app) == names("shop.workflows")
    assert set(names("shop.workflows").values()) <= set(app.tasks)  # finalized here
    app.conf.pikku_task_namespace = "changed.later"  # too late: the tasks have their names
    assert internal_task_names(app) == names("shop.workflows")


def test_an_app_finalized_before_binding_gets_its_names_at_once() -> None:
    app = Celery("early", broker="memory://", set_as_current=False)
    app.conf.pikku_task_namespace = "early.ns"
    app.finalize()
    PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                worker_reaper=False)
    assert set(names("early.ns").values()) <= set(app.tasks)


def test_the_setting_from_django_style_settings() -> None:
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.config_from_object({"CELERY_PIKKU_TASK_NAMESPACE": "proj.flows"}, namespace="CELERY")
    PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                worker_reaper=False)
    assert set(names("proj.flows").values()) <= set(app.tasks)


def test_an_empty_setting_is_the_default() -> None:
    assert internal_task_names(bound("shop", pikku_task_namespace="")) == names("pikku.shop")


@pytest.mark.parametrize("bad", [
    "pikku.*", "a..b", ".a", "a.", "a b", "é", "a/b", " a", "x" * 151, 5, ["a"],
])
def test_a_bad_namespace_is_refused_naming_the_setting(bad: object) -> None:
    app = Celery("shop", broker="memory://", set_as_current=False)
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    app.conf.pikku_task_namespace = bad
    with pytest.raises(PikkuConfigurationError, match=r"invalid pikku_task_namespace") as got:
        pikku.engine  # noqa: B018  (built at first use: where every bad setting is refused)
    assert "<namespace>.orchestrate" in str(got.value) and len(str(got.value)) < 500
    with pytest.raises(PikkuConfigurationError, match=r"invalid pikku_task_namespace"):
        internal_task_names(app)
    with pytest.raises(PikkuConfigurationError, match=r"invalid pikku_task_namespace"):
        app.finalize()


def test_the_error_names_the_namespaced_setting() -> None:
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.config_from_object({"CELERY_PIKKU_TASK_NAMESPACE": "a..b"}, namespace="CELERY")
    with pytest.raises(PikkuConfigurationError, match="CELERY_PIKKU_TASK_NAMESPACE"):
        internal_task_names(app)


@pytest.mark.parametrize("good", ["pikku", "shop", "Shop_2.flows-v1", "a.b.c.d", "x" * 150])
def test_good_namespaces(good: str) -> None:
    assert internal_task_names(bound(pikku_task_namespace=good)) == names(good)


# --- every internal message is sent under the app's names --------------------------------


@pytest.fixture
def published() -> Iterator[list[str]]:
    sent: list[str] = []

    def note(sender: str | None = None, **_: Any) -> None:
        sent.append(str(sender))

    signals.before_task_publish.connect(note, weak=False)
    yield sent
    signals.before_task_publish.disconnect(note)


def test_the_dispatcher_sends_the_apps_names(published: list[str]) -> None:
    app = bound("shop")
    pikku = app.pikku

    @pikku.workflow("names.nap")
    def nap(wf: Any, data: Any) -> None:
        wf.sleep("nap", "1h")

    run_id = pikku.start("names.nap", None)  # a wake-up message
    assert published == ["pikku.shop.orchestrate"]
    published.clear()
    assert internal_task(app, "orchestrate").apply(args=(run_id,)).result == "waiting"
    assert published == ["pikku.shop.timer"]  # the sleep's timer


# --- what a pass returns ------------------------------------------------------------------


@pytest.fixture
def pikku() -> PikkuCelery:
    return bound(f"ret-{id(object())}").pikku  # type: ignore[no-any-return]


def test_a_pass_says_it_dispatched_waits_or_how_the_run_ended(pikku: PikkuCelery) -> None:
    recorder = Recorder()
    pikku.engine.dispatcher = recorder

    @pikku.step(name="names.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow("names.flow")
    def flow(wf: Any, data: Any) -> int:
        value = int(wf.do("one", one))
        wf.sleep("nap", "1h")
        return value

    run_id = pikku.start("names.flow", None)
    assert pikku.engine.advance(run_id) == "dispatched" and len(recorder.steps) == 1
    assert pikku.engine.advance(run_id) == "waiting"  # on "one", sent already
    pikku.engine.execute_step(pikku.registry.steps["names.one"], run_id, "one")
    assert pikku.engine.advance(run_id, step_name="one") == "waiting"  # on the timer
    assert [t[1] for t in recorder.timers] == ["nap"]


def test_the_orchestrate_task_says_dispatched_then_how_the_run_ended(
        pikku: PikkuCelery) -> None:
    pikku.engine.dispatcher = Recorder()

    @pikku.step(name="names.two")
    def two(data: Any) -> int:
        return 2

    @pikku.workflow("names.two_flow")
    def two_flow(wf: Any, data: Any) -> int:
        return int(wf.do("two", two))

    run_id = pikku.start("names.two_flow", None)
    outcome = internal_task(pikku.app, "orchestrate").apply(args=(run_id,))
    assert (outcome.state, outcome.result) == ("SUCCESS", "dispatched")
    pikku.engine.execute_step(pikku.registry.steps["names.two"], run_id, "two")
    outcome = internal_task(pikku.app, "orchestrate").apply(args=(run_id, "two"))
    assert (outcome.state, outcome.result) == ("SUCCESS", "completed")


def test_the_beat_entry_names_the_apps_own_reap_task() -> None:
    app = Celery("shop", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    assert pikku.beat_schedule_entry("10s") == {"task": "pikku.shop.reap", "schedule": 10.0}
