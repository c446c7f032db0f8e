"""The example app, watched: what ``docs/guide/observability.md``'s pictures were taken from
(``python tools/observability_pictures.py``).

``celery -A example_project.observed worker -E`` runs the same workflows as
``example_project`` with the OpenTelemetry SDK configured (spans written as JSON lines to
``PIKKU_SPANS_FILE``) and pikku's Prometheus metrics served on ``PIKKU_METRICS_PORT``. pikku
itself needs none of this: it uses the global tracer provider and the default registry, and
an app configures the SDK and the port as here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from example_project import orders  # noqa: F401 - registers the workflows
from example_project.celery_app import app, pikku


class JsonLinesExporter(SpanExporter):
    """Each finished span as one JSON line (the SDK's own JSON), appended to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as file:
            for span in spans:
                file.write(json.dumps(json.loads(span.to_json())) + "\n")
        return SpanExportResult.SUCCESS


if os.environ.get("PIKKU_SPANS_FILE"):
    provider = TracerProvider(resource=Resource.create(
        {"service.name": f"example-worker-{os.getpid()}"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(
        os.environ["PIKKU_SPANS_FILE"])))
    trace.set_tracer_provider(provider)

if os.environ.get("PIKKU_METRICS_PORT"):
    app.conf.pikku_metrics_port = int(os.environ["PIKKU_METRICS_PORT"])

__all__ = ["app", "pikku"]
