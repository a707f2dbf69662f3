"""Tracing's parts in process: the `[daemon] tracing` table's checks, the W3C traceparent's, a job's
spans as its events drive them (timeout, retry, worker death), a stage's spans as its messages drive
them, and `omnictl trace`'s timeline. The spans are read from an in-memory exporter added to the
tracer (the OTLP exporter beside it points at a port nothing listens on)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

from omnictl.timeline import timeline, waterfall
from omnid import config as C
from omnid import protocol as P
from omnid.config_types import TracingConfig
from omnid.dataplane.wire import WorkItem
from omnid.tracing import Tracing, trace_headers, trace_id_of, valid_traceparent
from omnid.vocabulary import JobRecord, StageRun

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

NOWHERE = TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample=1.0, service_name="t")
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def config(tracing: Any) -> dict[str, Any]:
    return {"daemon": {"tracing": tracing},
            "stages": {"a": {"engine": "python", "function": "teststages:echo", "python_path": [str(FIXTURES)]}},
            "pipelines": {"p": {"stages": ["a"]}}}


def test_the_tracing_table(tmp_path: Path) -> None:
    assert C.parse(copy.deepcopy(config({})), base=tmp_path).daemon.tracing == TracingConfig()
    cfg = C.parse(config({"otlp_endpoint": "http://collector:4318/", "sample": 0.25, "service_name": "gpu1"}),
                  base=tmp_path).daemon.tracing
    assert cfg == TracingConfig("http://collector:4318/", 0.25, "gpu1")
    assert cfg.traces_url == "http://collector:4318/v1/traces"
    assert TracingConfig("http://c:4318/v1/traces").traces_url == "http://c:4318/v1/traces"
    plain = {**config({}), "daemon": {}}
    assert C.parse(plain, base=tmp_path).daemon.tracing is None          # off unless asked for


@pytest.mark.parametrize("tracing, path, fragment", [
    ({"otlp_endpoint": "collector:4318"}, "daemon.tracing.otlp_endpoint", "http(s) URL"),
    ({"otlp_endpoint": 4318}, "daemon.tracing.otlp_endpoint", "must be a string"),
    ({"sample": 1.5}, "daemon.tracing.sample", "between 0 and 1"),
    ({"sample": "all"}, "daemon.tracing.sample", "must be"),
    ({"service_name": " "}, "daemon.tracing.service_name", "must not be empty"),
    ({"endpoint": "http://x:1"}, "daemon.tracing.endpoint", "unknown key"),
    ("http://x:4318", "daemon.tracing", "must be a table"),
])
def test_the_tracing_tables_problems(tmp_path: Path, tracing: Any, path: str, fragment: str) -> None:
    with pytest.raises(C.ConfigError) as err:
        C.parse(config(tracing), base=tmp_path)
    found = [p.message for p in err.value.problems if p.path == path]
    assert any(fragment in m for m in found), [str(p) for p in err.value.problems]


def test_traceparent() -> None:
    assert valid_traceparent(PARENT) == PARENT
    assert valid_traceparent(PARENT.upper()) == PARENT
    assert trace_id_of(PARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    for bad in ("", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "ff-" + PARENT[3:],
                "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
                PARENT + "-extra", "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", "garbage"):
        assert valid_traceparent(bad) is None, bad
    assert valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later") is not None
    assert trace_headers(PARENT, "k=v") == {"traceparent": PARENT, "tracestate": "k=v"}
    assert trace_headers(None, "k=v") is None and trace_headers(PARENT, "x" * 600) == {"traceparent": PARENT}


@pytest.fixture
def spans() -> Any:
    tracing = Tracing(NOWHERE, "t", export=False)
    memory = InMemorySpanExporter()
    tracing.add_processor(SimpleSpanProcessor(memory))
    yield tracing, memory
    tracing.shutdown()


def record() -> JobRecord:
    return JobRecord(id="j1", pipeline="p", owner_uid=0, created_at=time.time(), timeout_s=5.0, inputs={},
                     params={}, stages={"a": StageRun()})


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "job": "j1", "ts": time.time(), **fields}


def test_a_job_that_timed_out_after_a_retry(spans: Any) -> None:
    from omnid.supervisor.jobs.tracing import JobTrace
    tracing, memory = spans
    rec = record()
    trace = JobTrace(tracing, rec, {"traceparent": PARENT}, rec.created_at - 0.01)
    assert trace.trace_id == trace_id_of(PARENT) and trace.traceparent.startswith(f"00-{trace.trace_id}-")
    trace.on_event(ev("state", state="queued"))
    trace.on_event(ev("stage_started", stage="a"))
    trace.on_event(ev("state", state="running"))
    trace.on_event(ev("error", stage="a", code="worker_died", message="stage 'a' died (signal 9); retrying (attempt 2)"))
    trace.on_event(ev("state", state="timed_out", error={"code": "timed_out", "message": "timed out after 5 s"}))
    by = {s.name: s for s in memory.get_finished_spans()}
    assert set(by) == {"omnid.job", "admission", "queued", "running"}
    job = by["omnid.job"]
    assert format(job.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert [e.name for e in job.events] == ["worker died", "retry", "timeout"]
    assert job.events[-1].attributes["omnid.reason"] == "timed out after 5 s"
    assert job.attributes["omnid.outcome"] == "timed_out" and not job.status.is_ok
    assert job.end_time == job.events[-1].timestamp
    for name in ("admission", "queued", "running"):
        assert by[name].parent.span_id == job.context.span_id
    assert by["queued"].end_time == by["running"].start_time


def test_a_stages_spans_follow_its_messages(spans: Any) -> None:
    from omnid.worker.tracing import StageTracer
    tracing, memory = spans
    job_span = tracing.ref({"traceparent": PARENT})          # the supervisor's job span, named
    headers = job_span.headers
    tracer = StageTracer(NOWHERE, "a", 0, tracing)
    sent: list[object] = []
    post = tracer.watch(sent.append)
    tracer.arrived(WorkItem(job="j1", pipeline="p", src="up", inputs={}, window=0, last=False, trace=headers))
    tracer.arrived(WorkItem(job="j1", pipeline="p", src="up", inputs={}, window=1, last=True, trace=headers))
    assert tracer.headers("j1")["traceparent"].startswith(f"00-{job_span.trace_hex}-")
    post(P.Started(job="j1"))
    post(P.Batch((P.Segment(job="j1", index=0, is_last=False), P.Segment(job="j1", index=1, is_last=True))))
    post(P.Finished(job="j1", elapsed_s=0.1))
    post(P.Delivered(job="j1", dst="down"))
    tracer.forgotten("j1")
    assert len(sent) == 4                               # every message still goes
    by = {s.name: s for s in memory.get_finished_spans()}
    stage = by["stage a"]
    assert stage.parent.span_id == job_span.span_id and stage.context.trace_id == job_span.trace_id
    assert [e.name for e in stage.events] == ["window in", "window in", "first segment", "last segment"]
    assert by["waiting for input"].parent.span_id == stage.context.span_id
    assert by["hand-off to down"].parent.span_id == stage.context.span_id
    assert by["hand-off to down"].start_time == stage.end_time
    assert tracer.headers("j1") is None


def test_omnictl_trace_rows() -> None:
    job = {"id": "j1", "pipeline": "p", "state": "succeeded", "created_at": 100.0, "started_at": 100.1,
           "finished_at": 102.0, "stages": {"a": {"state": "succeeded", "finished_at": 101.0},
                                            "b": {"state": "succeeded", "finished_at": 102.0}}}
    events = [{"type": "state", "state": "queued", "ts": 100.0, "trace_id": "ab" * 16},
              {"type": "stage_started", "stage": "a", "ts": 100.1},
              {"type": "segment", "stage": "a", "ts": 100.3}, {"type": "segment", "stage": "a", "ts": 100.9},
              {"type": "stage_finished", "stage": "a", "ts": 101.0},
              {"type": "stage_started", "stage": "b", "ts": 100.5},
              {"type": "stage_finished", "stage": "b", "ts": 102.0}]
    doc = timeline(job, events, [{"from": "a", "to": "b", "window": 2}])
    rows = {r["name"]: r for r in doc["rows"]}
    assert doc["trace_id"] == "ab" * 16 and doc["duration_s"] == 2.0
    assert rows["a"]["wait_from"] == 0.0 and rows["a"]["start"] == pytest.approx(0.1)
    assert rows["a"]["first_segment"] == pytest.approx(0.3) and rows["a"]["segments"] == 2
    assert rows["a -> b"]["start"] == pytest.approx(0.3) and rows["a -> b"]["end"] == pytest.approx(0.5)
    assert rows["b"]["wait_from"] == pytest.approx(0.3)
    whole = timeline(job, events, [{"from": "a", "to": "b", "window": 0}])
    assert {r["name"]: r for r in whole["rows"]}["a -> b"]["start"] == pytest.approx(1.0)
    text = waterfall(doc, 80)
    assert text.splitlines()[0] == f"job j1  p  succeeded  2.00s  trace {'ab' * 16}"
    assert all(len(line) <= 80 for line in text.splitlines()[:-1])


def test_a_span_made_whole_is_what_the_receiver_decodes(spans: Any) -> None:
    """`record` builds the SDK span itself: ids, parent, kind, status, resource, events and
    attributes (None left out, other values as text) survive OTLP's encoding."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    tracing, memory = spans
    job = tracing.ref({"traceparent": PARENT, "tracestate": "k=v"})
    tracing.record(job, "omnid.job", 1_000, 5_000, {"omnid.timeout_s": None, "omnid.path": Path("/x"), "n": 3},
                   [("cancel", 4_000, {"omnid.reason": "asked", "none": None})], error="cancelled: asked", server=True)
    (span,) = memory.get_finished_spans()
    req = ExportTraceServiceRequest()
    req.ParseFromString(encode_spans([span]).SerializeToString())
    (rs,) = req.resource_spans
    assert {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"] == "t"
    (got,) = rs.scope_spans[0].spans
    assert got.trace_id.hex() == trace_id_of(PARENT) and got.parent_span_id.hex() == "00f067aa0ba902b7"
    assert got.span_id == job.span_id.to_bytes(8, "big") and got.trace_state == "k=v"
    assert (got.start_time_unix_nano, got.end_time_unix_nano, got.kind) == (1_000, 5_000, 2)     # SERVER
    assert got.status.code == 2 and got.status.message == "cancelled: asked"                     # ERROR
    assert {a.key: (a.value.string_value or a.value.int_value) for a in got.attributes} == {"omnid.path": "/x", "n": 3}
    assert [(e.name, e.time_unix_nano, [a.key for a in e.attributes]) for e in got.events] == \
        [("cancel", 4_000, ["omnid.reason"])]


def test_a_trace_not_sampled_makes_no_span() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    tracing = Tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample=0.0, service_name="t"), "t", export=False)
    memory = InMemorySpanExporter()
    tracing.add_processor(SimpleSpanProcessor(memory))
    try:
        root = tracing.ref(None)
        assert not root.sampled
        tracing.record(root, "omnid.job", 1, 2)
        tracing.record(tracing.ref(root), "queued", 1, 2)
        kept = tracing.ref({"traceparent": PARENT})                  # a caller's sampled trace is followed
        tracing.record(kept, "omnid.job", 1, 2)
        assert [s.name for s in memory.get_finished_spans()] == ["omnid.job"]
        assert memory.get_finished_spans()[0].context.trace_id == int(trace_id_of(PARENT) or "0", 16)
    finally:
        tracing.shutdown()


_LIBRARY_SPAN = """
import logging, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from omnid.config_types import TracingConfig
from omnid.tracing import Tracing

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="LOG %(message)s")
tracing = Tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9", service_name="t"), "t:think", export=False)
memory = InMemorySpanExporter()
tracing.add_processor(SimpleSpanProcessor(memory))
tracing.install_global()
trace.set_tracer_provider(TracerProvider())          # a library's own, later (vLLM's): refused, quietly
context = TraceContextTextMapPropagator().extract({"traceparent": sys.argv[1]})
span = trace.get_tracer("vllm.tracing.otel").start_span("llm_request", context=context, kind=trace.SpanKind.SERVER)
span.set_attributes({"gen_ai.usage.completion_tokens": 8})
span.end()
(made,) = memory.get_finished_spans()
print("SPAN", made.name, f"{made.context.trace_id:032x}", f"{made.parent.span_id:016x}",
      made.resource.attributes["service.name"], made.instrumentation_scope.name, made.kind.name,
      made.attributes["gen_ai.usage.completion_tokens"])
tracing.shutdown()
"""


def test_a_librarys_spans_go_out_through_the_process_exporter() -> None:
    """`install_global` (a vLLM stage's worker): a library's span made through the OpenTelemetry API
    reaches omnid's own processor, under its parent, with the worker's resource; the library's own
    provider, set later, is refused without a warning. In a process of its own (the API's provider
    is set once a process)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _LIBRARY_SPAN, PARENT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    _, trace_hex, parent_hex, _ = PARENT.split("-")
    (made,) = [line for line in done.stdout.splitlines() if line.startswith("SPAN")]
    assert made == f"SPAN llm_request {trace_hex} {parent_hex} t:think vllm.tracing.otel SERVER 8"
    assert "LOG" not in done.stdout, done.stdout


@pytest.mark.parametrize("cut", [False, True])
def test_the_exporter_process_ends_when_its_input_does(cut: bool) -> None:
    """`python -m omnid.tracing_export`: its process gone (stdin closed, even in the middle of a
    batch), the exporter sends what it has and ends, rather than reading an empty pipe forever."""
    import pickle
    import struct
    import subprocess
    import sys
    spec = {"url": "http://127.0.0.1:9/v1/traces", "resource": {"service.name": "t"}, "log": ["warning", "text", "t"]}
    proc = subprocess.Popen([sys.executable, "-m", "omnid.tracing_export", json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdin is not None
        span = (1, 2, None, False, None, "omnid.job", 1, 2, {}, [], None, 0, None)
        batch = pickle.dumps([span])
        proc.stdin.write(struct.pack("!I", len(batch)) + (batch[:5] if cut else batch))
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_a_new_trace_is_sampled_at_the_configured_rate_as_the_sdk_decides(rate: float) -> None:
    """A job without a caller's trace is a new trace, kept as `TraceIdRatioBased(sample)` keeps it:
    the same decision for every id (no run is left to chance), and so the configured share of them."""
    import random

    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
    sdk = TraceIdRatioBased(rate)
    tracing = Tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample=rate, service_name="t"), "t",
                      export=False)
    state = random.getstate()
    random.seed(48)
    try:
        refs = [tracing.ref(None) for _ in range(4000)]
    finally:
        random.setstate(state)
    for ref in refs:
        kept = sdk.should_sample(None, ref.trace_id, "omnid.job").decision is Decision.RECORD_AND_SAMPLE
        assert ref.sampled is kept and ref.parent_id is None, (rate, ref)
    share = sum(r.sampled for r in refs) / len(refs)
    assert abs(share - rate) < 0.03, (rate, share)
    assert tracing._bound == TraceIdRatioBased.get_bound_for_rate(rate)       # the bound itself, exactly


def test_span_refs_under_a_carrier_a_span_or_nothing(spans: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from omnid.tracing import SpanRef

    tracing, memory = spans
    random.seed(48)
    refs = [tracing.ref(None) for _ in range(40)]
    assert all(0 < r.span_id < 2**64 and 0 < r.trace_id < 2**128 for r in refs)
    assert len({r.span_id for r in refs}) == len({r.trace_id for r in refs}) == 40
    assert all(r.parent_id is None and r.sampled and not r.remote and r.tracestate is None for r in refs)
    remote = tracing.ref({"traceparent": PARENT, "tracestate": "k=v"})
    assert (remote.trace_id, remote.parent_id, remote.sampled, remote.remote, remote.tracestate) == (
        int(trace_id_of(PARENT) or "", 16), 0x00F067AA0BA902B7, True, True, "k=v")
    child = tracing.ref(remote)
    assert child == SpanRef(remote.trace_id, child.span_id, remote.span_id, True, False, "k=v")
    assert child.span_id != remote.span_id
    for flags, sampled in (("00", False), ("01", True), ("10", False), ("03", True)):
        assert tracing.ref({"traceparent": PARENT[:-2] + flags}).sampled is sampled, flags
    assert tracing.ref({"tracestate": "k=v"}).parent_id is None and tracing.ref({}).remote is False
    # a draw of 0 is no id (OpenTelemetry's invalid one)
    monkeypatch.setattr(random, "getrandbits", lambda bits: 0)
    zero = tracing.ref(None)
    assert (zero.trace_id, zero.span_id) == (1, 1)
    # the sample bound: the trace id's low 64 bits below sample x 2^64 are kept
    half = Tracing(TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample=0.5, service_name="t"), "t", export=False)
    monkeypatch.setattr(random, "getrandbits", lambda bits: (1 << 64) | (1 << 63) if bits == 128 else 5)
    assert half.ref(None).sampled is False
    monkeypatch.setattr(random, "getrandbits", lambda bits: (1 << 64) | ((1 << 63) - 1) if bits == 128 else 5)
    assert half.ref(None).sampled is True
    half.shutdown()
    tracing.record(child, "inner", 1, 2)
    (span,) = memory.get_finished_spans()
    assert span.kind.name == "INTERNAL"


def test_trace_headers_bounds() -> None:
    assert trace_headers(PARENT, "x" * 512) == {"traceparent": PARENT, "tracestate": "x" * 512}
    assert trace_headers(PARENT, " k=v ") == {"traceparent": PARENT, "tracestate": "k=v"}
    assert trace_headers(PARENT, "") == {"traceparent": PARENT}
    assert trace_id_of(None) is None and trace_id_of("garbage") is None
