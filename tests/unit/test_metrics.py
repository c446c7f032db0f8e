"""Prometheus metrics (``pikku_celery.observe.metrics``, issue 33 part 2): each family counted
from what the engine reports, read back from a registry of the test's own
(``pikku_metrics_registry``); the default registry when none is named; the worker's server
(``observe.serve``) and the runs the store holds; bad settings named."""

from __future__ import annotations

import urllib.request
import uuid
from typing import Any

import prometheus_client
import pymongo.errors
import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.model.errors import PikkuConfigurationError
from pikku_celery.observe import metrics
from pikku_celery.observe.serve import MetricsServer, RunsCollector, served_registry
from pikku_celery.schedules.firing import Scheduler
from pikku_celery.testing import inline
from tests.unit.test_engine import Recorder
from tests.unit.test_engine_fencing import FakeClock, _worker_dies_holding
from tests.unit.test_in_place import FAR, Worker

#: A registry named by its dotted path (``pikku_metrics_registry = "...:DOTTED"``).
DOTTED = CollectorRegistry()


def _pikku(registry: Any = None, **conf: Any) -> tuple[PikkuCelery, CollectorRegistry]:
    registry = CollectorRegistry() if registry is None else registry
    app = Celery(f"metrics-{uuid.uuid4().hex[:8]}", broker="memory://")
    app.conf.update(pikku_metrics_registry=registry, **conf)
    return PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                       worker_reaper=False), registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_attempts_runs_and_passes_are_counted_by_outcome() -> None:
    pikku, reg = _pikku()
    tag = uuid.uuid4().hex[:6]
    calls = {"n": 0}

    @pikku.step(name=f"m{tag}.ok")
    def ok(data: Any) -> int:
        return 1

    @pikku.step(name=f"m{tag}.flaky", retries=1, retry_delay=0)
    def flaky(data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("once")
        return 2

    @pikku.step(name=f"m{tag}.bad", retries=0)
    def bad(data: Any) -> int:
        raise ValueError("always")

    @pikku.workflow(f"mflow-{tag}")
    def flow(wf: Any, data: Any) -> int:
        return int(wf.do("a", ok, data)) + int(wf.do("b", flaky, data))

    @pikku.workflow(f"mfail-{tag}")
    def failing(wf: Any, data: Any) -> int:
        return int(wf.do("x", bad, data))

    worker = Worker(pikku)
    done = [pikku.start(flow, None) for _ in range(3)]
    failed = pikku.start(failing, None)
    worker.drain()
    assert [pikku.get_run(r).status for r in done] == ["completed"] * 3
    assert pikku.get_run(failed).status == "failed"

    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.ok",
                  outcome="succeeded") == 3
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.flaky",
                  outcome="failed") == 1
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.flaky",
                  outcome="succeeded") == 3
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.bad", outcome="failed") == 1
    assert _value(reg, "pikku_step_attempt_duration_seconds_count", step=f"m{tag}.ok",
                  outcome="succeeded") == 3
    started = sum(_value(reg, "pikku_step_attempts_started_total", step=f"m{tag}.ok",
                         in_place=v) for v in ("true", "false", "unknown"))
    assert started == 3
    assert _value(reg, "pikku_runs_started_total", workflow=f"mflow-{tag}") == 3
    assert _value(reg, "pikku_runs_finished_total", workflow=f"mflow-{tag}",
                  status="completed") == 3
    assert _value(reg, "pikku_runs_finished_total", workflow=f"mfail-{tag}",
                  status="failed") == 1
    assert _value(reg, "pikku_run_duration_seconds_count", workflow=f"mflow-{tag}",
                  status="completed") == 3
    assert _value(reg, "pikku_pass_duration_seconds_count", workflow=f"mflow-{tag}",
                  outcome="ended") == 3
    assert _value(reg, "pikku_pass_duration_seconds_count", workflow=f"mfail-{tag}",
                  outcome="ended") == 1
    assert _value(reg, "pikku_pass_duration_seconds_sum", workflow=f"mflow-{tag}",
                  outcome="ended") > 0


def test_a_superseded_attempt_is_counted_as_superseded() -> None:
    pikku, reg = _pikku()
    store = pikku.engine.store
    tag = uuid.uuid4().hex[:6]
    run_id = ""

    @pikku.step(name=f"m{tag}.first", retries=1)
    def first(data: Any) -> str:  # another worker reclaims the step while the body runs
        again = store.claim_step(run_id, "a", f"m{tag}.first", FAR, 60_000)
        assert again.state is not None and again.state.attempt == 2
        return "attempt-1"

    @pikku.workflow(f"msup-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("a", first, data))

    worker = Worker(pikku)
    run_id = pikku.start(flow, None)
    worker.drain()
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.first",
                  outcome="superseded") == 1
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.first",
                  outcome="succeeded") == 0


def test_the_reaper_counts_lapsed_attempts_and_its_recoveries() -> None:
    clock = FakeClock()
    reg = CollectorRegistry()
    app = Celery(f"metrics-{uuid.uuid4().hex[:8]}", broker="memory://")
    app.conf.pikku_metrics_registry = reg
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(),
                        leases=InMemoryLeaseService(clock_ms=clock), step_lease=1,
                        worker_reaper=False)
    pikku.engine.dispatcher = Recorder()
    tag = uuid.uuid4().hex[:6]
    step = pikku.step(name=f"m{tag}.slow")(lambda data: None)

    @pikku.workflow(f"mreap-{tag}")
    def flow(wf: Any, data: Any) -> Any:
        return wf.do("s", step)

    run_id = pikku.start(flow, None)
    pikku.engine.advance(run_id)
    _worker_dies_holding(pikku, run_id, "s", f"m{tag}.slow")
    clock.ms += 1001
    assert pikku.reap()["lapsed"] == 1
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.slow",
                  outcome="lease_expired") == 1
    assert _value(reg, "pikku_reaper_recoveries_total", kind="lapsed") == 1
    assert _value(reg, "pikku_reaper_recoveries_total", kind="stalled") == 0
    assert pikku.reap()["lapsed"] == 0  # re-sent once per lease: counted once
    assert _value(reg, "pikku_step_attempts_total", step=f"m{tag}.slow",
                  outcome="lease_expired") == 1


def test_a_failing_sweep_counts_a_mongodb_error_by_kind() -> None:
    pikku, reg = _pikku()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise pymongo.errors.AutoReconnect("primary stepped down")

    pikku.engine.store.find_event_wakes = refuse  # type: ignore[method-assign]
    with pytest.raises(pymongo.errors.AutoReconnect):
        pikku.engine.reap()
    assert _value(reg, "pikku_service_errors_total", service="mongodb", kind="AutoReconnect",
                  where="reaper") == 1


def test_an_error_of_neither_service_is_not_a_service_error() -> None:
    assert metrics.driver_error(RuntimeError("bug")) is None
    assert metrics.driver_error(pymongo.errors.NotPrimaryError("x")) == (
        "mongodb", "NotPrimaryError")
    import redis

    try:
        try:
            raise redis.exceptions.ConnectionError("refused")
        except redis.exceptions.ConnectionError as exc:
            raise RuntimeError("wrapped") from exc
    except RuntimeError as wrapped:
        assert metrics.driver_error(wrapped) == ("redis", "ConnectionError")


def test_events_sent_are_counted_once_per_event() -> None:
    pikku, reg = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"mev-{tag}")
    def flow(wf: Any, data: Any) -> Any:
        return [wf.wait_for_event("go") for _ in range(3)]

    with inline(pikku):
        run_id = pikku.start(flow, None)
        pikku.send_event(run_id, "go", {"n": 1})
        pikku.send_event(run_id, "go", {"n": 2}, key="k")
        pikku.send_event(run_id, "go", {"n": 2}, key="k")  # the same send again: not counted
        assert _value(reg, "pikku_events_sent_total") == 2
        assert _value(reg, "pikku_events_taken_total") == 2  # two of the three waits took one
        pikku.send_event(run_id, "go", {"n": 3})
        assert pikku.get_run(run_id).status == "completed"
    assert _value(reg, "pikku_events_taken_total") == 3


def test_a_schedule_tick_reports_its_lag() -> None:
    pikku, reg = _pikku()

    @pikku.workflow("mreport")
    def report(wf: Any, data: Any) -> Any:
        return data

    pikku.schedule("mten", "mreport", every="10m")
    with inline(pikku, hold_timers=True) as kit:
        engine = pikku.engine
        Scheduler(engine).sync()
        tick = engine.store.get_schedule("mten").next_at.timestamp() * 1000
        kit.clock.advance_to(int(tick) + 2500)  # found due 2.5 s after its instant
        Scheduler(engine).fire_due()
    assert _value(reg, "pikku_schedule_lag_seconds_count", schedule="mten") == 1
    lag = _value(reg, "pikku_schedule_lag_seconds_sum", schedule="mten")
    assert 2.5 <= lag < 5.0, lag


def test_runs_queued_and_active_are_read_from_the_store_with_a_cache() -> None:
    pikku, _ = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"mq-{tag}", concurrency=1)
    def limited(wf: Any, data: Any) -> Any:
        return wf.sleep("1h")

    Worker(pikku)
    for _ in range(3):
        pikku.start(limited, None)  # one admitted (running), two queued
    now = [0.0]
    collector = RunsCollector(lambda: pikku.engine, lambda: list(pikku.registry.workflows),
                              cache_s=10, clock=lambda: now[0])
    served = CollectorRegistry()
    served.register(collector)
    assert served.get_sample_value("pikku_runs_queued", {"workflow": f"mq-{tag}"}) == 2
    assert served.get_sample_value("pikku_runs_active", {"workflow": f"mq-{tag}",
                                                         "status": "running"}) == 1
    pikku.start(limited, None)
    assert served.get_sample_value("pikku_runs_queued", {"workflow": f"mq-{tag}"}) == 2
    now[0] = 11.0  # the cache is stale: read again
    assert served.get_sample_value("pikku_runs_queued", {"workflow": f"mq-{tag}"}) == 3


def test_the_default_registry_counts_when_none_is_named() -> None:
    app = Celery(f"metrics-{uuid.uuid4().hex[:8]}", broker="memory://")
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    name = f"mdef-{uuid.uuid4().hex[:6]}"

    @pikku.workflow(name)
    def flow(wf: Any, data: Any) -> Any:
        return data

    pikku.start(flow, 1, inline=True)
    assert prometheus_client.REGISTRY.get_sample_value(
        "pikku_runs_finished_total", {"workflow": name, "status": "completed"}) == 1


def test_a_registry_named_by_its_dotted_path() -> None:
    pikku, _reg = _pikku(registry=f"{__name__}:DOTTED")
    name = f"mdot-{uuid.uuid4().hex[:6]}"

    @pikku.workflow(name)
    def flow(wf: Any, data: Any) -> Any:
        return data

    pikku.start(flow, 1, inline=True)
    assert _value(DOTTED, "pikku_runs_started_total", workflow=name) == 1


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("pikku_metrics_registry", "no.such.module:REG", "cannot import"),
    ("pikku_metrics_registry", 42, "not a prometheus_client CollectorRegistry"),
    ("pikku_metrics_port", "http", "a port number"),
    ("pikku_metrics_port", 70000, "a port number"),
    ("pikku_metrics_port", True, "a port number"),
])
def test_bad_metrics_settings_are_named(setting: str, value: Any, says: str) -> None:
    app = Celery(f"metrics-{uuid.uuid4().hex[:8]}", broker="memory://")
    app.conf[setting] = value
    pikku = PikkuCelery(app, store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    with pytest.raises(PikkuConfigurationError, match=setting) as raised:
        assert pikku.engine is not None  # the settings are read when it is built
    assert says in str(raised.value)


def test_the_worker_serves_its_counts_and_the_store_s_runs_over_http() -> None:
    pikku, _reg = _pikku()
    name = f"mhttp-{uuid.uuid4().hex[:6]}"

    @pikku.workflow(name)
    def flow(wf: Any, data: Any) -> Any:
        return data

    pikku.start(flow, 1, inline=True)
    server = MetricsServer(lambda: pikku, pikku.app)
    port = server.start(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
    assert (f'pikku_runs_finished_total{{status="completed",workflow="{name}"}} 1.0'
            in text), text
    assert f'pikku_runs_active{{status="running",workflow="{name}"}} 0.0' in text
    assert served_registry(pikku) is not None


def test_worker_ready_starts_the_server_only_for_its_app_and_a_set_port() -> None:
    pikku, _ = _pikku(pikku_metrics_port=0, pikku_metrics_addr="127.0.0.1")
    server = MetricsServer(lambda: pikku, pikku.app)

    class Sender:
        app = pikku.app

    class Other:
        app = Celery("other", broker="memory://")

    server.ready(sender=Other())
    assert server.server is None
    server.ready(sender=Sender())
    try:
        assert server.port and server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=5) as reply:
            assert b"pikku_runs_queued" in reply.read()
    finally:
        server.shutdown()
    assert server.server is None


def test_a_send_tried_again_through_an_election_counts_the_error_and_one_event() -> None:
    pikku, reg = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"melect-{tag}")
    def flow(wf: Any, data: Any) -> Any:
        return wf.wait_for_event("go")

    Worker(pikku)
    run_id = pikku.start(flow, None)
    store = pikku.engine.store
    real, failures = store.send_event, [pymongo.errors.AutoReconnect("election")]

    def flaky_send(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    store.send_event = flaky_send  # type: ignore[method-assign]
    pikku.send_event(run_id, "go", 1)
    assert _value(reg, "pikku_service_errors_total", service="mongodb", kind="AutoReconnect",
                  where="events") == 1
    assert _value(reg, "pikku_events_sent_total") == 1


def test_a_failed_ticker_round_counts_a_redis_error() -> None:
    import redis

    from pikku_celery.schedules.ticker import ScheduleTicker

    pikku, reg = _pikku()

    @pikku.workflow("mtickflow")
    def flow(wf: Any, data: Any) -> Any:
        return data

    pikku.schedule("mtick", "mtickflow", every="10m")

    engine = pikku.engine

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ConnectionError("Redis is down")

    engine.store.save_schedule = refuse  # type: ignore[method-assign]
    ticker = ScheduleTicker(lambda: engine)
    assert ticker.step() > 0  # failed: backs off
    assert _value(reg, "pikku_service_errors_total", service="redis", kind="ConnectionError",
                  where="schedules") == 1


def test_without_prometheus_client_nothing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # its import fails
    pikku, _ = _pikku()
    assert metrics.install(pikku) is None
    assert metrics.metrics_for(None) is None


def test_a_pass_ended_by_a_mongodb_error_counts_it_where_it_happened() -> None:
    pikku, reg = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"mpe-{tag}")
    def flow(wf: Any, data: Any) -> None:
        return None

    run_id = pikku.start(flow, None)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise pymongo.errors.AutoReconnect("primary stepped down")

    pikku.engine.store.read_run = refuse  # type: ignore[method-assign]
    with pytest.raises(Exception):  # noqa: B017 - the pass is interrupted, whatever wraps it
        pikku.engine.advance(run_id)
    assert _value(reg, "pikku_service_errors_total", service="mongodb", kind="AutoReconnect",
                  where="pass") == 1
    assert _value(reg, "pikku_pass_duration_seconds_count", workflow="unknown",
                  outcome="error") == 1  # it never read its run
