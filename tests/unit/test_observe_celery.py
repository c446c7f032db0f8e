"""Issue 33, parts 3-5, with the in-place driver: a step run in place gets a task id of its
own (recorded with its attempt) and reports ``in_place`` and its exception; its failure
reaches Celery's ``task_failure`` hooks and Sentry (capturing transport) as the step's; every
pikku log line carries the run, step and attempt, and the step's task line is logged as
Celery logs a task's."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sentry_sdk
from celery import Celery, signals
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.transport import Transport

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery, observe
from pikku_celery.observe import logs
from tests.unit.test_in_place import Worker

FAR = 10**13


def _pikku(monkeypatch: pytest.MonkeyPatch | None = None, *observers: Any) -> PikkuCelery:
    if monkeypatch is not None:
        monkeypatch.setattr(observe, "install", lambda pikku: list(observers))
    return PikkuCelery(Celery(f"obsc-{uuid.uuid4().hex[:8]}", broker="memory://"),
                       store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False)


def _is_uuid(value: Any) -> bool:
    try:
        return str(uuid.UUID(str(value))) == value
    except ValueError:
        return False


# --- the attempt events: in_place, exception, task ids ---------------------------------------

def test_a_step_run_in_place_has_a_task_id_of_its_own_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    pikku = _pikku(monkeypatch, lambda event, sender, fields: seen.append((event, fields)))
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"oc{tag}.inc")
    def inc(n: int) -> int:
        return n + 1

    @pikku.workflow(f"oc-{tag}")
    def flow(wf: Any, n: int) -> int:
        return int(wf.do("b", inc, wf.do("a", inc, n)))

    worker = Worker(pikku)
    run_id = pikku.start(flow, 1)
    worker.drain()
    assert worker.sent == [] and pikku.get_run(run_id).output == 3
    started = [f for e, f in seen if e == "step_attempt_started"]
    finished = [f for e, f in seen if e == "step_attempt_finished"]
    assert [f["in_place"] for f in started + finished] == [True] * 4
    ids = [f["task_id"] for f in started]
    assert all(_is_uuid(i) for i in ids) and len(set(ids)) == 2, ids
    assert [f["task_id"] for f in finished] == ids
    assert [f["exception"] for f in finished] == [None, None]
    # Recorded with each attempt: the first step's (inserted claimed) and the second's
    # (claimed in the command that settles the first).
    assert [(h.step_name, h.task_id) for h in pikku.get_history(run_id)] == [
        ("a", ids[0]), ("b", ids[1])]
    assert [s.task_id for s in pikku.get_steps(run_id)] == ids


def test_a_delivered_step_is_not_in_place_and_its_failure_carries_the_exception(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    pikku = _pikku(monkeypatch, lambda event, sender, fields: seen.append((event, fields)))
    tag = uuid.uuid4().hex[:6]
    raised: list[BaseException] = []

    @pikku.step(name=f"oc{tag}.boom", retries=0)
    def boom(data: Any) -> None:
        raised.append(ValueError("no"))
        raise raised[-1]

    @pikku.workflow(f"oc-d-{tag}")
    def flow(wf: Any, data: Any) -> None:
        wf.do("x", boom, data)

    run_id, _ = pikku.engine.create_run(flow, None)
    pikku.engine.advance(run_id.run_id)  # not in place: the step is sent
    task = pikku.app.tasks[f"oc{tag}.boom"]
    result = task.apply(args=(run_id.run_id, "x"), task_id="delivered-1")
    assert result.state == "FAILURE"
    (finished,) = [f for e, f in seen if e == "step_attempt_finished"]
    assert finished["in_place"] is False and finished["task_id"] == "delivered-1"
    assert finished["exception"] is raised[0] and finished["status"] == "failed"


# --- error trackers ---------------------------------------------------------------------------

class _Capture(Transport):  # type: ignore[misc]
    events: list[dict[str, Any]] = []

    def capture_envelope(self, envelope: Any) -> None:
        event = envelope.get_event()
        if event is not None:
            _Capture.events.append(event)


@pytest.fixture
def sentry() -> Iterator[list[dict[str, Any]]]:
    _Capture.events = []
    sentry_sdk.init(dsn="http://key@127.0.0.1:9/1", transport=_Capture,
                    integrations=[CeleryIntegration()], default_integrations=False)
    try:
        yield _Capture.events
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.get_global_scope().set_client(None)


def test_a_failing_step_run_in_place_is_one_sentry_event_and_one_task_failure(
        sentry: list[dict[str, Any]]) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]
    failures: list[dict[str, Any]] = []

    def on_failure(sender: Any = None, **kwargs: Any) -> None:
        failures.append({"sender": sender, **kwargs})

    @pikku.step(name=f"oce{tag}.ok")
    def ok(data: Any) -> str:
        return "fine"

    @pikku.step(name=f"oce{tag}.boom", retries=0)
    def boom(data: Any) -> None:
        raise KeyError("the step's own error")

    @pikku.workflow(f"oce-{tag}")
    def flow(wf: Any, data: Any) -> None:
        wf.do("ok", ok, data)
        wf.do("boom", boom, data)

    signals.task_failure.connect(on_failure)
    try:
        worker = Worker(pikku)
        run_id = pikku.start(flow, None)
        worker.drain()
    finally:
        signals.task_failure.disconnect(on_failure)
    assert pikku.get_run(run_id).status == "failed" and worker.sent == []
    sentry_sdk.flush()
    (attempt,) = [h for h in pikku.get_history(run_id) if h.step_name == "boom"]
    (event,) = sentry
    assert event["tags"]["pikku.run_id"] == run_id and event["tags"]["pikku.step"] == "boom"
    assert event["tags"]["pikku.attempt"] == "1"
    assert event["tags"]["celery_task_id"] == attempt.task_id
    assert event["transaction"] == f"oce{tag}.boom"
    assert event["extra"]["celery-job"]["task_name"] == f"oce{tag}.boom"
    (exc,) = event["exception"]["values"]
    assert exc["type"] == "KeyError" and exc["mechanism"]["type"] == "celery"
    (failure,) = failures
    assert failure["sender"] is pikku.app.tasks[f"oce{tag}.boom"]
    assert failure["task_id"] == attempt.task_id and failure["args"] == (run_id, "boom")
    assert isinstance(failure["exception"], KeyError)


def test_retried_and_superseded_attempts_are_not_reported(
        sentry: list[dict[str, Any]]) -> None:
    pikku = _pikku()
    store = pikku.engine.store
    tag = uuid.uuid4().hex[:6]
    calls: list[int] = []

    @pikku.step(name=f"ocs{tag}.flaky", retries=1, retry_delay="1ms")
    def flaky(data: Any) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("once")  # a retry to come: Celery's Retry, not a failure
        return "ok"

    @pikku.step(name=f"ocs{tag}.late", retries=1)
    def late(data: Any) -> None:
        # Another attempt takes the step meanwhile: this attempt's failure is refused.
        assert store.claim_step(run_id, "late", f"ocs{tag}.late", FAR, 60_000).state
        raise RuntimeError("superseded, not a failure")

    @pikku.workflow(f"ocs-{tag}")
    def flow(wf: Any, data: Any) -> None:
        wf.do("flaky", flaky, data)
        wf.do("late", late, data)

    worker = Worker(pikku)
    run_id = pikku.start(flow, None)
    worker.drain()
    sentry_sdk.flush()
    history = [(h.step_name, h.attempt, h.status) for h in pikku.get_history(run_id)]
    assert history[:2] == [("flaky", 1, "failed"), ("flaky", 2, "succeeded")], history
    assert ("late", 1, "failed") in history and ("late", 2, "running") in history, history
    assert sentry == []


# --- logs ------------------------------------------------------------------------------------

def test_pikku_log_lines_carry_the_run_step_and_attempt_and_task_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]
    child = logging.getLogger("pikku_celery.reaper")

    @pikku.step(name=f"ocl{tag}.say")
    def say(text: str) -> str:
        logging.getLogger("pikku_celery").info("inside %s", text)
        child.info("a child logger's line")
        return text.upper()

    @pikku.step(name=f"ocl{tag}.flaky", retries=1, retry_delay="1ms")
    def flaky(data: Any) -> str:
        if not calls:
            calls.append(1)
            raise RuntimeError("once")
        return "done"

    calls: list[int] = []

    @pikku.workflow(f"ocl-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("say", say, "hi")) + str(wf.do("flaky", flaky, data))

    worker = Worker(pikku)
    with caplog.at_level(logging.INFO, "pikku_celery"):
        run_id = pikku.start(flow, None)
        worker.drain()
    assert pikku.get_run(run_id).output == "HIdone"
    history = {(h.step_name, h.attempt): h for h in pikku.get_history(run_id)}
    by_text = {r.getMessage(): r for r in caplog.records}
    inside = by_text["inside hi"]
    assert (inside.run_id, inside.step, inside.attempt) == (run_id, "say", 1)  # type: ignore[attr-defined]
    assert by_text["a child logger's line"].step == "say"  # type: ignore[attr-defined]
    say_id = history[("say", 1)].task_id
    (line,) = [r for r in caplog.records if f"[{say_id}] succeeded in " in r.getMessage()]
    assert line.levelno == logging.INFO and line.getMessage().startswith(
        f"Task ocl{tag}.say[{say_id}] succeeded in ") and line.getMessage().endswith(": 'HI'")
    assert (line.run_id, line.step, line.attempt) == (run_id, "say", 1)  # type: ignore[attr-defined]
    retry_id = history[("flaky", 1)].task_id
    (retry,) = [r for r in caplog.records if f"[{retry_id}] retry: " in r.getMessage()]
    assert "attempt 1 of 2 failed (RuntimeError: once); pikku runs attempt 2 at" in (
        retry.getMessage())
    # Outside any pass or attempt (a thread that runs none): the fields are there, None.
    record = logging.LogRecord("pikku_celery", logging.INFO, __file__, 1, "x", None, None)
    other = threading.Thread(target=logs.ContextFilter().filter, args=(record,))
    other.start()
    other.join()
    assert (record.run_id, record.step) == (None, None)  # type: ignore[attr-defined]


def test_a_step_failing_for_good_in_place_logs_celerys_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"ocf{tag}.boom", retries=0)
    def boom(data: Any) -> None:
        raise ValueError("bad input")

    @pikku.workflow(f"ocf-{tag}")
    def flow(wf: Any, data: Any) -> None:
        wf.do("boom", boom, data)

    worker = Worker(pikku)
    with caplog.at_level(logging.INFO, "pikku_celery"):
        run_id = pikku.start(flow, None)
        worker.drain()
    (attempt,) = pikku.get_history(run_id)
    (line,) = [r for r in caplog.records if "raised unexpected" in r.getMessage()]
    assert line.levelno == logging.ERROR and line.exc_info is not None
    assert line.getMessage() == (f"Task ocf{tag}.boom[{attempt.task_id}] raised unexpected: "
                                 "ValueError('bad input')")


def test_an_attempt_whose_end_was_never_reported_does_not_stick_to_the_thread() -> None:
    """A delivery that an exception ended before its report (``SystemExit`` in a body, a
    settle that raised): the next delivery in the thread has its own fields only, and
    once it ends, none."""
    observer = logs.LogContext()
    done = threading.Event()
    seen: list[tuple[Any, ...]] = []

    def thread() -> None:
        observer("step_attempt_started", "f", {"run_id": "r1", "step_name": "a", "attempt": 1,
                                               "in_place": False})
        observer("step_attempt_started", "f", {"run_id": "r2", "step_name": "b", "attempt": 3,
                                               "in_place": False})
        seen.append(logs.current.get())
        observer("step_attempt_finished", "f", {"run_id": "r2", "step_name": "b",
                                                "attempt": 3, "in_place": False,
                                                "status": "succeeded"})
        seen.append(logs.current.get())
        done.set()

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    assert done.is_set()
    assert seen == [("r2", None, "b", 3), (None, None, None, None)]


def test_a_step_failing_as_its_own_task_is_sentrys_one_event_with_pikkus_tags(
        sentry: list[dict[str, Any]]) -> None:
    """A sent step fails as its task: Sentry's Celery integration reports it (pikku adds
    nothing, so nothing twice), and the task's scope carries the attempt's tags."""
    pikku = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"ocx{tag}.boom", retries=0)
    def boom(data: Any) -> None:
        raise ValueError("as a task")

    @pikku.workflow(f"ocx-{tag}")
    def flow(wf: Any, data: Any) -> None:
        wf.do("x", boom, data)

    run, _ = pikku.engine.create_run(flow, None)
    pikku.engine.advance(run.run_id)  # not in place: the step is sent
    result = pikku.app.tasks[f"ocx{tag}.boom"].apply(args=(run.run_id, "x"),
                                                      task_id="sent-1")
    assert result.state == "FAILURE"
    sentry_sdk.flush()
    (event,) = sentry
    assert event["tags"]["celery_task_id"] == "sent-1"
    assert event["tags"]["pikku.run_id"] == run.run_id and event["tags"]["pikku.step"] == "x"
    assert event["exception"]["values"][-1]["type"] == "ValueError"
