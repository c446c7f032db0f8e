"""OpenTelemetry traces on real ``celery -A`` workers (issue 33, part 1): three worker
processes, each with the SDK and Celery's own instrumentation, writing their spans to files.

Two runs, each started inside a "web request" span of the test process; every step is sent
as a task of its own (so Celery's task spans are there), Redis broker:

* run A: the worker running ``slow`` is SIGKILLed; another runs attempt 2. The killed
  attempt's span is absent, its successor's present, every other attempt has its span, the
  step sent by a pass is the child of Celery's task span, and every span of the run, from
  every process, is in the request's trace;
* run B: the worker running ``slow`` is stalled (SIGSTOP) until another has finished the
  run; woken, its late write is refused, and its span says superseded, not an error.

And on RabbitMQ, steps run in place (the default): two workers run pipelines (a step, a
fan-out of two, a timer, a step failing once), each run one trace across the processes
that ran its passes, every attempt a span under the pass that ran it or Celery's task, and
no worker reads a run from the store to find its context (the messages carry it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pikku_celery.observe import tracing as t
from tests.integration import workerapp as wa
from tests.integration.test_celery_workers import (
    REAPER_S,
    ROOT,
    STEP_LEASE_S,
    TASK_PER_STEP,
    Cluster,
    Worker,
    make_cluster,
    wait_for,
)
from tests.integration.tracingapp import ENV_SPANS, span_line

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def local_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The test process as the web app that starts runs: an SDK of its own."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def _start(c: Cluster, name: str, pool: str = "threads") -> Worker:
    """``Cluster.start`` with ``tests.integration.tracingapp`` (the same app, traced)."""
    name = f"{name}-{uuid.uuid4().hex[:6]}"
    log_path = c.logdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.integration.tracingapp", "worker",
             "-P", pool, "-c", "2", "-Q", c.queue, "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--loglevel", "INFO"],
            cwd=ROOT, env=c.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    worker = Worker(name, pool, proc, log_path)
    c.workers.append(worker)
    return worker


def _worker_spans(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line]


def _of_run(spans: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["attributes"].get(t.RUN_ID) == run_id]


def _attempts(spans: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for s in spans:
        if s["name"].startswith("pikku.step"):
            key = (s["attributes"][t.STEP], s["attributes"][t.ATTEMPT])
            assert key not in found, f"two spans for attempt {key}"
            found[key] = s
    return found


def test_one_trace_per_run_across_workers_killed_and_superseded_attempts(
        make_cluster: Callable[..., Cluster], local_spans: InMemorySpanExporter,
        tmp_path: Path) -> None:
    span_dir = tmp_path / "spans"
    span_dir.mkdir()
    c = make_cluster("redis", **TASK_PER_STEP, **{ENV_SPANS: str(span_dir)})
    workers = [_start(c, f"w{i}") for i in range(3)]
    c.wait_ready(*workers)
    tracer = trace.get_tracer("the-web-app")
    requests: dict[str, Any] = {}

    def start(seconds: float) -> str:
        with tracer.start_as_current_span("POST /orders") as request:
            run_id = c.pikku.start("one_slow", {"seconds": seconds, "ledger": c.ledger_key})
        requests[run_id] = request.get_span_context()
        return run_id

    # --- run A: the worker running its slow step is killed ------------------------------
    run_a = start(2.0)
    first = wait_for(lambda: [s for s in c.starts() if s["attempt"] == 1], 20,
                     "the slow step to start", c.diagnostics)[0]
    doomed = c.holder_of(first["pid"])
    doomed.kill()
    wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
             STEP_LEASE_S + REAPER_S + 10, "attempt 2 of the killed step", c.diagnostics)
    assert c.wait(run_a, 20).status == "completed"

    # --- run B: the worker running its slow step stalls, another finishes the run -------
    c.ledger_client.delete(c.ledger_key)
    run_b = start(2.5)
    first_b = wait_for(lambda: [s for s in c.starts() if s["attempt"] == 1], 20,
                       "run B's slow step to start", c.diagnostics)[0]
    stalled = c.holder_of(first_b["pid"])
    stalled.signal_group(signal.SIGSTOP)
    try:
        wait_for(lambda: [s for s in c.starts() if s["attempt"] == 2],
                 STEP_LEASE_S + REAPER_S + 10, "the other worker to reclaim", c.diagnostics)
        assert c.wait(run_b, 20).status == "completed"
    finally:
        stalled.signal_group(signal.SIGCONT)

    def superseded_span() -> dict[str, Any] | None:
        spans = _attempts(_of_run(_worker_spans(span_dir), run_b))
        return spans.get(("slow", 1))
    late = wait_for(superseded_span, 15, "the stalled attempt's span", c.diagnostics)

    # --- what the spans say --------------------------------------------------------------
    local = [span_line(s) for s in local_spans.get_finished_spans()]
    every = _worker_spans(span_dir) + local
    by_id = {s["span_id"]: s for s in every}
    for run_id in (run_a, run_b):
        ours = _of_run(every, run_id)
        trace_id = f"{requests[run_id].trace_id:032x}"
        assert {s["trace_id"] for s in ours} == {trace_id}, "one trace per run"
        (start_span,) = [s for s in ours if s["name"] == "pikku.start one_slow"]
        assert start_span["parent_id"] == f"{requests[run_id].span_id:016x}"
        (run_span,) = [s for s in ours if s["name"] == "pikku.run one_slow"]
        assert run_span["attributes"][t.STATUS] == "completed"
        assert run_span["parent_id"] == start_span["span_id"]
        assert any(s["name"].startswith("pikku.pass") for s in ours)
        assert len({s["pid"] for s in ours}) >= 2, "spans from the starter and a worker"
        attempts = _attempts(ours)
        history = {(h.step_name, h.attempt): h for h in c.pikku.get_history(run_id)}
        assert set(history) == {("slow", 1), ("slow", 2), ("after", 1)}
        for key, span in attempts.items():
            assert span["attributes"][t.IN_PLACE] is False  # every step sent (TASK_PER_STEP)
            assert span["attributes"][t.TASK_ID] == history[key].task_id
        # The step a pass sent is the child of Celery's own task span, in the run's trace.
        celery_span = by_id[attempts[("after", 1)]["parent_id"]]
        assert celery_span["name"] == "run/it.add" and celery_span["trace_id"] == trace_id
        assert attempts[("slow", 2)]["attributes"][t.OUTCOME] == "succeeded"

    killed = _attempts(_of_run(every, run_a))
    assert set(killed) == {("slow", 2), ("after", 1)}, "the killed attempt has no span"
    assert not any(s["pid"] == first["pid"] and s["name"].startswith("pikku.step")
                   for s in every)
    marked = late["attributes"]
    assert (marked[t.SUPERSEDED], marked[t.OUTCOME]) == (True, "superseded")
    assert (marked[t.LEASE_LOST], marked[t.CURRENT_ATTEMPT]) == (True, 2)
    assert late["status"] != "ERROR" and late["pid"] == first_b["pid"]
    assert set(_attempts(_of_run(every, run_b))) == {("slow", 1), ("slow", 2), ("after", 1)}


def test_on_rabbitmq_steps_run_in_place_are_one_trace_per_run(
        make_cluster: Callable[..., Cluster], local_spans: InMemorySpanExporter,
        tmp_path: Path) -> None:
    span_dir = tmp_path / "spans"
    span_dir.mkdir()
    # The reaper kept out of the way: a message it sends from a process that never saw the
    # run carries no context (documented), and at 0.3 s it races the retry's own timer (its
    # first sweep comes one interval after the worker's start).
    c = make_cluster("rabbitmq", **{ENV_SPANS: str(span_dir), wa.ENV_REAPER: "3600",
                                    wa.ENV_UNDISPATCHED: "120", wa.ENV_STALLED: "120"})
    workers = [_start(c, "r1", "prefork"), _start(c, "r2")]
    c.wait_ready(*workers)
    run_ids = [c.pikku.start("pipeline", {"a": i, "b": 1, "fail": 1}) for i in range(4)]
    for run_id in run_ids:
        assert c.wait(run_id, 30).status == "completed"

    def all_run_spans() -> list[dict[str, Any]] | None:
        every = _worker_spans(span_dir)
        every += [span_line(s) for s in local_spans.get_finished_spans()]
        ended = {s["attributes"].get(t.RUN_ID) for s in every
                 if s["name"] == "pikku.run pipeline"}
        # A run's span ends inside its last pass, whose own span is written once that pass
        # has handed the run back: wait for the parents of every attempt's span too.
        parents = {s["parent_id"] for run_id in run_ids
                   for s in _attempts(_of_run(every, run_id)).values()}
        found = {s["span_id"] for s in every}
        return every if ended >= set(run_ids) and parents <= found else None
    every = wait_for(all_run_spans, 15, "every run's run span and its passes' spans",
                     c.diagnostics)
    by_id = {s["span_id"]: s for s in every}
    in_place = 0
    for run_id in run_ids:
        ours = _of_run(every, run_id)
        (start_span,) = [s for s in ours if s["name"] == "pikku.start pipeline"]
        assert {s["trace_id"] for s in ours} == {start_span["trace_id"]}, "one trace per run"
        history = {(h.step_name, h.attempt): h for h in c.pikku.get_history(run_id)
                   if h.step_name != "nap"}  # the timer: recorded, but it runs no body
        attempts = _attempts(ours)
        assert set(attempts) == set(history), "every attempt has its span, and only those"
        assert ("flaky", 2) in attempts  # the failed attempt and its retry, each a span
        assert attempts[("flaky", 1)]["status"] == "ERROR"
        for key, span in attempts.items():
            assert span["attributes"][t.TASK_ID] == history[key].task_id
            parent = by_id[span["parent_id"]]
            assert parent["trace_id"] == start_span["trace_id"]
            if span["attributes"][t.IN_PLACE]:
                in_place += 1
                assert parent["name"] == "pikku.pass pipeline" and parent["pid"] == span["pid"]
    assert in_place >= len(run_ids), "steps ran in place, inside their passes' spans"
    # pikku's messages carried each run's context: no worker read a run to find it.
    by_pid = {path.stem: path.read_text().split() for path in span_dir.glob("*.reads")}
    reads = [line for lines in by_pid.values() for line in lines]
    assert not set(reads) & set(run_ids), (by_pid, c.diagnostics())
