"""A job's spans in the supervisor (`[daemon] tracing`): the job, its admission, its time queued and
running, ending with its outcome; cancel, timeout, retry and a worker's death as events on it.

Runs in the supervisor's event-loop thread. `JobTrace` follows the job's own event stream
(`LiveJob.events` calls `on_event` for each event it emits), so what the trace says is what
`GET /v1/jobs/{id}/events` says, at the same times. The stages' spans are the workers' own
(`omnid.worker.tracing`), children of the job span: the job's context (`traceparent`) travels with
its work items. Only built when tracing is on (`omnid.tracing.Tracing` imports OpenTelemetry).
"""

from __future__ import annotations

from typing import Any

from omnid.tracing import Tracing
from omnid.vocabulary import ErrorCode, EventType, JobRecord, JobState


def _ns(ts: float) -> int:
    return int(ts * 1e9)


class JobTrace:
    """One job's spans: `omnid.job` (from the request's arrival to the job's end), its children
    `admission` (arrival to accepted), `queued` (accepted to its first stage starting) and `running`."""

    def __init__(self, tracing: Tracing, record: JobRecord, parent: dict[str, str] | None,
                 received_at: float | None) -> None:
        from opentelemetry import trace
        tracer = tracing.tracer
        start = min(received_at or record.created_at, record.created_at)
        self.span = tracer.start_span(
            "omnid.job", context=tracing.context(parent), kind=trace.SpanKind.SERVER, start_time=_ns(start),
            attributes={"omnid.job": record.id, "omnid.pipeline": record.pipeline,
                        "omnid.timeout_s": record.timeout_s})
        ctx = trace.set_span_in_context(self.span)
        self._tracer, self._ctx = tracer, ctx
        if received_at is not None:
            tracer.start_span("admission", context=ctx, start_time=_ns(start)).end(end_time=_ns(record.created_at))
        self._queued: Any = tracer.start_span("queued", context=ctx, start_time=_ns(record.created_at))
        self._running: Any = None
        sc = self.span.get_span_context()
        self.trace_id = format(sc.trace_id, "032x")
        self.sampled = bool(sc.trace_flags.sampled)
        self.headers = tracing.headers(self.span)     # what the workers' stage spans hang under
        self.traceparent = self.headers.get("traceparent", "")

    def on_event(self, event: dict[str, Any]) -> None:
        """One of the job's events, as it is emitted."""
        kind, ts = event["type"], _ns(event["ts"])
        if kind == EventType.STATE:
            self._state(JobState(event["state"]), ts, event.get("error"))
        elif kind == EventType.ERROR:
            attrs = {"omnid.stage": str(event.get("stage")), "omnid.code": str(event.get("code")),
                     "omnid.reason": str(event.get("message", ""))}
            if event.get("code") == ErrorCode.WORKER_DIED:
                self.span.add_event("worker died", attrs, timestamp=ts)
                if "retrying" in attrs["omnid.reason"]:
                    self.span.add_event("retry", attrs, timestamp=ts)
            else:
                self.span.add_event("error", attrs, timestamp=ts)
        elif kind in (EventType.STAGE_WAKING, EventType.STAGE_AWAKE):
            self.span.add_event(str(kind), {"omnid.stage": str(event.get("stage"))}, timestamp=ts)

    def _state(self, state: JobState, ts: int, error: dict[str, Any] | None) -> None:
        from opentelemetry.trace import Status, StatusCode
        if state is JobState.RUNNING:
            if self._queued is not None:
                self._queued.end(end_time=ts)
                self._queued = None
            self._running = self._tracer.start_span("running", context=self._ctx, start_time=ts)
            return
        if not state.terminal:
            return
        reason = str((error or {}).get("message", ""))
        if state is JobState.CANCELLED:
            self.span.add_event("cancel", {"omnid.reason": reason}, timestamp=ts)
        elif state is JobState.TIMED_OUT:
            self.span.add_event("timeout", {"omnid.reason": reason}, timestamp=ts)
        for part in (self._queued, self._running):
            if part is not None:
                part.end(end_time=ts)
        self._queued = self._running = None
        self.span.set_attribute("omnid.outcome", str(state))
        if error:
            self.span.set_attribute("omnid.error.code", str(error.get("code")))
        self.span.set_status(Status(StatusCode.OK) if state is JobState.SUCCEEDED
                             else Status(StatusCode.ERROR, f"{state}: {reason}"))
        self.span.end(end_time=ts)

    def abandon(self) -> None:
        """The daemon stops with the job still live (the next one runs it again): end its spans."""
        for part in (self._queued, self._running):
            if part is not None:
                part.end()
        self._queued = self._running = None
        self.span.add_event("daemon stopping")
        self.span.end()
