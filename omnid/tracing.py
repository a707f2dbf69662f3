"""OpenTelemetry traces of omnid's jobs (`[daemon] tracing`): one process's exporter, and the W3C
trace context the processes pass each other.

Off unless the config has `[daemon] tracing = { otlp_endpoint, sample, service_name }`. Then every
process exports its own spans straight to the receiver (OTLP/HTTP, `<otlp_endpoint>/v1/traces`): the
supervisor its job spans (`omnid.supervisor.jobs.tracing`), each stage worker its stage spans
(`omnid.worker.tracing`), a vLLM stage's engine its request spans (vLLM's own tracing, given the
stage span's context). One job is one trace: its context travels with its work items (`WorkItem.trace`).

This module imports nothing of OpenTelemetry at import time: `Tracing(...)` does, once, in a process
whose config turns tracing on. With tracing off no exporter thread runs and `opentelemetry` is never
imported by omnid. Spans are handed to opentelemetry-sdk's `BatchSpanProcessor` (a bounded queue;
its own thread exports): a receiver that is down or slow costs a job nothing (its spans are dropped
when the queue is full), and the log says so once per outage (`_Quiet`).
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog

from omnid.config_types import TracingConfig

log = structlog.get_logger("omnid.tracing")

EXPORT_TIMEOUT_S = 2.0          # one export request (with its retries) at most; the batch thread's time only
SCHEDULE_DELAY_MS = 1000        # how often the batch thread exports (OTEL_BSP_SCHEDULE_DELAY overrides it)

# W3C Trace Context: version-traceid-parentid-flags (version 00; a later one may add fields after them).
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[0-9a-zA-Z-]*)?$")
_TRACESTATE_MAX = 512


def valid_traceparent(value: str | None) -> str | None:
    """A caller's `traceparent` header if it is a valid one (W3C Trace Context), else None (ignored,
    as the spec says: a new trace starts)."""
    if not value:
        return None
    value = value.strip().lower()
    m = _TRACEPARENT.match(value)
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32 or m.group(3) == "0" * 16:
        return None
    if m.group(1) == "00" and m.group(5):
        return None                 # version 00 has exactly four fields
    return value


def trace_headers(traceparent: str | None, tracestate: str | None = None) -> dict[str, str] | None:
    """The carrier of a trace context: {"traceparent": ..., "tracestate": ...}; None without a valid
    `traceparent` (a `tracestate` alone means nothing)."""
    parent = valid_traceparent(traceparent)
    if parent is None:
        return None
    headers = {"traceparent": parent}
    if tracestate and len(tracestate) <= _TRACESTATE_MAX:
        headers["tracestate"] = tracestate.strip()
    return headers


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id (32 hex digits) a `traceparent` names."""
    parent = valid_traceparent(traceparent)
    return parent.split("-")[1] if parent else None


@dataclass(frozen=True)
class SpanRef:
    """A span named before it is made: its ids and where it hangs, in plain Python (no OpenTelemetry
    on a job's way). `Tracing.record` makes the span when it ends, with these ids and its own times,
    so that what runs before (the job's first token) only draws two random numbers."""

    trace_id: int
    span_id: int
    parent_id: int | None           # the parent span's id (None: the root of its trace)
    sampled: bool
    remote: bool = False            # the parent is another process's (a caller's, or the supervisor's)
    tracestate: str | None = None

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    @property
    def headers(self) -> dict[str, str]:
        """The carrier naming this span as the parent (what a child in another process is given)."""
        out = {"traceparent": self.traceparent}
        if self.tracestate:
            out["tracestate"] = self.tracestate
        return out


# A span's event, recorded while it runs: (name, time in ns, attributes)
Event = tuple[str, int, dict[str, Any]]


class Tracing:
    """One process's spans and their exporter: opentelemetry-sdk's batch processor (a bounded queue,
    its own thread) with the OTLP/HTTP exporter, under this process's resource (`service.name`).

    A span is made by `record`, whole, once it has ended: an SDK `ReadableSpan` with the ids its
    `SpanRef` drew and its own times, handed straight to the processor. The SDK's tracer is not on
    this way: its `start_span` and `end` (a sampler, a context, attribute checks, a lock per
    attribute and event) cost about 25 µs a span, `record` about 2.5 µs (measured in-process). Sampling is
    `ref`'s (the caller's decision when there is one, else `sample` by the trace id, as the SDK's
    `ParentBased(TraceIdRatioBased)` decides). Thread-safe (the processor's queue is)."""

    def __init__(self, cfg: TracingConfig, service: str, attributes: Mapping[str, str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event as SpanEvent
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

        self.config = cfg
        # The exporter's own log lines (one per failed batch, with a traceback) give way to ours: once.
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
        self._resource = Resource.create({"service.name": service, "process.pid": os.getpid(), **(attributes or {})})
        self._scope = InstrumentationScope("omnid")
        self._bound = TraceIdRatioBased(cfg.sample).bound   # a new trace is kept when its id's low 64 bits are below it
        exporter = _Quiet(OTLPSpanExporter(endpoint=cfg.traces_url, timeout=EXPORT_TIMEOUT_S), cfg.traces_url)
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else SCHEDULE_DELAY_MS
        self._processors: list[Any] = [BatchSpanProcessor(cast(Any, exporter), schedule_delay_millis=delay)]
        # What `record` makes a span of, looked up once (not an import per span).
        self._span, self._event, self._context, self._state = ReadableSpan, SpanEvent, SpanContext, TraceState
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._server, self._internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._unset, self._error = Status(StatusCode.UNSET), StatusCode.ERROR
        self._status = Status

    def add_processor(self, processor: Any) -> None:
        """Another SDK span processor beside the exporter's (a test's in-memory one)."""
        self._processors.append(processor)

    # ------------------------------------------------------------------ spans named first, made at their end

    def ref(self, parent: Mapping[str, str] | SpanRef | None) -> SpanRef:
        """A new span's ids, under `parent` (a carrier from another process, or a span of this one):
        its trace and sampling decision; a new trace (kept at the `sample` rate) without one."""
        span_id = random.getrandbits(64) or 1
        if isinstance(parent, SpanRef):
            return SpanRef(parent.trace_id, span_id, parent.span_id, parent.sampled, False, parent.tracestate)
        traceparent = valid_traceparent(parent.get("traceparent")) if parent else None
        if parent and traceparent:
            _, trace_hex, parent_hex, flags = traceparent.split("-")[:4]
            return SpanRef(int(trace_hex, 16), span_id, int(parent_hex, 16), bool(int(flags, 16) & 1), True,
                           parent.get("tracestate"))
        trace_id = random.getrandbits(128) or 1
        return SpanRef(trace_id, span_id, None, (trace_id & 0xFFFFFFFFFFFFFFFF) < self._bound)

    def record(self, ref: SpanRef, name: str, start: int, end: int, attributes: Mapping[str, Any] | None = None,
               events: Sequence[Event] = (), error: str | None = None, server: bool = False) -> None:
        """Make the span `ref` names, now that it has ended (times in ns), and hand it to the exporter."""
        if not ref.sampled:
            return
        context, flags = self._context, self._sampled
        state = self._state.from_header([ref.tracestate]) if ref.tracestate else None
        parent = context(ref.trace_id, ref.parent_id, is_remote=ref.remote, trace_flags=flags,
                         trace_state=state) if ref.parent_id is not None else None
        span = self._span(
            name, context=context(ref.trace_id, ref.span_id, is_remote=False, trace_flags=flags, trace_state=state),
            parent=parent, resource=self._resource, attributes=_clean(attributes),
            events=tuple(self._event(n, _clean(a), ts) for n, ts, a in events),
            kind=self._server if server else self._internal, instrumentation_scope=self._scope,
            status=self._status(self._error, error) if error is not None else self._unset,
            start_time=start, end_time=end)
        for processor in self._processors:
            processor.on_end(span)

    def install_global(self) -> None:
        """Make this process's OpenTelemetry API provider one that hands its spans to this exporter's
        processor: a library that traces here (vLLM's request spans, in a vLLM stage's worker) then
        sends them with omnid's (one batch thread, one export request a period), not through a
        provider and exporter of its own. Call it before the library sets up its tracing: the API
        takes one provider a process, and a later one (vLLM's) is refused, without the API's
        warning. The SDK's own tracer makes those spans (about 18 µs each, measured in-process),
        sampled as `ref` samples: the parent's decision, else `sample`."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(resource=self._resource, sampler=ParentBased(TraceIdRatioBased(self.config.sample)))
        for processor in self._processors:
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        logging.getLogger("opentelemetry.trace").addFilter(_OneProvider())

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout), stop the batch thread."""
        for processor in self._processors:
            try:
                processor.shutdown()
            except Exception:
                pass


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes as OTLP takes them: a None left out, a value not a str, bool, int or float as text
    (what the SDK's own checks would have done, without their cost)."""
    if not attributes:
        return {}
    return {k: v if isinstance(v, (str, bool, int, float)) else str(v) for k, v in attributes.items() if v is not None}


class _OneProvider(logging.Filter):
    """The API's warning when a library sets a provider of its own after `install_global`'s (vLLM's
    tracing does, and its spans stay on ours): expected, so not logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overriding of current TracerProvider" not in record.getMessage()


def exporter_threads() -> list[str]:
    """The names of this process's span-exporting threads (the batch processor's): a test's check."""
    return [t.name for t in threading.enumerate() if "OtelBatch" in t.name or "BatchSpanProcessor" in t.name]


class _Quiet:
    """An exporter that says once that the receiver is not answering (and once that it answers again),
    instead of a warning per batch. A SpanExporter (duck-typed: the SDK only calls these)."""

    def __init__(self, inner: Any, url: str) -> None:
        self._inner = inner
        self._url = url
        self._failing = False

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult
        try:
            result = self._inner.export(spans)
        except Exception as e:                  # never up into the batch thread
            result, why = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        else:
            why = "no answer, or an error answer"
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                self._failing = False
                log.info("the trace receiver answers again", url=self._url)
        elif not self._failing:
            self._failing = True
            log.warning("the trace receiver is not taking spans: they are dropped until it does (jobs are "
                        "not slowed)", url=self._url, why=why)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))
