"""Our own OpenTelemetry spans (Ray's tracing hooks are alpha) and Serve Prometheus metrics.

Each process (router, producer, specialist replicas) calls `setup(exporter, path, endpoint)` once. Spans
are linked across processes by a W3C `traceparent` carrier passed inside the request dicts.
"""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter, SpanExportResult

_lock = threading.Lock()
_configured = False


class JsonLinesExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (easy to grep, easy to test)."""

    def __init__(self, path: str):
        self.path = path

    def export(self, spans):
        with _lock, open(self.path, "a") as f:
            for s in spans:
                ctx, parent = s.get_span_context(), s.parent
                f.write(json.dumps({"name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                                    "parent_id": f"{parent.span_id:016x}" if parent else None,
                                    "start_ns": s.start_time, "end_ns": s.end_time,
                                    "attributes": dict(s.attributes or {})}) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        return None


def setup(exporter: str = "none", path: str | None = None, endpoint: str | None = None, service: str = "scd") -> None:
    global _configured
    with _lock:
        if _configured or exporter == "none":
            _configured = _configured or exporter == "none"
            return
        from opentelemetry.sdk.resources import Resource
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif exporter == "file":
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
        elif exporter == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise RuntimeError("telemetry exporter 'otlp' needs `pip install opentelemetry-exporter-otlp`") from None
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            raise ValueError(f"unknown telemetry exporter {exporter!r}")
        trace.set_tracer_provider(provider)
        _configured = True


def carrier() -> dict:
    """The current span context, to pass to another process."""
    c: dict = {}
    propagate.inject(c)
    return c


@contextmanager
def span(name: str, parent: dict | None = None, **attributes):
    """A span, child of the current one or of a carrier from another process."""
    ctx = propagate.extract(parent) if parent else None
    with trace.get_tracer("scd").start_as_current_span(name, context=ctx, attributes=attributes) as s:
        yield s


def record_phases(timings: dict[str, float], parent: dict | None, **attributes) -> None:
    """One child span per measured phase (durations from our own timers), so a trace shows the breakdown."""
    import time
    now = time.time_ns()
    tracer = trace.get_tracer("scd")
    ctx = propagate.extract(parent) if parent else None
    for phase, ms in timings.items():
        s = tracer.start_span(f"phase.{phase}", context=ctx, start_time=now - int(ms * 1e6),
                              attributes={"phase": phase, "ms": float(ms), **attributes})
        s.end(end_time=now)
