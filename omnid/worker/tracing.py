"""A stage worker's spans (`[daemon] tracing`): one per job it serves, under the job's span.

`stage NAME` runs from the job's first input reaching this worker to the worker's word on it
(finished, failed, stopped). Its child `waiting for input` runs until the engine takes the job (the
input queue, the watermark, a fan-in's other parts); its events: each window of a streaming edge
that comes in (`window in`, with its source and index), the `first segment` and the `last segment`
the stage streams, its hand-offs downstream (`handed off`), and a `cancel` or `timeout` from the
supervisor, with the reason. A vLLM stage passes the span's context to vLLM's own tracing (the
request's trace headers), so vLLM's `llm_request` span hangs under it; that span is made through
this worker's exporter too (`Tracing.install_global`: the process's OpenTelemetry provider).

The parent context comes with the job's work items (`WorkItem.trace`); the spans follow the
messages the worker tells the supervisor (`watch` wraps its `Reporter`'s send and post), so they
say what the supervisor hears, when the worker says it. A span is named when the job's first input
comes (`Tracing.ref`: two random numbers) and its events are appended to a list; it is made, with
its own times, when the stage is done with the job (`Tracing.record`): the job's way to its first
token meets no OpenTelemetry call. Thread-safe: data-conn threads (`arrived`), the control thread
(`cancelled`, `forgotten`) and the main thread (`watch`) each take the lock for a dict lookup.
Built only when tracing is on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from omnid import protocol as P
from omnid.config_types import TracingConfig
from omnid.dataplane.wire import WorkItem
from omnid.tracing import Event, SpanRef, Tracing

# What a vLLM engine in this process reads (omnid.engines.vllm_engine): where its own spans go.
VLLM_TRACES_ENV = "OMNID_VLLM_OTLP_TRACES_ENDPOINT"


class _Part:
    """One job's stage span, named when its first input came and made when it ends (`Tracing.ref`,
    `Tracing.record`): what the job's way meets is a few appends."""

    __slots__ = ("ref", "job", "arrived", "started", "segments", "events", "attributes", "ended")

    def __init__(self, ref: SpanRef, job: str, arrived: int) -> None:
        self.ref = ref
        self.job = job
        self.arrived = arrived              # (ns) its first input came: `waiting for input` from here
        self.started: int | None = None     # (ns) ... to the engine taking it
        self.segments = 0
        self.events: list[Event] = []
        self.attributes: dict[str, Any] = {}
        self.ended: int | None = None       # when the stage said it was done (its hand-offs may go on)


def engine_environment(cfg: TracingConfig, stage: str) -> None:
    """What an engine with tracing of its own reads (vLLM's): where its spans would go. In this
    process they go through the stage's own exporter (`StageTracer`: the API's global provider); in
    an engine core's process of its own, vLLM's provider there sends its start-up spans (OTLP/HTTP to
    the same receiver, under `<service_name>:<stage>:vllm`)."""
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    os.environ.setdefault("OTEL_SERVICE_NAME", f"{cfg.service_name}:{stage}:vllm")
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")
    os.environ[VLLM_TRACES_ENV] = cfg.traces_url


class StageTracer:
    """`tracing`: the exporter to use (a test's); else this worker's own, made here. `engine_spans`:
    the stage's engine traces with OpenTelemetry itself (vLLM): the exporter is made the process's
    OpenTelemetry provider, so that its spans go out through it too (a stage whose engine does not
    imports no OpenTelemetry)."""

    def __init__(self, cfg: TracingConfig, stage: str, replica: int, tracing: Tracing | None = None,
                 engine_spans: bool = False) -> None:
        if tracing is None:
            tracing = Tracing(cfg, f"{cfg.service_name}:{stage}", {"omnid.stage": stage, "omnid.replica": str(replica)})
            if engine_spans:
                tracing.install_global()
        self.tracing = tracing
        self._stage, self._replica = stage, replica
        self._lock = threading.Lock()
        self._jobs: dict[str, _Part] = {}

    def watch(self, send: Callable[[object], None]) -> Callable[[object], None]:
        """`send` (a Reporter's send or post), with this tracer looking at each message first."""
        def traced(msg: object) -> None:
            try:
                self.saw(msg)
            except Exception:               # a trace never costs a job anything
                pass
            send(msg)
        return traced

    def arrived(self, item: WorkItem) -> None:
        """A work item of a job reached this worker (a data-conn thread)."""
        if item.trace is None:
            return
        now = time.time_ns()
        with self._lock:
            part = self._jobs.get(item.job)
            if part is None:
                part = self._jobs[item.job] = _Part(self.tracing.ref(item.trace), item.job, now)
            if item.window is not None:
                part.events.append(("window in", now, {"omnid.src": str(item.src), "omnid.window": item.window,
                                                      "omnid.last": item.last}))
            elif item.src is not None:
                part.events.append(("input", now, {"omnid.src": item.src}))

    def headers(self, job: str) -> dict[str, str] | None:
        """The job's stage span as a parent (what a vLLM request's trace headers say)."""
        with self._lock:
            part = self._jobs.get(job)
        return part.ref.headers if part is not None and part.ref.sampled else None

    def saw(self, msg: object) -> None:
        """A message to the supervisor, about to go."""
        if isinstance(msg, P.Batch):
            for m in msg.messages:
                self.saw(m)
            return
        job = getattr(msg, "job", None)
        if job is None:
            return
        with self._lock:
            part = self._jobs.get(job)
        if part is None:
            return
        if isinstance(msg, P.Segment):
            if part.segments == 0:
                part.events.append(("first segment", time.time_ns(), {}))
            part.segments += msg.count
            if msg.is_last:
                part.events.append(("last segment", time.time_ns(), {"omnid.segments": part.segments}))
        elif isinstance(msg, P.Started):
            if part.started is None:
                part.started = time.time_ns()
        elif isinstance(msg, P.Delivered):
            self._handed_off(part, msg.dst)
        elif part.ended is not None:
            return
        elif isinstance(msg, P.Finished):
            part.attributes["omnid.elapsed_s"] = msg.elapsed_s
            self._end(job, None, keep=True)
        elif isinstance(msg, P.Failed):
            part.events.append(("failed", time.time_ns(), {"omnid.code": str(msg.code), "omnid.reason": msg.error}))
            self._end(job, f"{msg.code}: {msg.error}")
        elif isinstance(msg, P.Stopped):
            part.events.append(("stopped", time.time_ns(), {}))
            self._end(job, "stopped")

    def cancelled(self, job: str, reason: str) -> None:
        """The supervisor cancelled the job (control thread): `cancelled`, `timed_out`, ..."""
        with self._lock:
            part = self._jobs.get(job)
        if part is not None:
            part.events.append(("timeout" if reason == "timed_out" else "cancel", time.time_ns(),
                                {"omnid.reason": reason}))

    def forgotten(self, job: str) -> None:
        """The job is over for good: a span still open ends now (this stage never got to say)."""
        self._end(job, None)

    def _handed_off(self, part: _Part, dst: str) -> None:
        """The downstream `dst` admitted the job's outputs (its last window, on a streaming edge):
        an event while the stage runs, else a span `hand-off to DST` from the stage's end until now."""
        now = time.time_ns()
        if part.ended is None:
            part.events.append(("handed off", now, {"omnid.dst": dst}))
            return
        self.tracing.record(self.tracing.ref(part.ref), f"hand-off to {dst}", part.ended, now, {"omnid.dst": dst})

    def _end(self, job: str, error: str | None, keep: bool = False) -> None:
        """End the job's stage span; `keep`: its hand-offs may follow (forgotten at `Forget`)."""
        with self._lock:
            part = self._jobs.get(job) if keep else self._jobs.pop(job, None)
            if part is None or part.ended is not None:
                return
            part.ended = time.time_ns()
            events = list(part.events)
        attributes = {"omnid.job": part.job, "omnid.stage": self._stage, "omnid.replica": self._replica,
                      "omnid.segments": part.segments, **part.attributes}
        tracing = self.tracing
        tracing.record(part.ref, f"stage {self._stage}", part.arrived, part.ended, attributes, events, error)
        tracing.record(tracing.ref(part.ref), "waiting for input", part.arrived, part.started or part.ended)

    def shutdown(self) -> None:
        self.tracing.shutdown()

