"""Two Celery apps on one broker queue (issue 25 item 6): a worker of app A never runs app
B's orchestrator message.

Before, every app named its orchestrator task ``pikku.orchestrate``: a worker of A that
took B's wake-up message from the shared queue ran A's task on it, with A's engine, so it
read B's run (here the two apps share one database, as two apps left at the defaults do)
and failed it: B's workflow is not registered in A. Now each app's tasks are named after
it (``pikku.<main>.orchestrate``): A's worker still takes the message (Celery has no
consumer-side filter on a queue), but Celery refuses it as an unregistered task of that
name (logged as such), and nothing of A's runs on it; B's reaper wakes the run again for
B's own worker. The second case sets both apps'
``pikku_task_namespace`` to ``"pikku"`` (the old names) and shows the old failure, so the
first case is known to catch it. Real in-process workers on Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, signals

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.worker.tasks import internal_task_names
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.timeout(120)]
STALLED_AFTER_S = 0.3


def _app(key_prefix: str, name: str, store: InMemoryWorkflowStore,
         namespace: str | None) -> PikkuCelery:
    app = Celery(f"{key_prefix}-{name}", broker=REDIS_URL, set_as_current=False)
    app.conf.update(task_default_queue=f"{key_prefix}-shared",  # one queue for both apps
                    broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"})
    if namespace is not None:
        app.conf.pikku_task_namespace = namespace
    return PikkuCelery(app, store=store, leases=InMemoryLeaseService(), worker_reaper=False,
                       stalled_after=STALLED_AFTER_S)


@pytest.fixture
def seen() -> Iterator[dict[str, list[Any]]]:
    """What the workers did: tasks they ran (app, task name, args), tasks they failed,
    and task names they refused as unregistered."""
    found: dict[str, list[Any]] = {"ran": [], "failed": [], "unknown": []}

    def ran(sender: Any = None, args: Any = None, **_: Any) -> None:
        found["ran"].append((sender.app.main, sender.name, tuple(args or ())))

    def failed(sender: Any = None, **_: Any) -> None:
        found["failed"].append((sender.app.main, sender.name))

    def unknown(name: str | None = None, **_: Any) -> None:
        found["unknown"].append(name)

    hooks: list[tuple[Any, Callable[..., None]]] = [
        (signals.task_prerun, ran), (signals.task_failure, failed),
        (signals.task_unknown, unknown)]
    for signal, hook in hooks:
        signal.connect(hook, weak=False)
    yield found
    for signal, hook in hooks:
        signal.disconnect(hook)


def _wait_for(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("namespace", [None, "pikku"], ids=["per-app-names", "old-names"])
def test_a_worker_of_another_app_never_runs_this_apps_orchestrator_message(
        key_prefix: str, seen: dict[str, list[Any]], namespace: str | None) -> None:
    from celery.contrib.testing.worker import start_worker

    store = InMemoryWorkflowStore()  # one database for both apps
    a = _app(key_prefix, "a", store, namespace)
    b = _app(key_prefix, "b", store, namespace)
    b.step(name="iso.b.work")(lambda data: data)

    @b.workflow("iso.b.flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("work", "iso.b.work", data)

    b_orchestrate = internal_task_names(b.app)["orchestrate"]
    with start_worker(a.app, pool="threads", concurrency=1, perform_ping_check=False,
                      shutdown_timeout=10):  # only app A's worker consumes the queue
        run_id = b.start("iso.b.flow", 1)  # B's wake-up message, on the shared queue
        if namespace is None:
            assert b_orchestrate == f"pikku.{key_prefix}-b.orchestrate"
            assert b_orchestrate not in a.app.tasks
            _wait_for(lambda: b_orchestrate in seen["unknown"],
                      "A's worker to refuse B's message as an unregistered task")
        else:  # the old names: A's orchestrator task runs B's message, and fails
            _wait_for(lambda: seen["failed"], "A's worker to fail B's message")
    if namespace is None:
        assert seen["ran"] == [] and seen["failed"] == [], seen  # nothing of A's ran
        assert [s.step_name for s in b.get_steps(run_id)] == []  # B's run untouched
        assert b.get_run(run_id).status == "running"
        # The message itself is gone (Celery drops an unregistered task): B's reaper
        # wakes the stalled run again, and B's own worker runs it.
        time.sleep(STALLED_AFTER_S * 2)
        with start_worker(b.app, pool="threads", concurrency=1, perform_ping_check=False,
                          shutdown_timeout=10):
            assert b.reap()["stalled"] == 1
            assert b.wait(run_id, 20).output == 1
        assert {main for main, _, _ in seen["ran"]} == {b.app.main}, seen
    else:
        assert seen["ran"] == [(a.app.main, "pikku.orchestrate", (run_id,))], seen
        assert seen["failed"] == [(a.app.main, "pikku.orchestrate")], seen
