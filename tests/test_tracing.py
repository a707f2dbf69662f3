"""OpenTelemetry traces (`[daemon] tracing`) with real daemons and a real OTLP/HTTP receiver.

The receiver is an aiohttp app on a port of 127.0.0.1 in this test process, decoding what it is
sent with opentelemetry-proto's `ExportTraceServiceRequest` (no collector binary can be installed
here). One daemon with tracing on (one tiny vLLM stage and cheap python stages) serves the traced
tests; a second, python-only one with tracing off shows that nothing is exported and that its
supervisor never imports OpenTelemetry nor runs an exporter thread. Both run under a probe (a thread
in the daemon's own process that writes down its threads and OpenTelemetry modules).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import (
    LOG_TAIL,
    RunningDaemon,
    build_tiny_models,
    daemon_config,
    omnictl,
    py_stage,
    short_tmpdir,
    sigint_default,
    sleeper,
    stop_and_check,
    tiny_llm,
    wait_for,
    wait_ready,
    wait_started,
)

httpx = pytest.importorskip("httpx")
web = pytest.importorskip("aiohttp.web")
trace_pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

pytestmark = pytest.mark.vllm       # the traced daemon's `think` stage is vLLM (its request span under the stage's)

STREAM_DIR = str(Path(__file__).resolve().parent / "fixtures")
ROOT_DIR = str(Path(__file__).resolve().parent.parent)

# Runs omnid as `python -m omnid` does, in this process, with a thread that writes down, every 0.1 s,
# the process's threads and the OpenTelemetry modules it imported (argv: the file, then omnid's own).
PROBE_SOURCE = f"""
import json, os, runpy, sys, threading, time
sys.path.insert(0, {ROOT_DIR!r})
out = sys.argv[1]

def probe():
    while True:
        doc = {{"modules": sorted(m for m in list(sys.modules) if m.startswith("opentelemetry")),
               "threads": sorted(t.name for t in threading.enumerate())}}
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(out + ".tmp", out)
        time.sleep(0.1)

threading.Thread(target=probe, name="test-probe", daemon=True).start()
sys.argv = ["omnid", *sys.argv[2:]]
runpy.run_module("omnid", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------ the receiver


class Receiver:
    """An OTLP/HTTP trace receiver (POST /v1/traces, protobuf) in a thread of its own; `stop` and
    `start` again on the same port (a collector that goes down and comes back)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        threading.Thread(target=self._loop.run_forever, name="otlp-receiver", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        req = trace_pb.ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append({
                        "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex() or None, "name": s.name,
                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "events": [{"name": e.name, "ts": e.time_unix_nano,
                                    "attrs": {a.key: _value(a.value) for a in e.attributes}} for e in s.events],
                        "status": s.status.code, "service": resource.get("service.name"),
                        "pid": resource.get("process.pid") or resource.get("vllm.process_id")})
        with self._lock:
            self.spans.extend(got)
            self.requests += 1
        return web.Response(body=trace_pb.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def start(self) -> None:
        async def go() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", self._traces)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        asyncio.run_coroutine_threadsafe(go(), self._loop).result(10)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None

    def of(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30) -> dict[str, list[dict[str, Any]]]:
        """The trace's spans by name, once every one of `names` has come."""
        def complete() -> dict[str, list[dict[str, Any]]] | None:
            by: dict[str, list[dict[str, Any]]] = {}
            for s in self.of(trace_id):
                by.setdefault(s["name"], []).append(s)
            return by if names <= set(by) else None
        try:
            return wait_for(complete, timeout, f"spans {sorted(names)} of trace {trace_id}", every=0.1)
        except AssertionError:
            raise AssertionError(f"got only {sorted({s['name'] for s in self.of(trace_id)})} of trace {trace_id}; "
                                 f"wanted {sorted(names)}") from None


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


# ------------------------------------------------------------------------------ daemons under a probe


def launch_probed(d: Path, stages: dict[str, Any], pipelines: dict[str, Any],
                  daemon: dict[str, Any]) -> RunningDaemon:
    """A daemon started as `python -m omnid` is, with a probe thread in its process (`<d>/probe.json`)."""
    cfg = daemon_config(d, stages, pipelines, daemon)
    probe = d / "probe.py"
    probe.write_text(PROBE_SOURCE)
    log_path = d / "omnid.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, str(probe), str(d / "probe.json"), "-c", str(cfg)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(d), preexec_fn=sigint_default,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rd = RunningDaemon(proc, d, cfg, d / "omnid.sock", d / "state", d / "lock", log_path)
    wait_ready(rd, timeout=300)
    return rd


def probe(d: RunningDaemon) -> dict[str, Any]:
    return wait_for(lambda: _read_json(d.dir / "probe.json"), 10, "the daemon's probe")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


STAGES = {
    "think": tiny_llm({"max_tokens": 8, "temperature": 0.0}, max_model_len=256),
    "shout": {"engine": "python", "function": "streamstages:shout", "python_path": [STREAM_DIR]},
    "join": py_stage("stream_join"),
    "echo": py_stage("echo"),
    "nap": sleeper(30.0),
}
PIPELINES = {
    "story": {"stages": ["think", "shout", "join"],
              "edges": [{"from": "think", "to": "shout", "window": 2, "map": {"text": "text"}},
                        {"from": "shout", "to": "join", "window": 1, "map": {"text": "text"}}]},
    "chat": {"stages": ["think"]},
    "echo": {"stages": ["echo"]},
    "nap": {"stages": ["nap"]},
}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver(free_port())
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced(receiver: Receiver) -> Iterator[RunningDaemon]:
    build_tiny_models("llm")
    d = short_tmpdir()
    port = free_port()
    rd = launch_probed(d, STAGES, PIPELINES, {
        "tracing": {"otlp_endpoint": receiver.url, "sample": 1.0, "service_name": "omnid-test"},
        "listen": [f"127.0.0.1:{port}"], "heartbeat_timeout_s": 60.0})
    rd.tcp_port = port      # type: ignore[attr-defined]
    try:
        yield rd
    finally:
        problems = stop_and_check(rd)
        shutil.rmtree(d, ignore_errors=True)
        assert not problems, "\n".join(problems)


def socket_http(d: RunningDaemon) -> Any:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://omnid", timeout=60)


def new_parent() -> tuple[str, str, str]:
    """A caller's (traceparent, trace id, span id), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def wait_job(d: RunningDaemon, job: str, timeout: float = 120) -> dict[str, Any]:
    return wait_for(lambda: (j := d.client.job(job))["state"] in ("succeeded", "failed", "cancelled", "timed_out")
                    and j, timeout, f"job {job} to end", every=0.05)


# ------------------------------------------------------------------------------ the tests


def test_streamed_three_stage_job_is_one_trace_under_the_callers_span(traced: RunningDaemon,
                                                                       receiver: Receiver) -> None:
    parent, trace_id, caller_span = new_parent()
    with socket_http(traced) as http:
        r = http.post("/v1/jobs", json={"pipeline": "story", "inputs": {"prompt": "Once upon a time"}},
                      headers={"traceparent": parent, "tracestate": "vendor=1"})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["trace_id"] == trace_id                          # the answer names the caller's trace
    assert r.headers["traceresponse"].startswith(f"00-{trace_id}-")
    done = wait_job(traced, job["id"])
    assert done["state"] == "succeeded", (done["error"], traced.log_tail())
    by = receiver.wait_for(trace_id, {"omnid.job", "admission", "queued", "running", "stage think", "stage shout",
                                      "stage join", "waiting for input", "llm_request"})
    spans = receiver.of(trace_id)
    assert {s["trace_id"] for s in spans} == {trace_id}
    (root,) = by["omnid.job"]
    assert root["parent"] == caller_span                        # the caller's traceparent honoured
    assert root["attrs"]["omnid.job"] == job["id"] and root["attrs"]["omnid.outcome"] == "succeeded"
    assert r.headers["traceresponse"] == f"00-{trace_id}-{root['span_id']}-01"
    for name in ("admission", "queued", "running", "stage think", "stage shout", "stage join"):
        (s,) = by[name]
        assert s["parent"] == root["span_id"], name
        assert root["start"] <= s["start"] and s["end"] <= root["end"] + 50_000_000, name
    # each stage's own process exported its span
    stage_spans = {n: by[f"stage {n}"][0] for n in ("think", "shout", "join")}
    assert {s["service"] for s in stage_spans.values()} == {"omnid-test:think", "omnid-test:shout",
                                                           "omnid-test:join"}
    assert root["service"] == "omnid-test"
    assert len({s["pid"] for s in [root, *stage_spans.values()]}) == 4
    waits = {w["parent"] for w in by["waiting for input"]}
    assert waits == {s["span_id"] for s in stage_spans.values()}
    # the stream: windows into the downstream stages, first and last segments
    shout_events = [e["name"] for e in stage_spans["shout"]["events"]]
    assert "window in" in shout_events and "first segment" in shout_events and "last segment" in shout_events
    for src, dst in (("think", "shout"), ("shout", "join")):    # each edge's hand-off: during the stage or after it
        def handed_off() -> bool:
            after = [h for h in receiver.of(trace_id) if h["name"] == f"hand-off to {dst}"
                     and h["parent"] == stage_spans[src]["span_id"]]
            during = [e for e in stage_spans[src]["events"] if e["name"] == "handed off"]
            return len(after) + len(during) == 1
        wait_for(handed_off, 10, f"the hand-off {src} -> {dst} in the trace")
    join_windows = [e for e in stage_spans["join"]["events"] if e["name"] == "window in"]
    assert [e["attrs"]["omnid.window"] for e in join_windows] == list(range(len(join_windows)))
    assert join_windows[-1]["attrs"]["omnid.last"] is True and join_windows[0]["attrs"]["omnid.src"] == "shout"
    think_events = [e["name"] for e in stage_spans["think"]["events"]]
    assert "first segment" in think_events and "last segment" in think_events
    # the queued part ends where the running part starts; the stages run inside the job's running part
    (queued,), (running,) = by["queued"], by["running"]
    assert queued["end"] == running["start"]
    # vLLM's own request span hangs under the vLLM stage's span, inside it
    (llm,) = by["llm_request"]
    think = stage_spans["think"]
    assert llm["parent"] == think["span_id"]
    assert think["start"] - 50_000_000 <= llm["start"] and llm["end"] <= think["end"] + 50_000_000
    assert llm["attrs"].get("gen_ai.usage.completion_tokens") == 8
    # ... and goes out through the stage's own exporter (one per worker), not a provider of vLLM's
    assert (llm["service"], llm["pid"]) == (think["service"], think["pid"])


def test_openai_chat_over_tcp_joins_the_callers_trace(traced: RunningDaemon, receiver: Receiver) -> None:
    done = omnictl(traced, "key", "add", "tracer", "--uid", str(os.getuid()))
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip().splitlines()[-1]
    parent, trace_id, caller_span = new_parent()
    with httpx.Client(base_url=f"http://127.0.0.1:{traced.tcp_port}", timeout=60) as http:   # type: ignore[attr-defined]
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": "chat", "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
                         headers={"traceparent": parent, "Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["traceresponse"].startswith(f"00-{trace_id}-")
            body = "".join(r.iter_text())
    assert "[DONE]" in body
    by = receiver.wait_for(trace_id, {"omnid.job", "stage think", "llm_request"})
    (root,) = by["omnid.job"]
    assert root["parent"] == caller_span and root["attrs"]["omnid.pipeline"] == "chat"
    assert by["stage think"][0]["parent"] == root["span_id"]
    assert by["llm_request"][0]["parent"] == by["stage think"][0]["span_id"]


def test_a_cancelled_jobs_trace_ends_with_the_cancel(traced: RunningDaemon, receiver: Receiver) -> None:
    job = traced.submit("nap", {"text": "zzz"})
    wait_started(traced, job, "nap")
    traced.client.cancel(job)
    assert wait_job(traced, job)["state"] == "cancelled"
    events = traced.events(job)
    (queued,) = [e for e in events if e["type"] == "state" and e["state"] == "queued"]
    trace_id = queued["trace_id"]
    by = receiver.wait_for(trace_id, {"omnid.job", "stage nap"})
    (root,) = by["omnid.job"]
    assert root["parent"] is None               # no caller's context: a trace of its own
    assert root["attrs"]["omnid.outcome"] == "cancelled"
    last = max(root["events"], key=lambda e: e["ts"])
    assert last["name"] == "cancel" and last["attrs"]["omnid.reason"] == "cancelled by request"
    assert last["ts"] == root["end"]                # the job's trace ends with its cancel
    assert "cancel" in [e["name"] for e in by["stage nap"][0]["events"]]     # the stage heard it too


def test_omnictl_trace_draws_the_waterfall(traced: RunningDaemon) -> None:
    job = traced.submit("story", {"prompt": "A song"})
    assert wait_job(traced, job)["state"] == "succeeded"
    done = omnictl(traced, "trace", job, "--width", "100")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"job {job}  story  succeeded") and " trace " in lines[0]
    labels = [line.split()[0] for line in lines[2:-1]]
    assert labels == ["job", "think", "shout", "think", "join", "shout"], done.stdout   # stage, its edges in
    assert any("->" in line for line in lines) and "█" in done.stdout and "▌" in done.stdout
    doc = json.loads(omnictl(traced, "--json", "trace", job).stdout)
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {"job", "think", "shout", "join", "think -> shout", "shout -> join"}
    assert rows["think"]["segments"] >= 1 and 0 <= rows["think"]["start"] <= rows["think"]["end"]
    assert rows["think -> shout"]["start"] == rows["think"]["first_segment"]    # a streaming edge: its first window
    assert rows["shout"]["start"] <= rows["shout"]["end"] <= doc["duration_s"]
    missing = omnictl(traced, "trace", "0123456789ab")
    assert missing.returncode != 0 and "unknown_job" in missing.stderr, missing.stderr


def test_metrics_have_stage_waits_and_handoffs_with_trace_exemplars(traced: RunningDaemon) -> None:
    job = traced.submit("story", {"prompt": "Rain"})
    assert wait_job(traced, job)["state"] == "succeeded"
    with socket_http(traced) as http:
        text = http.get("/metrics").text
        om = http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    assert 'omnid_stage_queue_wait_seconds_count{stage="shout"}' in text
    assert 'omnid_edge_handoff_seconds_count{dst="shout",src="think"}' in text
    assert "# {trace_id=" not in text                       # the classic format has no exemplars
    exemplars = [line for line in om.splitlines() if line.startswith("omnid_stage_queue_wait_seconds_bucket")
                 and "# {trace_id=" in line]
    assert exemplars, om[:3000]


def test_a_receiver_that_is_down_costs_jobs_nothing(traced: RunningDaemon, receiver: Receiver) -> None:
    receiver.stop()
    try:
        for _ in range(3):
            job = traced.submit("echo", {"text": "hi"})
            assert wait_job(traced, job, timeout=30)["state"] == "succeeded"
        words = "the trace receiver is not taking spans"
        wait_for(lambda: words in traced.log(), 15, "the daemon to say the receiver is down", every=0.1)
        job = traced.submit("echo", {"text": "again"})
        assert wait_job(traced, job, timeout=30)["state"] == "succeeded"
        time.sleep(2.5)         # two more export rounds fail: still said once
        supervisor_lines = [line for line in traced.log().splitlines() if words in line and "stage" not in line]
        assert len(supervisor_lines) == 1, "\n".join(supervisor_lines)
    finally:
        receiver.start()
    # back: the next job's trace arrives
    parent, trace_id, _ = new_parent()
    with socket_http(traced) as http:
        r = http.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"text": "back"}}, headers={"traceparent": parent})
    assert wait_job(traced, r.json()["id"])["state"] == "succeeded"
    receiver.wait_for(trace_id, {"omnid.job", "stage echo"})


def test_tracing_on_runs_an_exporter_process_beside_the_supervisor(traced: RunningDaemon) -> None:
    """The supervisor hands its spans to an exporter process of its own (the encoding and the HTTP
    requests are not under its event loop's GIL); it imports no OpenTelemetry itself."""
    seen = probe(traced)
    assert "omnid-spans" in seen["threads"]
    assert seen["modules"] == [], seen["modules"]
    exporters = [p for p in psutil.Process(traced.proc.pid).children()
                 if "omnid.tracing_export" in " ".join(p.cmdline())]
    assert len(exporters) == 1, [p.cmdline() for p in psutil.Process(traced.proc.pid).children()]


def _exporters_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children() if "omnid.tracing_export" in " ".join(p.cmdline())]


def test_a_killed_workers_exporter_process_ends_with_it_and_the_new_one_traces(traced: RunningDaemon,
                                                                              receiver: Receiver) -> None:
    """Each traced worker has its exporter process; a worker killed by SIGKILL takes it along (its
    stdin closes: it sends what it has and ends), and the worker started in its place traces."""
    def echo_worker() -> psutil.Process | None:
        found = [p for p in psutil.Process(traced.proc.pid).children(recursive=True)
                 if p.name().startswith("omnid:echo") and _exporters_of(p.pid)]
        return found[0] if len(found) == 1 else None
    worker = wait_for(echo_worker, 30, "the echo worker and its exporter")
    (exporter,) = _exporters_of(worker.pid)
    worker.kill()
    gone, _ = psutil.wait_procs([exporter], timeout=15)
    assert gone, f"the exporter {exporter.pid} outlived its killed worker"
    wait_ready(traced)
    new = wait_for(lambda: (w := echo_worker()) is not None and w.pid != worker.pid and w, 60, "the new echo worker")
    parent, trace_id, _ = new_parent()
    with socket_http(traced) as http:
        r = http.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"text": "again"}}, headers={"traceparent": parent})
    assert r.status_code == 201, r.text
    assert wait_job(traced, r.json()["id"])["state"] == "succeeded"
    (stage,) = receiver.wait_for(trace_id, {"stage echo"})["stage echo"]
    assert stage["pid"] == new.pid


def test_tracing_off_exports_nothing_and_imports_no_opentelemetry(receiver: Receiver) -> None:
    d = short_tmpdir()
    rd = launch_probed(d, {"echo": py_stage("echo")}, {"echo": {"stages": ["echo"]}}, {})
    try:
        parent, trace_id, _ = new_parent()
        with socket_http(rd) as http:
            r = http.post("/v1/jobs", json={"pipeline": "echo", "inputs": {"text": "quiet"}},
                          headers={"traceparent": parent})
        assert r.status_code == 201 and "traceresponse" not in r.headers and "trace_id" not in r.json()
        assert wait_job(rd, r.json()["id"])["state"] == "succeeded"
        events = rd.events(r.json()["id"])
        assert all("trace_id" not in e for e in events)
        seen = probe(rd)
        assert seen["modules"] == [], seen["modules"]
        assert not [t for t in seen["threads"] if "Otel" in t], seen["threads"]
        time.sleep(1.5)         # an exporter would have sent by now (every second)
        assert receiver.of(trace_id) == []
        assert not [s for s in receiver.spans if s["service"] and s["service"].split(":")[0] == "omnid"]
    finally:
        problems = stop_and_check(rd)
        log = rd.log()
        shutil.rmtree(d, ignore_errors=True)
        assert not problems, "\n".join(problems) + log[-LOG_TAIL:]


def test_no_collector_at_all_is_said_once_not_once_per_retry() -> None:
    """Tracing on, nothing listening at the endpoint, a vLLM stage whose engine core runs in a process
    of its own (omnid's default): vLLM's exporter there retries its start-up spans, and its retries
    log nothing; the daemon says the receiver is not taking spans at most once per exporting process,
    at warning level, never an error."""
    from conftest import module_daemon

    build_tiny_models("llm")
    nobody = f"http://127.0.0.1:{free_port()}"
    stages = {"think": tiny_llm({"max_tokens": 4, "temperature": 0.0}, max_model_len=256, engine_core="process")}
    with module_daemon(short_tmpdir(), stages, {"chat": {"stages": ["think"]}},
                       {"tracing": {"otlp_endpoint": nobody, "sample": 1.0}}) as d:
        job = d.submit("chat", {"prompt": "hello"})
        assert wait_job(d, job)["state"] == "succeeded"
        time.sleep(15)      # the exporters' retries (a backoff up to their 10 s timeout) run their course
        lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
        noisy = [e for e in lines if any(w in json.dumps(e) for w in ("Transient error", "Connection refused",
                                                                       "Failed to export"))]
        assert not noisy, "\n".join(json.dumps(e) for e in noisy)
        said = [e for e in lines if e.get("event") == "the trace receiver is not taking spans: they are dropped "
                "until it does (jobs are not slowed)"]
        assert said and all(e["level"] == "warning" for e in said), said
        by_process = [e.get("process") for e in said]
        assert len(by_process) == len(set(by_process)), said
        # vLLM's engine core (a process of its own, which relays its lines) says it once too
        relayed = [e for e in lines if e.get("event") in ("stderr", "stdout")
                   and "the trace receiver is not taking spans" in e.get("line", "")]
        assert len(relayed) == 1 and relayed[0]["level"] == "warning", relayed
        errors = [json.dumps(e) for e in lines if e.get("level") == "error"]
        assert not errors, "\n".join(errors)
