"""OpenTelemetry traces with GenAI semantic-convention attribute names; off unless an exporter is configured.

Attributes carry names, counts and timings only — never prompt text or keys.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter


def build_tracer(exporter: str, service_name: str, span_exporter: SpanExporter | None = None) -> tuple[Any, TracerProvider | None]:
    """(tracer, provider). `span_exporter` overrides the configured exporter (tests use an in-memory one)."""
    if exporter == "none" and span_exporter is None:
        return trace.NoOpTracer(), None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if span_exporter is None:
        if exporter == "console":
            span_exporter = ConsoleSpanExporter()
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as e:  # pragma: no cover - depends on an optional package
                raise RuntimeError("tracing_exporter 'otlp' needs opentelemetry-exporter-otlp-proto-http") from e
            span_exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return provider.get_tracer("gateway"), provider
