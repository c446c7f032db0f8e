"""OpenTelemetry traces (issue 33, part 1), on the SDK's in-memory exporter: one trace per
run, a span per pass and per step attempt nested as they ran, the attributes a query needs,
a failed attempt an error with its exception, a superseded one marked and not an error, a
run started inside a span a child of it; nothing at all when no SDK is configured."""

from __future__ import annotations

import contextvars
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pikku_celery import InMemoryLeaseService, InMemoryWorkflowStore, PikkuCelery
from pikku_celery.engine import protocols
from pikku_celery.model.errors import WorkflowStepSupersededError
from pikku_celery.observe import tracing
from pikku_celery.testing import inline
from tests.unit.test_in_place import Worker


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK as an application configures it (the global tracer provider), for this test
    only: the API's global is put back after, so no other test traces."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def _pikku() -> tuple[PikkuCelery, Worker]:
    pikku = PikkuCelery(Celery(f"tr-{uuid.uuid4().hex[:8]}", broker="memory://"),
                        store=InMemoryWorkflowStore(), leases=InMemoryLeaseService(),
                        worker_reaper=False)
    return pikku, Worker(pikku)


def _by_name(finished: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name.startswith(prefix)]


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_run_in_place_is_one_trace_under_the_span_it_was_started_in(
        spans: InMemorySpanExporter) -> None:
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    tracer = trace.get_tracer("the-app")

    @pikku.step(name=f"tr{tag}.inc")
    def inc(n: int) -> int:
        with tracer.start_as_current_span("user call"):  # the body's own instrumentation
            return n + 1

    @pikku.workflow(f"tr-{tag}")
    def flow(wf: Any, n: int) -> int:
        return int(wf.do("a", inc, n)) + int(wf.do("b", inc, n))

    with tracer.start_as_current_span("web request") as request:
        run_id = pikku.start(flow, 1)
    worker.drain()
    assert pikku.get_run(run_id).output == 4

    finished = spans.get_finished_spans()
    assert {s.context.trace_id for s in finished} == {request.get_span_context().trace_id}
    (start,) = _by_name(finished, "pikku.start")
    assert start.name == f"pikku.start tr-{tag}"
    assert _parent(start) == request.get_span_context().span_id
    assert start.attributes[tracing.RUN_ID] == run_id
    assert pikku.get_run(run_id).trace["traceparent"].split("-")[2] == (
        f"{start.context.span_id:016x}")  # the context saved with the run: the start span

    passes = _by_name(finished, "pikku.pass")
    assert passes and all(_parent(p) == start.context.span_id for p in passes)
    assert all(p.name == f"pikku.pass tr-{tag}" for p in passes)
    assert passes[-1].attributes[tracing.OUTCOME] == "ended"
    attempts = _by_name(finished, "pikku.step")
    assert [a.attributes[tracing.STEP] for a in attempts] == ["a", "b"]
    assert attempts[0].attributes[tracing.IN_PLACE] is True
    for attempt in attempts:
        assert attempt.name == f"pikku.step tr{tag}.inc"
        if attempt.attributes[tracing.IN_PLACE]:  # a child of the pass that ran it
            assert _parent(attempt) in {p.context.span_id for p in passes}
        else:  # sent: hung on the run's saved context (nothing else current)
            assert _parent(attempt) == start.context.span_id
        assert dict(attempt.attributes) | {tracing.TASK_ID: ""} == {
            tracing.RUN_ID: run_id, tracing.WORKFLOW: f"tr-{tag}", tracing.STEP:
            attempt.attributes[tracing.STEP], tracing.FUNCTION: f"tr{tag}.inc",
            tracing.ATTEMPT: 1, tracing.MAX_ATTEMPTS: 4,  # 3 retries, for lost workers only
            tracing.IN_PLACE: attempt.attributes[tracing.IN_PLACE],
            tracing.SUPERSEDED: False, tracing.LEASE_LOST: False,
            tracing.OUTCOME: "succeeded", tracing.TASK_ID: "",
            tracing.WORKER: attempt.attributes[tracing.WORKER]}
        assert attempt.status.status_code == StatusCode.UNSET
    user_calls = _by_name(finished, "user call")
    assert [_parent(u) for u in user_calls] == [a.context.span_id for a in attempts]

    (run,) = _by_name(finished, "pikku.run")
    assert _parent(run) == start.context.span_id
    assert run.attributes[tracing.STATUS] == "completed"
    created_ns = pikku.get_run(run_id).created_at.timestamp() * 1e9
    assert abs(run.start_time - created_ns) < 50e6  # from the run's creation...
    assert run.end_time >= max(s.end_time for s in attempts)  # ...to its end


def test_a_sent_step_hangs_on_the_runs_saved_context_in_a_fresh_process(
        spans: InMemorySpanExporter) -> None:
    """A worker that did not start the run (nothing current, nothing remembered) reads the
    run's saved context: its pass and the step it sends are in the run's trace."""
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"trs{tag}.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow(f"trs-{tag}")
    def flow(wf: Any, data: Any) -> list[int]:
        return wf.gather(wf.call("a", one), wf.call("b", one))

    run_id = pikku.start(flow, None)
    observers = pikku.engine.emit._observers  # type: ignore[attr-defined]
    (observer,) = [o for o in observers if isinstance(o, tracing.Tracing)]
    observer._runs = tracing._RunContexts(pikku.engine.store.get_run)  # forget the start
    worker.drain()
    assert pikku.get_run(run_id).status == "completed"
    finished = spans.get_finished_spans()
    (start,) = _by_name(finished, "pikku.start")
    assert {s.context.trace_id for s in finished} == {start.context.trace_id}
    sent = [a for a in _by_name(finished, "pikku.step")
            if not a.attributes[tracing.IN_PLACE]]
    assert sent, [dict(a.attributes) for a in _by_name(finished, "pikku.step")]
    assert all(_parent(a) == start.context.span_id for a in sent)


def test_a_failed_attempt_is_an_error_with_its_exception_and_its_retry_a_span(
        spans: InMemorySpanExporter) -> None:
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    calls: list[int] = []

    @pikku.step(name=f"trf{tag}.flaky", retries=1, retry_delay=0)
    def flaky(data: Any) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("card declined")
        return "ok"

    @pikku.workflow(f"trf-{tag}")
    def flow(wf: Any, data: Any) -> str:
        return str(wf.do("charge", flaky, data))

    run_id = pikku.start(flow, None)
    worker.drain()
    assert pikku.get_run(run_id).status == "completed", pikku.get_run(run_id).error
    attempts = _by_name(spans.get_finished_spans(), "pikku.step")
    assert [(a.attributes[tracing.ATTEMPT], a.attributes[tracing.OUTCOME]) for a in attempts
            ] == [(1, "failed"), (2, "succeeded")]
    failed = attempts[0]
    assert failed.status.status_code == StatusCode.ERROR
    assert "ValueError: card declined" in (failed.status.description or "")
    (event,) = [e for e in failed.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "card declined"


def test_a_superseded_attempt_says_so_and_is_not_an_error(
        spans: InMemorySpanExporter) -> None:
    """The run is cancelled while a sent step's body runs: the attempt's settle is refused."""
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    worker.runs_here = lambda *args: False  # type: ignore[method-assign]  # sent, not in place

    @pikku.step(name=f"trx{tag}.slow")
    def slow(run_id: str) -> int:
        pikku.cancel(run_id, "operator")
        return 1

    @pikku.workflow(f"trx-{tag}")
    def flow(wf: Any, run_id: str) -> int:
        return int(wf.do("a", slow, run_id))

    run_id = str(uuid.uuid4())
    pikku.start(flow, run_id, run_id=run_id)
    with pytest.raises(WorkflowStepSupersededError):
        worker.drain()
    (attempt,) = _by_name(spans.get_finished_spans(), "pikku.step")
    assert attempt.attributes[tracing.SUPERSEDED] is True
    assert attempt.attributes[tracing.OUTCOME] == "superseded"
    assert attempt.attributes[tracing.IN_PLACE] is False
    assert attempt.attributes[tracing.LEASE_LOST] is False  # fenced by the cancel, not lost
    assert attempt.status.status_code != StatusCode.ERROR
    (run,) = _by_name(spans.get_finished_spans(), "pikku.run")
    assert run.attributes[tracing.STATUS] == "cancelled"


def test_the_inline_kit_traces_and_a_child_run_is_in_its_parents_trace(
        spans: InMemorySpanExporter) -> None:
    pikku, _ = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"tri{tag}.one")
    def one(data: Any) -> int:
        return 1

    @pikku.workflow(f"tri-child-{tag}")
    def child(wf: Any, data: Any) -> int:
        return int(wf.do("a", one, data))

    @pikku.workflow(f"tri-{tag}")
    def parent(wf: Any, data: Any) -> int:
        return int(wf.child("kid", child, data)) + 1

    with inline(pikku):
        run_id = pikku.start(parent, None)
        assert pikku.get_run(run_id).output == 2
    finished = spans.get_finished_spans()
    starts = _by_name(finished, "pikku.start")
    assert sorted(s.name for s in starts) == sorted([f"pikku.start tri-{tag}",
                                                     f"pikku.start tri-child-{tag}"])
    assert len({s.context.trace_id for s in finished}) == 1  # one trace, child run included
    (child_start,) = [s for s in starts if "child" in s.name]
    assert child_start.attributes[tracing.PARENT_RUN_ID] == run_id
    assert len(_by_name(finished, "pikku.run")) == 2


def test_a_pass_that_lost_nothing_and_a_busy_pass_are_marked(
        spans: InMemorySpanExporter) -> None:
    pikku, _ = _pikku()
    tag = uuid.uuid4().hex[:6]

    @pikku.workflow(f"trb-{tag}")
    def flow(wf: Any, data: Any) -> None:
        return None

    from pikku_celery.model import keys
    run_id = pikku.start(flow, None)
    assert pikku.engine.leases.acquire(keys.run_lease_key(run_id), "other", 60_000)
    with pytest.raises(Exception):  # noqa: B017 - LeaseTakenError, whatever wraps it
        pikku.engine.advance(run_id)
    (busy,) = _by_name(spans.get_finished_spans(), "pikku.pass")
    assert busy.attributes[tracing.OUTCOME] == "busy"
    assert busy.attributes[tracing.LEASE_LOST] is False
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached


def test_nothing_is_traced_or_saved_without_an_sdk() -> None:
    """The API installed, no SDK configured (the API's proxy provider): no span, no context
    saved with the run, and the start's hook returns at once."""
    pikku, worker = _pikku()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)

    @pikku.workflow(f"trn-{uuid.uuid4().hex[:6]}")
    def flow(wf: Any, data: Any) -> None:
        return None

    run_id = pikku.start(flow, None)
    worker.drain()
    assert pikku.get_run(run_id).trace is None
    assert protocols.trace_context("r", "w") is None


def test_without_opentelemetry_installed_nothing_is_installed() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry"] = None  # as if not installed
        from pikku_celery.observe import tracing
        from pikku_celery.engine import protocols
        assert tracing.install(object()) is None
        assert protocols.trace_context is protocols.no_trace_context
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_pass_inside_a_span_of_another_trace_stays_in_the_runs_trace_linked_to_it(
        spans: InMemorySpanExporter) -> None:
    """Celery's task span for a message the reaper sent (no context: a trace of its own) is
    current: the pass is still the run's, and links to that span."""
    pikku, worker = _pikku()

    @pikku.workflow(f"trl-{uuid.uuid4().hex[:6]}")
    def flow(wf: Any, data: Any) -> None:
        return None

    run_id = pikku.start(flow, None)
    with trace.get_tracer("celery-ish").start_as_current_span("run/orchestrate") as task:
        worker.drain()
    assert pikku.get_run(run_id).status == "completed"
    finished = spans.get_finished_spans()
    (start,) = _by_name(finished, "pikku.start")
    (pass_span,) = _by_name(finished, "pikku.pass")
    assert pass_span.context.trace_id == start.context.trace_id
    assert _parent(pass_span) == start.context.span_id
    assert [link.context.span_id for link in pass_span.links] == [
        task.get_span_context().span_id]


def test_a_retried_run_goes_on_in_its_first_trace(spans: InMemorySpanExporter) -> None:
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    fail = [True]

    @pikku.step(name=f"trr{tag}.once", retries=0)
    def once(data: Any) -> int:
        if fail[0]:
            raise RuntimeError("first time")
        return 1

    @pikku.workflow(f"trr-{tag}")
    def flow(wf: Any, data: Any) -> int:
        return int(wf.do("a", once, data))

    run_id = pikku.start(flow, None)
    worker.drain()
    assert pikku.get_run(run_id).status == "failed"
    fail[0] = False
    assert pikku.retry(run_id)
    worker.drain()
    assert pikku.get_run(run_id).status == "completed"
    finished = spans.get_finished_spans()
    assert len({s.context.trace_id for s in finished}) == 1
    assert [r.attributes[tracing.STATUS] for r in _by_name(finished, "pikku.run")] == [
        "failed", "completed"]
    assert _by_name(finished, "pikku.run")[0].status.status_code == StatusCode.ERROR


def test_a_failing_trace_hook_never_stops_a_start(
        spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pikku, _ = _pikku()

    def broken(run_id: str, workflow: str) -> dict[str, str]:
        return {"traceparent": "not a traceparent"}

    monkeypatch.setattr(protocols, "trace_context", broken)

    @pikku.workflow(f"trh-{uuid.uuid4().hex[:6]}")
    def flow(wf: Any, data: Any) -> None:
        return None

    # An in-process Celery worker earlier in this process may have left the root logger at
    # ERROR (celery.contrib.testing sets it): ask for the warnings of pikku's logger here.
    with caplog.at_level(logging.WARNING, logger="pikku_celery"):
        run_id = pikku.start(flow, None)
    assert pikku.get_run(run_id).trace is None
    assert any("no trace context saved" in r.getMessage() for r in caplog.records)


class _TimeLimit(BaseException):
    """Not an ``Exception``, as Celery's time limits and ``SystemExit``: the attempt's end is
    never reported (its lease lapses, the reaper takes the step back)."""


def test_an_attempt_whose_end_is_never_reported_is_ended_abandoned_by_the_next(
        spans: InMemorySpanExporter) -> None:
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    worker.runs_here = lambda *args: False  # type: ignore[method-assign]  # sent tasks

    @pikku.step(name=f"tra{tag}.step")
    def step(data: str) -> str:
        if data == "limit":
            raise _TimeLimit()
        return data

    @pikku.workflow(f"tra-{tag}")
    def flow(wf: Any, data: str) -> str:
        return str(wf.do("a", step, data))

    doomed = pikku.start(flow, "limit")
    with pytest.raises(_TimeLimit):
        worker.drain()
    assert not _by_name(spans.get_finished_spans(), "pikku.step")  # still open
    worker.queue.clear()
    fine = pikku.start(flow, "fine")
    worker.drain()
    assert pikku.get_run(fine).status == "completed"
    attempts = {s.attributes[tracing.RUN_ID]: s
                for s in _by_name(spans.get_finished_spans(), "pikku.step")}
    assert attempts[doomed].attributes[tracing.OUTCOME] == tracing.ABANDONED
    assert attempts[fine].attributes[tracing.OUTCOME] == "succeeded"
    # The next attempt is not nested in the abandoned one, and nothing stays attached.
    assert attempts[fine].parent is None or (
        attempts[fine].parent.span_id != attempts[doomed].context.span_id)
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_steps_run_in_place_detach_cleanly_and_nest_under_their_pass(
        spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    """The engine runs each step in place inside a copied ``contextvars.Context`` and writes
    the last one's settle from the pass's own: an attempt's context attached in the copy is
    never detached from the pass's Context (OpenTelemetry logged "Failed to detach context"
    for it), and the nesting stays: each step a child of its pass, the body's spans children
    of their step, nothing left attached after."""
    pikku, worker = _pikku()
    tag = uuid.uuid4().hex[:6]
    tracer = trace.get_tracer("the-app")

    @pikku.step(name=f"trp{tag}.inc")
    def inc(n: int) -> int:
        with tracer.start_as_current_span("user call"):
            return n + 1

    @pikku.workflow(f"trp-{tag}")
    def flow(wf: Any, n: int) -> int:
        return sum(int(wf.do(name, inc, n)) for name in ("a", "b", "c"))

    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    run_id = pikku.start(flow, 1)
    worker.drain()
    assert pikku.get_run(run_id).output == 6
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")
            and r.levelno >= logging.WARNING] == []
    finished = spans.get_finished_spans()
    attempts = _by_name(finished, "pikku.step")
    assert [(a.attributes[tracing.STEP], a.attributes[tracing.IN_PLACE]) for a in attempts] == [
        ("a", True), ("b", True), ("c", True)]
    (pass_span,) = _by_name(finished, "pikku.pass")
    assert [_parent(a) for a in attempts] == [pass_span.context.span_id] * 3
    assert [_parent(u) for u in _by_name(finished, "user call")] == [
        a.context.span_id for a in attempts]
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_an_attempt_ended_outside_the_context_it_ran_in_is_undone_there_later(
        spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    """The events as the engine reports them when a step run in place is settled alone from
    the pass's Context and the pass then runs another step in the same copy: no detach
    error, the next step is still the pass's child (not the ended step's), the first
    step's attachment is undone in the copy, and the pass's Context is clean after."""
    pikku, _ = _pikku()
    observer = tracing.Tracing(pikku)
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    tracer = trace.get_tracer("the-app")
    run = {"run_id": f"r-{uuid.uuid4().hex[:8]}", "workflow": "wf"}

    def step(name: str) -> dict[str, Any]:
        return {**run, "step_name": name, "attempt": 1, "max_attempts": 1,
                "function": "f", "in_place": True}

    observer("pass_started", "pass", {**run, "mark": "*"})
    copy = contextvars.copy_context()  # as InPlace does, once the pass has begun
    seen: list[Any] = []

    def body(name: str) -> None:
        observer("step_attempt_started", "f", step(name))
        with tracer.start_as_current_span(f"user {name}"):
            pass
        seen.append(trace.get_current_span())

    copy.run(body, "a")
    observer("step_attempt_finished", "f", {**step("a"), "status": "succeeded"})  # outside
    copy.run(body, "b")
    copy.run(observer, "step_attempt_finished", "f", {**step("b"), "status": "succeeded"})
    assert copy.run(trace.get_current_span).name == "pikku.pass wf"  # "a" undone there
    observer("pass_finished", "pass", {**run, "outcome": "ended"})

    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")
            and r.levelno >= logging.WARNING] == []
    finished = spans.get_finished_spans()
    (pass_span,) = _by_name(finished, "pikku.pass")
    a, b = _by_name(finished, "pikku.step")
    assert [_parent(a), _parent(b)] == [pass_span.context.span_id] * 2
    assert [_parent(u) for u in _by_name(finished, "user")] == [a.context.span_id,
                                                                 b.context.span_id]
    assert [s.name for s in seen] == ["pikku.step f", "pikku.step f"]
    assert trace.get_current_span() is trace.INVALID_SPAN
    left = tracing._local.stack + tracing._local.stale
    assert [f.key for f in left if f.key[1] == run["run_id"]] == []  # nothing kept


def test_a_sent_step_whose_settle_goes_with_the_next_pass_ends_when_it_lands(
        spans: InMemorySpanExporter) -> None:
    """Issue 34 item 1: a step sent as its own task hands its settle to the pass after it.
    Its span still ends with its outcome (not abandoned when that pass begins), and the pass
    is not its child: the trace is shaped as when the settle came first."""
    pikku, worker = _pikku()
    pikku.engine.settings = type(pikku.engine.settings)(
        **{**vars(pikku.engine.settings), "in_place_steps": 0})
    tag = uuid.uuid4().hex[:6]

    @pikku.step(name=f"trh{tag}.inc")
    def inc(n: int) -> int:
        return n + 1

    @pikku.workflow(f"trh-{tag}")
    def flow(wf: Any, n: int) -> int:
        return int(wf.do("b", inc, wf.do("a", inc, n)))

    run_id = pikku.start(flow, 0)
    worker.drain()
    assert pikku.get_run(run_id).output == 2
    finished = spans.get_finished_spans()
    attempts = _by_name(finished, "pikku.step")
    assert [(a.attributes[tracing.STEP], a.attributes[tracing.OUTCOME], a.attributes[
        tracing.IN_PLACE]) for a in attempts] == [("a", "succeeded", False),
                                                  ("b", "succeeded", False)]
    attempt_ids = {a.context.span_id for a in attempts}
    passes = _by_name(finished, "pikku.pass")
    assert len(passes) == 3  # the start's, then one after each step
    assert not {_parent(p) for p in passes} & attempt_ids
    assert all(p.attributes[tracing.OUTCOME] != tracing.ABANDONED for p in passes)
