"""OpenTelemetry traces of omnid's jobs (`[daemon] tracing`): one process's spans, their exporter
process, and the W3C trace context the processes pass each other.

Off unless the config has `[daemon] tracing = { otlp_endpoint, sample, service_name }`. Then every
process's spans go straight to the receiver (OTLP/HTTP, `<otlp_endpoint>/v1/traces`), not through
the supervisor: the supervisor's job spans (`omnid.supervisor.jobs.tracing`), each stage worker's
stage spans (`omnid.worker.tracing`) and, in a vLLM stage's worker, vLLM's request spans (vLLM's
own tracing, given the stage span's context). One job is one trace: its context travels with its
work items (`WorkItem.trace`).

A process that traces (`Tracing`) makes its spans in plain Python: named when their part begins
(`ref`: two random numbers), made when it ends (`record`: a tuple appended to a list). A thread
hands the list, a batch at a time (every FLUSH_S, or at BATCH spans), pickled, to this process's
exporter: a child process of its own (`python -m omnid.tracing_export`, reading its stdin), where
opentelemetry-sdk's `BatchSpanProcessor` and OTLP/HTTP exporter make, encode and send them. The
encoding (about 25 µs a span) and the HTTP requests run there, not under the job's process's GIL:
in a stage worker they would take the engine loop's time (measured: a third to a half of
tracing's cost, in a vLLM stage). A receiver that is down or slow costs a job nothing (the
exporter's bounded queue drops spans), and the exporter's log says so once per outage (`QuietExporter`);
the exporter gone, the process drops its spans and says so once; the process gone, its exporter
sends what it has and ends (its stdin closes).

This module imports nothing of OpenTelemetry: a process that traces imports none of it (the
exporter process does), except a vLLM stage's worker, whose OpenTelemetry API provider hands
vLLM's spans to the same exporter (`install_global`). With tracing off no exporter runs.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

# A span made whole, as it travels to the exporter process (plain Python, pickled): (trace id, span
# id, parent span id or None, the parent is remote, tracestate header or None, name, start ns, end
# ns, attributes, events, error or None (the status's description), kind (SpanKind's value),
# instrumentation scope (name, version) or None: omnid's).
SpanTuple = tuple[int, int, int | None, bool, str | None, str, int, int, dict[str, Any], list[Event], str | None,
                  int, tuple[str, str | None] | None]

FLUSH_S = 0.5           # the spans go to the exporter process at least this often ...
BATCH = 256             # ... or once this many wait
MAX_WAITING = 8192      # spans waiting at most (the exporter process slow or stuck): more are dropped
SERVER, INTERNAL = 1, 0     # SpanKind values


class Tracing:
    """One process's spans, made in plain Python and sent, in batches, to its exporter process
    (`omnid.tracing_export`), which makes them SDK spans and exports them (the module docstring).

    `export=False`: no exporter process (a test's, with its own `add_processor`). Sampling is
    `ref`'s: the caller's decision when there is one, else `sample` by the trace id, as the SDK's
    `ParentBased(TraceIdRatioBased)` decides. Thread-safe."""

    def __init__(self, cfg: TracingConfig, service: str, attributes: Mapping[str, str] | None = None,
                 export: bool = True) -> None:
        self.config = cfg
        self.resource: dict[str, Any] = {"service.name": service, "process.pid": os.getpid(), **(attributes or {})}
        # TraceIdRatioBased's rule: a new trace is kept when its id's low 64 bits are below the bound.
        self._bound = round(cfg.sample * (1 << 64))
        self._lock = threading.Lock()
        self._waiting: list[SpanTuple] = []
        self._dropped = 0
        self._wake = threading.Event()
        self._stopping = False
        self._gone = False                      # the exporter process no longer takes spans
        self._processors: list[Any] = []        # SDK span processors in this process (`add_processor`)
        self._maker: SpanMaker | None = None
        self._exporter: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        if export:
            self._exporter = _start_exporter(cfg, self.resource)
            self._thread = threading.Thread(target=self._send_loop, name="omnid-spans", daemon=True)
            self._thread.start()

    def add_processor(self, processor: Any) -> None:
        """An SDK span processor in this process (a test's in-memory one): each span is made here too."""
        if self._maker is None:
            self._maker = SpanMaker(self.resource)
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
        """Make the span `ref` names, now that it has ended (times in ns), and send it."""
        if not ref.sampled:
            return
        self.add((ref.trace_id, ref.span_id, ref.parent_id, ref.remote, ref.tracestate, name, start, end,
                  _clean(attributes), [(n, ts, _clean(a)) for n, ts, a in events], error,
                  SERVER if server else INTERNAL, None))

    def add(self, span: SpanTuple) -> None:
        """A span made whole (`record`'s, or a library's: `install_global`), to send."""
        if self._maker is not None:
            made = self._maker.make(span)
            for processor in self._processors:
                processor.on_end(made)
        if self._exporter is None:
            return
        with self._lock:
            if len(self._waiting) >= MAX_WAITING:
                self._dropped += 1
                return
            self._waiting.append(span)
            if len(self._waiting) >= BATCH:
                self._wake.set()

    def _send_loop(self) -> None:
        """The thread that hands the waiting spans to the exporter process, a batch at a time."""
        while True:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            with self._lock:
                batch, self._waiting = self._waiting, []
                dropped, self._dropped = self._dropped, 0
            if batch:
                self._send(batch)
            if dropped:
                log.warning("spans dropped: the trace exporter process did not keep up", dropped=dropped)
            if self._stopping:
                return

    def _send(self, batch: list[SpanTuple]) -> None:
        if self._gone or self._exporter is None or self._exporter.stdin is None:
            return
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._exporter.stdin.write(struct.pack("!I", len(data)) + data)
            self._exporter.stdin.flush()
        except (OSError, ValueError) as e:      # (a closed or broken pipe)
            self._gone = True
            log.warning("the trace exporter process is gone: this process's spans are dropped",
                        why=f"{type(e).__name__}: {e}")

    def install_global(self) -> None:
        """Make this process's OpenTelemetry API provider one whose spans go to this process's
        exporter: a library that traces here (vLLM's request spans, in a vLLM stage's worker) then
        sends them with omnid's, not through a provider and exporter of its own. Call it before the
        library sets up its tracing: the API takes one provider a process, and a later one (vLLM's)
        is refused, without the API's warning. The SDK's own tracer makes those spans (about 18 µs
        each, measured in-process), sampled as `ref` samples: the parent's decision, else `sample`."""
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(resource=Resource.create(self.resource),
                                  sampler=ParentBased(TraceIdRatioBased(self.config.sample)))
        provider.add_span_processor(_forward(self))
        trace.set_tracer_provider(provider)
        logging.getLogger("opentelemetry.trace").addFilter(_OneProvider())

    def shutdown(self) -> None:
        """Send what waits, and let the exporter process export what it has and end (bounded by
        the export timeout)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(FLUSH_S + 5)
        exporter = self._exporter
        if exporter is not None:
            if self._thread is not None and self._thread.is_alive():
                exporter.kill()                 # it takes no more (stopped?): what it has is lost
            try:
                if exporter.stdin is not None:
                    exporter.stdin.close()
                exporter.wait(EXPORT_TIMEOUT_S + 5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                exporter.kill()
                exporter.wait(5)
        for processor in self._processors:
            try:
                processor.shutdown()
            except Exception:
                pass


def _start_exporter(cfg: TracingConfig, resource: Mapping[str, Any]) -> subprocess.Popen[bytes]:
    """This process's exporter process: its spans come on its stdin; its log goes where ours does."""
    from omnid import logs
    level, fmt, process = logs.settings()
    spec = {"url": cfg.traces_url, "resource": dict(resource), "log": [level, fmt, f"{process}:spans"]}
    return subprocess.Popen([sys.executable, "-m", "omnid.tracing_export", json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


class SpanMaker:
    """Spans made whole from `SpanTuple`s: SDK `ReadableSpan`s with their own ids and times, handed
    straight to a processor. The SDK's tracer is not on this way: its `start_span` and `end` (a
    sampler, a context, attribute checks, a lock per attribute and event) cost about 25 µs a span,
    `make` about 2.5 µs (measured in-process)."""

    def __init__(self, resource: Mapping[str, Any]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event as SpanEvent
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

        self._resource = Resource.create(dict(resource))
        self._omnid = InstrumentationScope("omnid")
        self._scopes: dict[tuple[str, str | None], Any] = {}
        self._scope = InstrumentationScope
        self._span, self._event, self._context, self._state = ReadableSpan, SpanEvent, SpanContext, TraceState
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._kinds = {kind.value: kind for kind in SpanKind}
        self._unset, self._error = Status(StatusCode.UNSET), StatusCode.ERROR
        self._status = Status

    def make(self, span: SpanTuple) -> Any:
        (trace_id, span_id, parent_id, remote, tracestate, name, start, end, attributes, events, error, kind,
         scope) = span
        context, flags = self._context, self._sampled
        state = self._state.from_header([tracestate]) if tracestate else None
        parent = context(trace_id, parent_id, is_remote=remote, trace_flags=flags,
                         trace_state=state) if parent_id is not None else None
        made_scope: Any = self._omnid
        if scope is not None:
            made_scope = self._scopes.get(scope)
            if made_scope is None:
                made_scope = self._scopes[scope] = self._scope(*scope)
        return self._span(
            name, context=context(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=state),
            parent=parent, resource=self._resource, attributes=attributes,
            events=tuple(self._event(n, a, ts) for n, ts, a in events),
            kind=self._kinds.get(kind, self._kinds[INTERNAL]), instrumentation_scope=made_scope,
            status=self._status(self._error, error) if error is not None else self._unset,
            start_time=start, end_time=end)


def _forward(tracing: Tracing) -> Any:
    """An SDK span processor in a process that traces: each span a library makes through the
    OpenTelemetry API goes, as a `SpanTuple`, where omnid's spans go (`Tracing.add`)."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import StatusCode

    class Forward(SpanProcessor):
        def on_end(self, span: Any) -> None:
            try:
                ctx, parent, status, scope = span.context, span.parent, span.status, span.instrumentation_scope
                tracing.add((
                    ctx.trace_id, ctx.span_id, parent.span_id if parent is not None else None,
                    bool(parent.is_remote) if parent is not None else False,
                    (ctx.trace_state.to_header() or None) if ctx.trace_state else None, span.name,
                    span.start_time or 0, span.end_time or 0, _clean(span.attributes),
                    [(e.name, e.timestamp, _clean(e.attributes)) for e in span.events],
                    (status.description or "") if status.status_code is StatusCode.ERROR else None, span.kind.value,
                    (scope.name, scope.version) if scope is not None else None))
            except Exception:                   # a trace never costs a job anything
                pass

    return Forward()


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


class QuietExporter:
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
            why = "no answer, or a failure status"     # (no "error": a relayed line is not read as one)
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
