"""A job's spans in the supervisor (`[daemon] tracing`): the job, its admission, its time queued and
running, ending with its outcome; cancel, timeout, retry and a worker's death as events on it.

Runs in the supervisor's event-loop thread. `JobTrace` follows the job's own event stream
(`LiveJob.events` calls `on_event` for each event it emits), so what the trace says is what
`GET /v1/jobs/{id}/events` says, at the same times. The stages' spans are the workers' own
(`omnid.worker.tracing`), children of the job span: the job's context (`headers`) travels with its
work items. The spans are named when the job is accepted (`Tracing.ref`: two random numbers) and
made when it ends (`Tracing.record`), so tracing adds next to nothing on the way to a job's first
token. Only built when tracing is on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omnid.tracing import Event, Tracing
from omnid.vocabulary import ErrorCode, EventType, JobRecord, JobState
from omnid.vocabulary import Event as JobEvent


def _ns(ts: float) -> int:
    return int(ts * 1e9)


class JobTrace:
    """One job's spans: `omnid.job` (from the request's arrival to the job's end), its children
    `admission` (arrival to accepted), `queued` (accepted to its first stage starting) and `running`."""

    def __init__(self, tracing: Tracing, record: JobRecord, parent: dict[str, str] | None,
                 received_at: float | None) -> None:
        self._tracing = tracing
        self.ref = tracing.ref(parent)
        self._attributes: dict[str, Any] = {"omnid.job": record.id, "omnid.pipeline": record.pipeline,
                                            "omnid.timeout_s": record.timeout_s}
        self._created = _ns(record.created_at)
        self._received = min(_ns(received_at), self._created) if received_at is not None else None
        self._running: int | None = None       # when it started running
        self._events: list[Event] = []
        self._ended = False
        self.trace_id = self.ref.trace_hex
        self.sampled = self.ref.sampled
        self.headers = self.ref.headers         # what the workers' stage spans hang under
        self.traceparent = self.ref.traceparent

    def on_event(self, event: JobEvent) -> None:
        """One of the job's events, as it is emitted."""
        kind = event["type"]
        if kind == EventType.STATE:
            self._state(JobState(event["state"]), _ns(event["ts"]), event.get("error"))
        elif kind == EventType.ERROR:
            ts = _ns(event["ts"])
            attrs = {"omnid.stage": str(event.get("stage")), "omnid.code": str(event.get("code")),
                     "omnid.reason": str(event.get("message", ""))}
            if event.get("code") == ErrorCode.WORKER_DIED:
                self._events.append(("worker died", ts, attrs))
                if "retrying" in attrs["omnid.reason"]:
                    self._events.append(("retry", ts, attrs))
            else:
                self._events.append(("error", ts, attrs))
        elif kind in (EventType.STAGE_WAKING, EventType.STAGE_AWAKE):
            self._events.append((str(kind), _ns(event["ts"]), {"omnid.stage": str(event.get("stage"))}))

    def _state(self, state: JobState, ts: int, error: Mapping[str, Any] | None) -> None:
        if state is JobState.RUNNING:
            if self._running is None:
                self._running = ts
            return
        if not state.terminal or self._ended:
            return
        reason = str((error or {}).get("message", ""))
        if state is JobState.CANCELLED:
            self._events.append(("cancel", ts, {"omnid.reason": reason}))
        elif state is JobState.TIMED_OUT:
            self._events.append(("timeout", ts, {"omnid.reason": reason}))
        self._attributes["omnid.outcome"] = str(state)
        if error:
            self._attributes["omnid.error.code"] = str(error.get("code"))
        self._end(ts, None if state is JobState.SUCCEEDED else f"{state}: {reason}")

    def _end(self, end: int, error: str | None) -> None:
        """Make the job's spans: the job's, and admission (arrival -> accepted), queued (accepted ->
        its first stage started it, or its end), running (-> its end)."""
        self._ended = True
        tracing, ref = self._tracing, self.ref
        start = self._received if self._received is not None else self._created
        tracing.record(ref, "omnid.job", start, end, self._attributes, self._events, error, server=True)
        if self._received is not None:
            tracing.record(tracing.ref(ref), "admission", self._received, self._created)
        tracing.record(tracing.ref(ref), "queued", self._created, self._running if self._running is not None else end)
        if self._running is not None:
            tracing.record(tracing.ref(ref), "running", self._running, end)

    def abandon(self) -> None:
        """The daemon stops with the job still live (the next one runs it again): end its spans."""
        if self._ended:
            return
        now = _ns(time.time())
        self._events.append(("daemon stopping", now, {}))
        self._end(now, None)
