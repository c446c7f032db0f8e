"""How a benchmark process observes (``BENCH_OBSERVE``, ``benchmarks.obsapp``):

``off``      tracing and metrics off: what a user without prometheus-client and
             OpenTelemetry gets (the log lines, the error reports and the task events, which
             need no library, stay, as Celery's own do for the chains);
``metrics``  Prometheus metrics (prometheus-client's default registry), no tracing;
``on``       metrics and OpenTelemetry traces, the SDK configured as production does (a
             ``BatchSpanProcessor``) with an exporter that drops the spans, so what is
             measured is pikku's side of tracing, not a collector's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pikku_celery import observe


def configure(mode: str) -> None:
    """Set this process up for ``mode`` (before its first engine is built)."""
    if mode == "off":
        observe.PARTS = tuple(p for p in observe.PARTS if p not in ("tracing", "metrics"))
    elif mode == "on":
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Dropping(SpanExporter):
            exported = 0

            def export(self, spans: Sequence[Any]) -> SpanExportResult:
                Dropping.exported += len(spans)
                return SpanExportResult.SUCCESS

        sdk_provider().add_span_processor(BatchSpanProcessor(Dropping()))
    elif mode != "metrics":
        raise ValueError(f"BENCH_OBSERVE={mode!r}: off, metrics or on")


def sdk_provider() -> Any:
    """The process's OpenTelemetry SDK tracer provider, set now if none is (the global
    provider can be set once per process: later measurements add their processors)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    return provider
