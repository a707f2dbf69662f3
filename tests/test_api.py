"""The socket API under bad input, and job ownership by the caller's uid.

Malformed requests are sent as raw HTTP (and raw bytes) over the daemon's real
Unix socket; after each batch the daemon must still answer health and run a
job. Ownership is checked with a real second uid: a forked child drops to
uid 65534 (nobody) and talks to the same socket, so SO_PEERCRED sees it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import RunningDaemon, py_stage, report_from_a_child, wait_for, wait_started

from omnictl.client import ApiError, Client, UnixHTTPConnection

NOBODY = 65534
MAX_BODY = 4096


def request(d: RunningDaemon, method: str, path: str, body: bytes | str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    """One raw HTTP request: (status, content type, body as JSON, or text if it is not JSON)."""
    conn = UnixHTTPConnection(str(d.socket), timeout=10)
    try:
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type") or ""
    finally:
        conn.close()
    try:
        return resp.status, ctype, json.loads(raw)
    except ValueError:
        return resp.status, ctype, raw.decode(errors="replace")


def assert_error(answer: tuple[int, str, Any], status: int, code: str, *words: str) -> None:
    got_status, ctype, body = answer
    assert got_status == status, answer
    assert ctype.startswith("application/json"), answer
    assert isinstance(body, dict) and body["error"]["code"] == code, answer
    message = body["error"]["message"]
    assert isinstance(message, str) and message, answer
    for w in words:
        assert w in message, (w, answer)


def still_serving(d: RunningDaemon) -> None:
    assert d.proc.poll() is None, d.log()[-3000:]
    assert d.client.health()["status"] == "ok"
    doc = d.wait(d.submit("p", {"text": "still here"}), timeout=30)
    assert doc["state"] == "succeeded", doc


@pytest.fixture
def daemon(start_daemon: Callable[..., RunningDaemon]) -> RunningDaemon:
    return start_daemon({"s": py_stage("echo"), "other": py_stage("echo")},
                        {"p": {"stages": ["s"]}}, {"max_request_bytes": MAX_BODY})


def submit_body(**fields: Any) -> str:
    return json.dumps({"pipeline": "p", "inputs": {"text": "x"}, **fields})


# ------------------------------------------------------------------ malformed requests


def test_bad_job_submissions_are_refused(daemon: RunningDaemon) -> None:
    d = daemon

    def post(body: bytes | str) -> tuple[int, str, Any]:
        return request(d, "POST", "/v1/jobs", body)

    assert_error(post("{not json"), 400, "bad_json")
    assert_error(post(b"\xff\xfe\x00garbage"), 400, "bad_json")
    assert_error(post(""), 400, "bad_json")
    assert_error(post("[" * 2000 + "]" * 2000), 400, "bad_json")          # nested past the recursion limit
    assert_error(post('[{"pipeline": "p"}]'), 400, "invalid_request", "object")
    assert_error(post('"p"'), 400, "invalid_request")
    assert_error(post(submit_body(colour="red")), 400, "invalid_request", "colour")
    assert_error(post(json.dumps({"inputs": {}})), 400, "invalid_request", "pipeline")
    assert_error(post(json.dumps({"pipeline": 7})), 400, "invalid_request", "pipeline")
    assert_error(post(submit_body(pipeline="nope")), 400, "unknown_pipeline", "nope")
    # inputs
    assert_error(post(submit_body(inputs=[1, 2])), 400, "invalid_request", "inputs")
    assert_error(post(submit_body(inputs={"x": {"deep": {"er": 1}}})), 400, "invalid_input", "'x'")
    assert_error(post(submit_body(inputs={"x": [[1]]})), 400, "invalid_input")
    assert_error(post(submit_body(inputs={"": "empty name"})), 400, "invalid_input")
    assert_error(post(submit_body(inputs={"f": {"b64": "not base64!!", "filename": "a.bin"}})),
                 400, "invalid_input", "base64")
    assert_error(post(submit_body(inputs={"f": {"b64": 12}})), 400, "invalid_input")
    # params
    assert_error(post(submit_body(params={"other": {"tag": "t"}})), 400, "invalid_param", "other")
    assert_error(post(submit_body(params={"nope": {}})), 400, "invalid_param", "nope")
    assert_error(post(submit_body(params={"s": {"tag": {"nested": 1}}})), 400, "invalid_param", "params.s.tag")
    assert_error(post(submit_body(params={"s": {"tag": [{"a": 1}]}})), 400, "invalid_param")
    assert_error(post(submit_body(params={"s": "tag=t"})), 400, "invalid_param")
    assert_error(post(submit_body(params=["s"])), 400, "invalid_request", "params")
    # timeout_s
    for bad in (-1, 0, "10", True, [5], 10 ** 400, 1e9):
        assert_error(post(submit_body(timeout_s=bad)), 400, "invalid_request", "timeout_s")
    for constant in ("NaN", "Infinity", "-Infinity"):           # Python's json would take them
        assert_error(post(submit_body()[:-1] + f', "timeout_s": {constant}}}'), 400, "bad_json", constant)
    assert_error(post(submit_body()[:-1] + ', "inputs": {"n": NaN}}'), 400, "bad_json")
    # too large
    big = submit_body(inputs={"text": "x" * (2 * MAX_BODY)})
    assert_error(post(big), 413, "too_large", str(MAX_BODY))
    # Nothing of the above became a job.
    assert d.client.jobs()["jobs"] == []
    still_serving(d)


def test_a_201_is_small_whatever_the_job_was_given(start_daemon: Callable[..., RunningDaemon]) -> None:
    """A 20 MB prompt and a list of a million numbers (the default 64 MiB body limit takes both) are
    taken, and neither comes back: the 201 and the job document carry a summary, and the 201 the
    job's paths."""
    d = start_daemon({"s": py_stage("count", defaults={"n": 1, "delay": 0})}, {"p": {"stages": ["s"]}})
    body = json.dumps({"pipeline": "p", "inputs": {"prompt": "x " * 10_000_000, "values": list(range(1_000_000))}})
    status, _, doc = request(d, "POST", "/v1/jobs", body)
    assert status == 201, str(doc)[:500]
    assert len(json.dumps(doc)) < 4096, len(json.dumps(doc))
    job = doc["id"]
    assert doc["state"] in ("queued", "running", "succeeded")
    assert doc["links"] == {"self": f"/v1/jobs/{job}", "events": f"/v1/jobs/{job}/events",
                            "cancel": f"/v1/jobs/{job}/cancel", "outputs": f"/v1/jobs/{job}/outputs"}
    assert doc["inputs"]["prompt"].endswith("... (20000000 characters)")
    assert doc["inputs"]["values"] == "[a list of 1000000 values, 6888891 bytes of JSON]"
    assert d.wait(job, timeout=60)["state"] == "succeeded"
    status, _, doc = request(d, "GET", f"/v1/jobs/{job}")
    assert status == 200 and len(json.dumps(doc)) < 4096, doc
    # A short list is shown whole.
    status, _, doc = request(d, "POST", "/v1/jobs", json.dumps({"pipeline": "p", "inputs": {"values": [1, 2, 3]}}))
    assert status == 201 and doc["inputs"]["values"] == [1, 2, 3]


def test_bad_routes_methods_and_queries(daemon: RunningDaemon) -> None:
    d = daemon
    assert_error(request(d, "GET", "/v2/jobs"), 404, "not_found", "/v2/jobs")
    assert_error(request(d, "GET", "/"), 404, "not_found")
    assert_error(request(d, "PUT", "/v1/jobs"), 405, "method_not_allowed", "PUT")
    assert_error(request(d, "DELETE", "/v1/health"), 405, "method_not_allowed")
    assert_error(request(d, "POST", "/v1/stages", "{}"), 405, "method_not_allowed")
    for path in ("/v1/jobs/0123456789ab", "/v1/jobs/0123456789ab/events", "/v1/jobs/zzzz/outputs/text",
                 "/v1/jobs/%2e%2e"):
        assert_error(request(d, "GET", path), 404, "unknown_job")
    assert_error(request(d, "POST", "/v1/jobs/0123456789ab/cancel"), 404, "unknown_job")
    assert_error(request(d, "DELETE", "/v1/jobs/0123456789ab"), 404, "unknown_job")
    assert_error(request(d, "GET", "/v1/jobs?state=bogus"), 400, "invalid_request", "state")
    for limit in ("abc", "0", "-3", "100000", "1.5", "9" * 5000):
        assert_error(request(d, "GET", f"/v1/jobs?limit={limit}"), 400, "invalid_request", "limit")
    status, _, body = request(d, "GET", "/v1/jobs?state=queued&limit=5&pipeline=nope")
    assert status == 200 and body == {"jobs": []}
    still_serving(d)


def test_raw_garbage_on_the_socket(daemon: RunningDaemon) -> None:
    d = daemon

    def raw(data: bytes, close_early: bool = False) -> bytes:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(d.socket))
        try:
            s.sendall(data)
            if close_early:
                return b""
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out
        finally:
            s.close()

    # Not HTTP at all: answered 400 (or just closed), never a crash.
    for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
                 b"\x00" * 1000, b"HELLO omnid\r\n\r\n", b"GET\r\n\r\n",
                 b"GET /v1/health HTTP/9.9\r\n\r\n",
                 b"POST /v1/jobs HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                 b"POST /v1/jobs HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n"):
        answer = raw(junk)
        assert answer == b"" or answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0], answer[:200]
    # Half a request, then gone; and a client that connects and says nothing.
    raw(b"POST /v1/jobs HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pipe", close_early=True)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(str(d.socket))
    try:
        still_serving(d)                        # served while the idle connection is open
    finally:
        idle.close()
    # Only the good job of still_serving became a job; the half request did not.
    assert len(d.client.jobs()["jobs"]) == 1


# ------------------------------------------------------------------ ownership (SO_PEERCRED)


def _as_nobody(socket_path: str, root_job: str, conn: Any) -> None:
    """Runs in a forked child that has dropped to uid/gid 65534; reports what it saw."""
    out: dict[str, Any] = {}
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        c = Client(socket_path, timeout=10)

        def attempt(name: str, fn: Callable[[], Any]) -> None:
            try:
                out[name] = ("ok", fn())
            except ApiError as e:
                out[name] = (e.status, e.code)

        out["uid"] = os.getuid()
        attempt("list_before", lambda: c.jobs()["jobs"])
        attempt("get", lambda: c.job(root_job))
        attempt("events", lambda: list(c.events(root_job)))
        attempt("output", lambda: c.output(root_job, "text"))
        attempt("cancel", lambda: c.cancel(root_job))
        attempt("delete", lambda: c.delete(root_job))
        own = c.submit("p", {"text": "mine"})
        out["own_id"] = own["id"]
        out["own_owner"] = own["owner_uid"]
        final = c.wait(own["id"])
        out["own_state"] = final["state"]
        attempt("own_output", lambda: c.output(own["id"], "text")[0].decode())
        attempt("list_after", lambda: [j["id"] for j in c.jobs()["jobs"]])
    except BaseException as e:                   # report, never hang the parent
        out["crash"] = f"{type(e).__name__}: {e}"
    conn.send(out)
    conn.close()


def test_jobs_belong_to_their_uid(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": py_stage("sleep", defaults={"seconds": 0.05}), "long": py_stage("sleep")},
                     {"p": {"stages": ["s"]}, "slow": {"stages": ["long"]}}, {"socket_mode": "0666"})
    os.chmod(d.dir, 0o755)                      # the socket's folder must be traversable by nobody
    assert oct(os.stat(d.socket).st_mode & 0o777) == "0o666"
    root_job = d.submit("slow", {"text": "root's"}, params={"long": {"seconds": 30}})
    wait_started(d, root_job, "long")

    seen = report_from_a_child(_as_nobody, str(d.socket), root_job, timeout=60, what="the uid-65534 client")
    assert "crash" not in seen, seen
    assert seen["uid"] == NOBODY
    assert seen["list_before"] == ("ok", [])
    for op in ("get", "events", "output", "cancel", "delete"):
        assert seen[op] == (403, "not_yours"), (op, seen[op])
    assert seen["own_owner"] == NOBODY and seen["own_state"] == "succeeded", seen
    assert seen["own_output"] == ("ok", "mine|s")
    assert seen["list_after"] == ("ok", [seen["own_id"]])

    # Root's job was not touched by the refused cancel and delete ...
    doc = d.client.job(root_job)
    assert doc["state"] == "running" and doc["owner_uid"] == 0
    # ... and root sees and may read every job.
    ids = [j["id"] for j in d.client.jobs()["jobs"]]
    assert set(ids) == {root_job, seen["own_id"]}
    theirs = d.client.job(seen["own_id"])
    assert theirs["owner_uid"] == NOBODY and theirs["state"] == "succeeded"
    assert d.client.output(seen["own_id"], "text")[0] == b"mine|s"
    assert d.client.cancel(root_job)["state"] == "cancelled"
    assert d.client.delete(seen["own_id"]) == {"deleted": seen["own_id"]}    # root may delete theirs
    started = time.monotonic()
    assert d.wait(d.submit("p", {"text": "x"}))["state"] == "succeeded"
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ metrics


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition: {(name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \d+)?', line)
        assert m, f"not a sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def sample(all_samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in all_samples, f"no sample {name}{labels} in /metrics; it has " + \
        ", ".join(sorted({n for n, _ in all_samples if n.startswith(name.rsplit("_", 1)[0])}))
    return all_samples[key]


def test_metrics_count_jobs_and_stage_events(start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"s": py_stage("sleep", defaults={"seconds": 0.05}, queue_capacity=3),
                      "bad": py_stage("fail"), "victim": py_stage("echo"), "doomed": py_stage("echo")},
                     {"p": {"stages": ["s"]}, "f": {"stages": ["bad"]}, "v": {"stages": ["victim"]},
                      "x": {"stages": ["doomed"]}},
                     {"max_restarts": 1, "restart_backoff_s": 0.1})
    # jobs: two succeed and one is cancelled on p, one fails on f
    for text in ("one", "two"):
        assert d.wait(d.submit("p", {"text": text}))["state"] == "succeeded"
    long = d.submit("p", params={"s": {"seconds": 30}})
    wait_started(d, long, "s")
    assert d.client.cancel(long)["state"] == "cancelled"
    assert d.wait(d.submit("f"))["state"] == "failed"
    # stages: victim is killed once (restarted); doomed twice (max_restarts = 1: failed)
    pid = d.stage_pid("victim")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (s := d.stages()["victim"])["state"] == "ready" and s["pid"] not in (None, pid), 20,
             "victim to be restarted")
    pid = d.stage_pid("doomed")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (s := d.stages()["doomed"])["state"] == "ready" and s["pid"] not in (None, pid), 20,
             "doomed to be restarted")
    os.kill(d.stage_pid("doomed"), signal.SIGKILL)
    d.wait_stage_state("doomed", ("failed",), timeout=20)
    with pytest.raises(ApiError):
        d.submit("x")                                    # refused with 503: not a submitted job
    # a job the worker stopped reaches the counters only when it has left the worker
    wait_for(lambda: d.stages()["s"]["running"] == [], 5, "s to be idle")

    m = samples(d.client.metrics())
    assert sample(m, "omnid_jobs_submitted_total", pipeline="p") == 3
    assert sample(m, "omnid_jobs_submitted_total", pipeline="f") == 1
    assert ("omnid_jobs_submitted_total", frozenset({("pipeline", "x")})) not in m
    assert sample(m, "omnid_jobs_finished_total", pipeline="p", state="succeeded") == 2
    assert sample(m, "omnid_jobs_finished_total", pipeline="p", state="cancelled") == 1
    assert sample(m, "omnid_jobs_finished_total", pipeline="f", state="failed") == 1
    finished = {dict(labels)["state"] for name, labels in m if name == "omnid_jobs_finished_total"
                and dict(labels)["pipeline"] == "p"}
    assert finished == {"succeeded", "cancelled"}, finished
    assert sample(m, "omnid_job_duration_seconds_count", pipeline="p") == 3
    assert sample(m, "omnid_job_duration_seconds_count", pipeline="f") == 1
    assert 0 < sample(m, "omnid_job_duration_seconds_sum", pipeline="p") < 30
    assert sample(m, "omnid_stage_jobs_done_total", stage="s", replica="0") == 2          # the cancelled one is not done
    assert sample(m, "omnid_stage_jobs_done_total", stage="bad", replica="0") == 0
    assert sample(m, "omnid_stage_restarts_total", stage="victim", replica="0") == 1
    assert sample(m, "omnid_stage_restarts_total", stage="doomed", replica="0") == 1
    assert sample(m, "omnid_stage_restarts_total", stage="s", replica="0") == 0
    for stage, up in (("s", 1), ("bad", 1), ("victim", 1), ("doomed", 0)):
        assert sample(m, "omnid_stage_up", stage=stage, replica="0") == up, stage
    assert sample(m, "omnid_stage_queue_capacity", stage="s", replica="0") == 3
    assert sample(m, "omnid_stage_queue_capacity", stage="bad", replica="0") == d.stages()["bad"]["queue_capacity"]
    assert sample(m, "omnid_stage_queue_depth", stage="s", replica="0") == 0
