"""A job's spans in the supervisor (`[daemon] tracing`): the job, its admission, its time queued and
running, ending with its outcome; cancel, timeout, retry and a worker's death as events on it.

Runs in the supervisor's event-loop thread. `JobTrace` follows the job's own event stream
(`LiveJob.events` calls `on_event` for each event it emits), so what the trace says is what
`GET /v1/jobs/{id}/events` says, at the same times. The stages' spans are the workers' own
(`omnid.worker.tracing`), children of the job span: the job's context (`traceparent`) travels with
its work items. Only built when tracing is on (`omnid.tracing.Tracing` imports OpenTelemetry).
"""

from __future__ import annotations

import time
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
        self._tracer, self._ctx = tracer, trace.set_span_in_context(self.span)
        # The parts are made when they end, with their own times: nothing but the job's span is
        # made on a job's way to its first token.
        self._received = _ns(start) if received_at is not None else None
        self._created = _ns(record.created_at)
        self._running: int | None = None       # when it started running
        self._ended = False
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

    def _part(self, name: str, start: int, end: int) -> None:
        self._tracer.start_span(name, context=self._ctx, start_time=start).end(end_time=end)

    def _state(self, state: JobState, ts: int, error: dict[str, Any] | None) -> None:
        from opentelemetry.trace import Status, StatusCode
        if state is JobState.RUNNING:
            if self._running is None:
                self._running = ts
            return
        if not state.terminal or self._ended:
            return
        self._ended = True
        reason = str((error or {}).get("message", ""))
        if state is JobState.CANCELLED:
            self.span.add_event("cancel", {"omnid.reason": reason}, timestamp=ts)
        elif state is JobState.TIMED_OUT:
            self.span.add_event("timeout", {"omnid.reason": reason}, timestamp=ts)
        self._parts(ts)
        self.span.set_attribute("omnid.outcome", str(state))
        if error:
            self.span.set_attribute("omnid.error.code", str(error.get("code")))
        self.span.set_status(Status(StatusCode.OK) if state is JobState.SUCCEEDED
                             else Status(StatusCode.ERROR, f"{state}: {reason}"))
        self.span.end(end_time=ts)

    def _parts(self, end: int) -> None:
        """admission (arrival -> accepted), queued (accepted -> its first stage started it, or its end),
        running (-> its end)."""
        if self._received is not None:
            self._part("admission", self._received, self._created)
        self._part("queued", self._created, self._running if self._running is not None else end)
        if self._running is not None:
            self._part("running", self._running, end)

    def abandon(self) -> None:
        """The daemon stops with the job still live (the next one runs it again): end its spans."""
        if self._ended:
            return
        self._ended = True
        now = _ns(time.time())
        self._parts(now)
        self.span.add_event("daemon stopping", timestamp=now)
        self.span.end(end_time=now)
