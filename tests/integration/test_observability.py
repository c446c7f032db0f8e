"""Observability on real workers: the Celery task id of every attempt in its history entry,
a retried attempt ending as Celery's RETRY (state, ``retry:`` line, one WARNING line, no
``raised unexpected`` traceback) without Celery sending the message again, and the signals
sent inside the worker carrying the same task ids."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.asynchronous import set_event_loop

from pikku_celery import InMemoryWorkflowStore, PikkuCelery, RedisLeaseService, signals
from tests.conftest import REDIS_URL
from tests.integration import test_celery_workers as workers
from tests.integration.test_celery_workers import TASK_PER_STEP, Cluster, task_line, wait_for

make_cluster = workers.make_cluster  # real ``celery -A`` workers: that module's fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_a_celery_worker_records_task_ids_and_logs_retries_as_retries(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster("redis", **TASK_PER_STEP)  # each attempt a task of its own
    worker = c.start("obs", "prefork")
    c.wait_ready(worker)

    run_id = c.pikku.start("pipeline", {"a": 1, "b": 2, "fail": 2})
    assert c.wait(run_id, 30).status == "completed"

    flaky = c.history(run_id, "flaky")
    assert [(h.attempt, h.status) for h in flaky] == [(1, "failed"), (2, "failed"),
                                                      (3, "succeeded")]
    ids = [h.task_id for h in flaky]
    assert all(ids) and len(set(ids)) == 3, ids
    # Each attempt's task id is the one the worker logged for it: the two failed attempts
    # ended as retries, the last as a success.
    for task_id in ids[:2]:
        line = wait_for(lambda t=task_id: task_line(worker, t, "retry:"), 10,
                        f"the retry line of task {task_id}", c.diagnostics)
        assert "pikku runs attempt" in line
    assert wait_for(lambda: task_line(worker, ids[2], "succeeded"), 10, "the success line")
    for step in ("sum", "left", "right"):
        (entry,) = c.history(run_id, step)
        assert entry.task_id and task_line(worker, entry.task_id, "succeeded"), step
    log = worker.log()
    warnings = [ln for ln in log.splitlines()
                if "WARNING" in ln and f"pikku: step 'flaky' of run {run_id}" in ln]
    assert len(warnings) == 2, warnings  # one per retried attempt
    assert "attempt 1 of 4 failed (RuntimeError: flaky failure on attempt 1)" in warnings[0]
    assert "raised unexpected" not in log and "Traceback" not in log, log
    # Celery sent nothing itself: each attempt ran once, from pikku's own message.
    assert sum(f"Task it.flaky[{ids[0]}] received" in ln for ln in log.splitlines()) == 1


@pytest.fixture
def own_event_loop() -> Iterator[None]:
    """An in-process worker adopts kombu's process-wide event loop if one is set. A worker
    built earlier in this process and never started (``test_celery_workers`` builds one)
    leaves a hub behind whose timer nobody runs, so the ETA messages that carry pikku's
    retry delays would never fire: start from none, and leave none."""
    set_event_loop(None)
    yield
    set_event_loop(None)


def test_in_a_worker_retry_state_signals_and_one_warning(
        key_prefix: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture,
        own_event_loop: None) -> None:
    queue = f"{key_prefix}-q"
    app = Celery(f"obs-{uuid.uuid4().hex[:6]}", broker=REDIS_URL, backend=REDIS_URL,
                 set_as_current=False)
    app.conf.update(
        task_default_queue=queue, worker_hijack_root_logger=False,
        broker_transport_options={"global_keyprefix": f"{key_prefix}:kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:results:"})
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(),
                        leases=RedisLeaseService.from_url(REDIS_URL, key_prefix=key_prefix),
                        worker_reaper=False, in_place_steps=0)  # each attempt a task

    @pikku.step(name="obs.flaky", bind=True, retries=2, retry_delay="20ms")
    def flaky(ctx: Any, data: Any) -> int:
        if ctx.attempt < 3:
            raise ValueError(f"attempt {ctx.attempt} fails")
        return ctx.attempt  # type: ignore[no-any-return]

    @pikku.step(name="obs.doomed", retries=1, retry_delay="20ms")
    def doomed(data: Any) -> None:
        raise KeyError("always")

    @pikku.workflow("obs-flow")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("flaky", flaky, data)

    @pikku.workflow("obs-doomed")
    def doomed_flow(wf: Any, data: Any) -> Any:
        return wf.do("doomed", doomed, data)

    seen: list[tuple[str, dict[str, Any]]] = []

    def record(sender: Any = None, signal: Any = None, **fields: Any) -> None:
        seen.append((signal.name, fields))

    for signal in (signals.step_attempt_started, signals.step_attempt_finished):
        signal.connect(record, weak=False)
    try:
        with caplog.at_level(logging.INFO), start_worker(
                app, pool="threads", concurrency=2, perform_ping_check=False,
                shutdown_timeout=10, loglevel="INFO"):
            run_id = pikku.start(flow, None)
            assert pikku.wait(run_id, 30).output == 3
            doomed_id = pikku.start(doomed_flow, None)
            assert pikku.wait(doomed_id, 30).status == "failed"
    finally:
        for signal in (signals.step_attempt_started, signals.step_attempt_finished):
            signal.disconnect(record)

    ids = [h.task_id for h in pikku.get_history(run_id)]
    assert all(ids) and len(set(ids)) == 3
    states = [app.AsyncResult(task_id).state for task_id in ids]
    assert states == ["RETRY", "RETRY", "SUCCESS"]
    assert isinstance(app.AsyncResult(ids[0]).result, ValueError)
    doomed_ids = [h.task_id for h in pikku.get_history(doomed_id)]
    assert [app.AsyncResult(t).state for t in doomed_ids] == ["RETRY", "FAILURE"]

    started = [f["task_id"] for name, f in seen
               if name == "pikku_step_attempt_started" and f["run_id"] == run_id]
    finished = [(f["task_id"], f["status"]) for name, f in seen
                if name == "pikku_step_attempt_finished" and f["run_id"] == run_id]
    assert started == ids
    assert finished == [(ids[0], "failed"), (ids[1], "failed"), (ids[2], "succeeded")]

    pikku_warnings = [r for r in caplog.records if r.name == "pikku_celery"
                      and r.levelno == logging.WARNING and run_id in r.getMessage()]
    assert len(pikku_warnings) == 2  # one line per retried attempt
    retried = [r for r in caplog.records if r.name == "celery.app.trace"
               and " retry: " in r.getMessage() and "obs.flaky" in r.getMessage()]
    assert len(retried) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR
              and "obs.flaky" in r.getMessage()]
    assert errors == []  # no "raised unexpected", no traceback for a retried attempt
    # The last attempt of the doomed step is a real failure, logged as Celery logs one.
    assert any("obs.doomed" in r.getMessage() and "raised unexpected" in r.getMessage()
               for r in caplog.records)
