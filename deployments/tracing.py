"""Per-request traces with OpenTelemetry: one trace per request, across the door, the router and the
workers. Off by default, and then nothing here touches OpenTelemetry: every helper returns at its
first line (`_tracer is None`), and no carrier travels with a request.

    door (http_app)   request ─┬─ door.parse ── door.prepare (tokenize, template, sampling, constraint checks)
                               ├─ router.queue (prefill | decode) ── router.place (worker, reason)
                               ├─ prefill (worker) ─┬─ prefill.chunk (one per engine step it was in)
                               │                    └─ first_token
                               ├─ decode.admission (worker) ── kv.transfer (bytes, transport, GB/s)
                               ├─ resume (worker: a prompt run whole; a moved sequence: `offset` > 0)
                               ├─ decode (worker: joined the batch -> finished)
                               └─ finish (door: reason, tokens)

The door starts the trace (as a child of the client's W3C `traceparent`, when it sent one) and puts
its context in a contextvar; the backend copies it into the request (`GenRequest.trace`, a W3C carrier
dict) and every process that handles the request makes its spans children of it. Each process
configures its own exporter from the same settings (`configure`): OTLP over HTTP to
`otlp_endpoint`, and/or `trace_exporter` = `console` or `file:PATH` (JSON lines, one file per process:
`PATH.<pid>`) for development.
Timestamps are each process's wall clock: on several hosts, spans are as aligned as their clocks.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

logger = logging.getLogger(__name__)

_tracer: Any = None  # an OpenTelemetry tracer while tracing is on in this process
_provider: Any = None
_lock = threading.Lock()


def enabled() -> bool:
    return _tracer is not None


def configure(otlp_endpoint: str | None, trace_exporter: str | None, service: str) -> bool:
    """Turn tracing on in this process when either setting asks (idempotent: the first call wins).
    Returns whether tracing is on."""
    global _tracer, _provider
    if not otlp_endpoint and not trace_exporter:
        return enabled()
    with _lock:
        if _tracer is not None:
            return True
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if otlp_endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise RuntimeError("otlp_endpoint needs the OTLP exporter: pip install 'pdserve[otel]' "
                                   "(opentelemetry-exporter-otlp-proto-http)") from None
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        if trace_exporter == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        elif trace_exporter:
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_exporter.removeprefix("file:"))))
        _provider, _tracer = provider, provider.get_tracer("pdserve")
    return True


def check_exporter(value: str | None) -> None:
    """`trace_exporter`'s values: None, "console" or "file:PATH"."""
    if value is not None and value != "console" and not (value.startswith("file:") and len(value) > 5):
        raise ValueError(f"trace_exporter must be 'console' or 'file:PATH', got {value!r}")


def use_provider(provider: Any) -> None:
    """Trace into `provider` (tests: an SDK TracerProvider with an in-memory exporter); None: off."""
    global _tracer, _provider
    _provider, _tracer = provider, None if provider is None else provider.get_tracer("pdserve")


def flush(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


class JsonLinesExporter:
    """A span exporter writing one JSON object per line to `PATH.<pid>` (development and tests)."""

    def __init__(self, path: str):
        self.path = f"{path}.{os.getpid()}"
        self._lock = threading.Lock()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_dict(s)) for s in spans]
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_dict(s: Any) -> dict[str, Any]:
    """A finished SDK span as a small JSON-able dict (ids in hex)."""
    return {"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
            "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
            "start_ns": s.start_time, "end_ns": s.end_time, "service": s.resource.attributes.get("service.name"),
            "attributes": dict(s.attributes or {})}


# ---------------------------------------------------------------------- contexts and carriers
def _context(parent: Any) -> Any:
    """An OpenTelemetry context from a carrier dict, a span, or a context (None: a new trace)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if parent is None or isinstance(parent, dict):
        return TraceContextTextMapPropagator().extract(parent or {})
    if isinstance(parent, trace.Span):
        return trace.set_span_in_context(parent)
    return parent


def carrier(span: Any) -> dict[str, str] | None:
    """The W3C `traceparent` carrier of `span`, for a message that crosses a process."""
    if span is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, trace.set_span_in_context(span))
    return out


def start(name: str, parent: Any, attributes: Mapping[str, Any] | None = None,
          start_ns: int | None = None) -> Any:
    """Start a span (end it with `end`); None when tracing is off or the request carries no trace."""
    if _tracer is None or parent is None:
        return None
    return _tracer.start_span(name, context=_context(parent), attributes=_clean(attributes), start_time=start_ns)


def end(span: Any, attributes: Mapping[str, Any] | None = None, end_ns: int | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    span.end(end_time=end_ns)


def record(name: str, parent: Any, start_ns: int, end_ns: int | None = None,
           attributes: Mapping[str, Any] | None = None) -> Any:
    """A span that already happened, from `start_ns` to `end_ns` (default: now); returns it (ended)."""
    span = start(name, parent, attributes, start_ns)
    end(span, None, end_ns or time.time_ns())
    return span


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def seconds_ns(t: float) -> int:
    """A `time.time()` timestamp in ns."""
    return int(t * 1e9)


def grammar_attributes(wait: Any) -> dict[str, Any]:
    """A `grammar.compile` span's attributes, from the engine's `GrammarWait` (engine/grammar_waits.py)."""
    rnd = lambda x: None if x is None else round(x, 6)  # noqa: E731
    return {"kind": wait.kind, "cache_hit": wait.cache_hit, "queue_s": rnd(wait.queue_s),
            "compile_s": rnd(wait.compile_s), "error_cause": wait.error_cause, "error": wait.error}


# ---------------------------------------------------------------------- the door's request trace
@dataclass(slots=True)
class RequestTrace:
    """The door's root span of one request and how many of its streams (choices) are still open."""

    span: Any
    open_streams: int

    @property
    def carrier(self) -> dict[str, str] | None:
        return carrier(self.span)


_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("pdserve_trace", default=None)


def begin_request(name: str, headers: Mapping[str, str], start_ns: int,
                  attributes: Mapping[str, Any] | None = None) -> RequestTrace | None:
    """The door's root span, a child of the client's `traceparent` header when it sent a valid one;
    made current for the tasks the request starts from here (its backend streams)."""
    if _tracer is None:
        return None
    parent = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
    rt = RequestTrace(start(name, parent, attributes, start_ns), 0)
    _current.set(rt)
    return rt


def current() -> RequestTrace | None:
    return _current.get() if _tracer is not None else None


def stream_started() -> dict[str, str] | None:
    """A backend opens one stream of the current request: its carrier (None: not traced)."""
    rt = current()
    if rt is None:
        return None
    rt.open_streams += 1
    return rt.carrier


def stream_finished(start_ns: int, finish_reason: str | None, num_prompt_tokens: int, num_tokens: int,
                    num_cached_tokens: int = 0) -> None:
    """A backend's stream of the current request (opened at `start_ns`) ended: its `finish` span, a point
    in time; the root ends with the last stream."""
    rt = current()
    if rt is None:
        return
    now = time.time_ns()
    record("finish", rt.span, now, now, {"finish_reason": finish_reason or "aborted", "prompt_tokens": num_prompt_tokens,
                                         "completion_tokens": num_tokens, "cached_tokens": num_cached_tokens,
                                         "stream_ms": round((now - start_ns) / 1e6, 3)})
    rt.open_streams -= 1
    if rt.open_streams <= 0:
        end(rt.span, {"finish_reason": finish_reason or "aborted"})


def end_request(rt: RequestTrace | None, error: str | None = None) -> None:
    """The door gave up on the request before any stream opened (a refusal, a bad request)."""
    if rt is not None and rt.open_streams == 0:
        end(rt.span, {"error": error})
