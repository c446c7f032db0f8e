"""``tests.integration.workerapp`` with OpenTelemetry configured as an application would:
the SDK's tracer provider as the global one, Celery instrumented
(``opentelemetry-instrumentation-celery``), and every finished span written at once, as a
JSON line, to ``$PIKKU_IT_SPANS/<pid>.jsonl`` (a worker killed with SIGKILL keeps what it
wrote: a span still open then never appears, as with any exporter)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from tests.integration import workerapp

ENV_SPANS = "PIKKU_IT_SPANS"


def span_line(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    return {
        "pid": os.getpid(),
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [f"{link.context.trace_id:032x}-{link.context.span_id:016x}"
                  for link in span.links],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "start": span.start_time,
        "end": span.end_time,
    }


class JsonLinesExporter(SpanExporter):
    """Each span as one line of this process's file, flushed as it is written."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_line(s), default=str) + "\n" for s in spans)
        with self._lock, open(os.path.join(self._directory, f"{os.getpid()}.jsonl"),
                              "a", encoding="utf-8") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS


def _count_reads() -> None:
    """Each store read the tracing observer makes for a run's context, as a line of
    ``$PIKKU_IT_SPANS/<pid>.reads`` (the messages should carry the context instead)."""
    from pikku_celery.observe import tracing

    original = tracing._RunContexts.__init__

    def init(self: Any, read_run: Any) -> None:
        def counted(run_id: str) -> Any:
            with open(os.path.join(os.environ[ENV_SPANS], f"{os.getpid()}.reads"), "a",
                      encoding="utf-8") as out:
                out.write(run_id + "\n")
            return read_run(run_id)

        original(self, counted)

    tracing._RunContexts.__init__ = init  # type: ignore[method-assign]


def _configure() -> None:
    _count_reads()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ[ENV_SPANS])))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)


_configured: list[bool] = []


def __getattr__(name: str) -> Any:
    # ``celery -A`` reads ``app``: the worker configures its SDK then (a plain import by
    # the test process configures nothing).
    if name in ("app", "celery") and not _configured:
        _configure()
        _configured.append(True)
    return getattr(workerapp, name)
