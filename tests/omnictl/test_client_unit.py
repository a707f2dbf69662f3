"""Unit tests of omnictl (library and CLI) against the fake daemon in fake_daemon.py.

Runs in the pytest process's main thread; the fake daemon serves from its own threads over a real
Unix socket. Tests block only on that socket, each bounded by the client's timeout or a gate's.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from fake_daemon import (
    ALSO_STATUS,
    ERROR_STATUS,
    REPO_ROOT,
    FakeDaemon,
    FakeHandler,
    daemon,  # noqa: F401  (the fixture)
    error_status,
)

from omnictl import ApiError, Client, ConnectionLost, DaemonUnreachable, default_socket_path
from omnictl.cli import cli, parse_param_value
from omnictl.client import JOB_STATES, TERMINAL_STATES
from omnictl.render import EventPrinter, final_state_line
from omnid.vocabulary import TERMINAL_JOB_STATES, ErrorCode, EventType, JobState, StageRunState, WorkerState

E = EventType

JOB_ID = "3f9c2a1b7d4e"
NOW = 1764430000.0


def make_job(state: JobState = JobState.QUEUED, **fields: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "id": JOB_ID,
        "pipeline": "t2i",
        "state": state,
        "owner_uid": 1000,
        "created_at": NOW,
        "started_at": NOW + 0.5 if state is not JobState.QUEUED else None,
        "finished_at": NOW + 4.7 if state.terminal else None,
        "timeout_s": 300.0,
        "inputs": {"prompt": "a red fox"},
        "params": {},
        "stages": {
            "expand": {"state": StageRunState.SUCCEEDED, "progress": {"done": 2, "total": 2}, "elapsed_s": 1.2,
                       "segments": 2},
            "draw": {"state": StageRunState.PENDING, "progress": None, "elapsed_s": None, "segments": 0},
        },
        "outputs": [],
        "error": None,
    }
    job.update(fields)
    return job


def event(event_type: EventType, /, **fields: Any) -> dict[str, Any]:
    return {"type": event_type, "job": JOB_ID, "ts": NOW + 1, **fields}


FAILED_ERROR = {"code": ErrorCode.STAGE_FAILED, "message": "CUDA out of memory", "stage": "draw"}
FAILED_EVENTS = [
    event(E.STATE, state=JobState.RUNNING),
    event(E.STAGE_STARTED, stage="expand"),
    event(E.SEGMENT, stage="expand", index=0, is_last=False, text="Hello"),
    event(E.SEGMENT, stage="expand", index=1, is_last=True, text=" world"),
    event(E.OUTPUT, stage="expand", name="text", kind="text", content_type="text/plain", file="text.txt"),
    event(E.STAGE_FINISHED, stage="expand", elapsed_s=1.2),
    event(E.STAGE_STARTED, stage="draw"),
    event(E.PROGRESS, stage="draw", done=1, total=20),
    event(E.PROGRESS, stage="draw", done=2, total=20),
    event(E.ERROR, stage="draw", message="CUDA out of memory", code=ErrorCode.STAGE_FAILED),
    event(E.STATE, state=JobState.FAILED, error=FAILED_ERROR),
]
TEXT_OUTPUT = {"name": "text", "file": "text.txt", "kind": "text", "content_type": "text/plain", "size": 11, "stage": "expand"}
IMAGE_OUTPUT = {"name": "image", "file": "image.png", "kind": "image", "content_type": "image/png", "size": 4, "stage": "draw"}

STAGES_DOC = {
    "stages": [
        {
            "name": "expand", "engine": "vllm", "state": WorkerState.READY, "pid": 4242, "devices": [0],
            "queue_depth": 1, "queue_capacity": 4, "jobs_done": 17, "restarts": 0, "rss_bytes": 3 * 1024**3,
            "cpu_percent": 12.5, "gpu_memory_bytes": None, "uptime_s": 3725.0, "load_s": 20.1, "last_error": None,
            "placement": "local", "node": None,
        },
        {
            "name": "draw", "engine": "diffusers", "state": WorkerState.FAILED, "pid": None, "devices": [],
            "queue_depth": 0, "queue_capacity": 4, "jobs_done": 3, "restarts": 2, "rss_bytes": None,
            "cpu_percent": None, "gpu_memory_bytes": None, "uptime_s": None, "load_s": None,
            "last_error": "RuntimeError: model directory missing",
            "placement": "ray", "node": "10.0.0.2", "ray": {"node_id": "97859021cc72", "node_ip": "10.0.0.2"},
        },
    ]
}
PIPELINES_DOC = {
    "pipelines": [
        {
            "name": "t2i", "stages": ["expand", "draw"], "timeout_s": 300,
            "edges": [{"from": "expand", "to": "draw", "window": -1, "map": {"prompt": "text"}, "transform": None}],
        }
    ]
}


def run_cli(daemon: FakeDaemon, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--socket", daemon.socket_path, *args], catch_exceptions=False)


def serve_failed_job(daemon: FakeDaemon) -> None:
    daemon.json("POST", "/v1/jobs", make_job(JobState.QUEUED), status=201)
    daemon.events(JOB_ID, FAILED_EVENTS)
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.FAILED, outputs=[TEXT_OUTPUT], error=FAILED_ERROR))
    daemon.bytes("GET", f"/v1/jobs/{JOB_ID}/outputs/text", b"Hello world", "text/plain")


# --- socket resolution ---------------------------------------------------------------------------


def test_socket_explicit_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNID_SOCKET", "/env/omnid.sock")
    assert default_socket_path("/explicit.sock") == "/explicit.sock"
    assert default_socket_path() == "/env/omnid.sock"
    assert Client().socket_path == "/env/omnid.sock"


def test_socket_root_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNID_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert default_socket_path() == "/run/omnid/omnid.sock"


def test_socket_user_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNID_SOCKET", "")  # empty counts as unset
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/tmp/xdg")
    assert default_socket_path() == "/tmp/xdg/omnid/omnid.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == "/run/user/1000/omnid/omnid.sock"


def test_cli_uses_env_socket(daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon.json("GET", "/v1/ready", {"ready": True, "stages": {}})
    monkeypatch.setenv("OMNID_SOCKET", daemon.socket_path)
    result = CliRunner().invoke(cli, ["health"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ready")


# --- errors and exit codes -----------------------------------------------------------------------


def test_missing_socket_is_unreachable(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.sock")
    with pytest.raises(DaemonUnreachable) as caught:
        Client(path).health()
    assert path in str(caught.value)
    result = CliRunner().invoke(cli, ["--socket", path, "status"])
    assert result.exit_code == 3
    assert path in result.stderr
    assert result.stdout == ""


def test_refused_socket_is_unreachable() -> None:
    # A bound socket nobody listens on refuses connections, like a daemon that died uncleanly.
    path = f"/tmp/omnictl-refused-{os.getpid()}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        with pytest.raises(DaemonUnreachable, match="refused"):
            Client(path).jobs()
        assert CliRunner().invoke(cli, ["--socket", path, "stages"]).exit_code == 3
    finally:
        sock.close()
        os.unlink(path)


def test_api_error_maps_to_exit_4_with_message(daemon: FakeDaemon) -> None:
    daemon.error("GET", "/v1/jobs/deadbeef", ErrorCode.UNKNOWN_JOB, "no job 'deadbeef'")
    with pytest.raises(ApiError) as caught:
        Client(daemon.socket_path).job("deadbeef")
    assert (caught.value.status, caught.value.code, caught.value.message) == (404, "unknown_job", "no job 'deadbeef'")
    assert caught.value.body == {"error": {"code": "unknown_job", "message": "no job 'deadbeef'"}}

    result = run_cli(daemon, "status", "deadbeef")
    assert result.exit_code == 4
    assert result.stderr == "omnictl: no job 'deadbeef' (unknown_job)\n"
    assert result.stdout == ""


# --- the fake speaks the daemon's vocabulary --------------------------------------------------------

# `Refused(404, "unknown_job", ...)` / `error(410, ErrorCode.OUTPUT_GONE, ...)` in the daemon's source.
_DAEMON_REFUSAL = re.compile(r"\b(?:Refused|error)\(\s*(\d{3}),\s*(?:\"([a-z_]+)\"|ErrorCode\.([A-Z_]+))")


def test_fake_answers_only_vocabulary_codes(daemon: FakeDaemon) -> None:
    # Every code the fake can answer: those it has a status for, and those it sends by itself.
    assert all(isinstance(code, ErrorCode) for code in ERROR_STATUS)
    client = Client(daemon.socket_path)
    for call in (lambda: client.job("nope"), lambda: client.cancel("nope"), lambda: client._json("GET", "/v1/nowhere")):
        with pytest.raises(ApiError) as caught:
            call()
        assert caught.value.code in set(ErrorCode)
    assert daemon.answered == [ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_JOB, ErrorCode.NOT_FOUND]
    # The old drifted words, and real words with a status the daemon never gives them, are refused.
    for drifted, status in (("job_not_found", 404), ("not_owner", 403), ("output_missing", 409)):
        for given in (None, status):
            with pytest.raises(ValueError, match="is not a valid ErrorCode"):
                daemon.error("GET", "/v1/jobs/x", drifted, "drifted", given)
    with pytest.raises(ValueError):
        error_status(ErrorCode.OUTPUT_GONE, 409)
    with pytest.raises(ValueError):
        daemon.json("GET", "/v1/jobs/x", {"error": {"code": "unknown_job", "message": "by hand"}}, status=404)
    # So are job states and event types the daemon does not have.
    with pytest.raises(ValueError):
        daemon.json("GET", f"/v1/jobs/{JOB_ID}", {**make_job(JobState.SUCCEEDED), "state": "done"})
    with pytest.raises(ValueError):
        daemon.events(JOB_ID, [event(E.STATE, state="finished")])
    with pytest.raises(ValueError):
        daemon.events(JOB_ID, [{"type": "log", "job": JOB_ID, "ts": NOW}])


def test_fake_statuses_are_the_daemons() -> None:
    """ERROR_STATUS is what omnid's source answers: same status for every code, in both directions."""
    found: dict[ErrorCode, set[int]] = {}
    for source in sorted((REPO_ROOT / "omnid").rglob("*.py")):
        for status, word, member in _DAEMON_REFUSAL.findall(source.read_text()):
            code = ErrorCode(word) if word else ErrorCode[member]   # the daemon speaks the vocabulary too
            found.setdefault(code, set()).add(int(status))
    assert ErrorCode.UNKNOWN_JOB in found, "found none of the daemon's refusals: update _DAEMON_REFUSAL"
    assert {code: {status, *ALSO_STATUS.get(code, ())} for code, status in ERROR_STATUS.items()} == found


def test_client_states_are_the_vocabularys() -> None:
    assert JOB_STATES == tuple(JobState)
    assert TERMINAL_STATES == TERMINAL_JOB_STATES


def test_queue_full_submit_is_refused(daemon: FakeDaemon) -> None:
    daemon.error("POST", "/v1/jobs", ErrorCode.QUEUE_FULL, "pipeline t2i has 256 queued jobs")
    result = run_cli(daemon, "submit", "t2i", "--prompt", "x")
    assert result.exit_code == 4
    assert "omnictl: pipeline t2i has 256 queued jobs (queue_full)" in result.stderr


def test_error_body_that_is_not_json(daemon: FakeDaemon) -> None:
    daemon.route("GET", "/v1/stages", lambda h: h.send_bytes(502, b"bad gateway", "text/plain"))
    with pytest.raises(ApiError) as caught:
        Client(daemon.socket_path).stages()
    assert (caught.value.status, caught.value.code, caught.value.message) == (502, "http_502", "bad gateway")


@pytest.mark.parametrize(
    "args",
    [
        ["--param", "steps=20"],  # no stage
        ["--param", "draw.steps"],  # no value
        ["--param", ".steps=1"],  # empty stage
        ["--param", "draw.=1"],  # empty key
        ["--input", "prompt"],  # no '='
        ["--input", "=x"],  # empty key
        ["--file", "image=/no/such/file.png"],
        ["--file", "image"],
        ["--prompt", "a", "--input", "prompt=b"],
        ["--timeout", "0"],
        ["-o", "out"],  # -o without --wait
    ],
)
def test_malformed_submit_is_usage_error(daemon: FakeDaemon, args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["--socket", daemon.socket_path, "submit", "t2i", *args])
    assert result.exit_code == 2, result.output
    assert daemon.requests == []  # nothing reached the daemon


def test_unknown_command_is_usage_error() -> None:
    assert CliRunner().invoke(cli, ["frobnicate"]).exit_code == 2


# --- submit ----------------------------------------------------------------------------------------


def test_submit_prints_id_alone_and_sends_body(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.json("POST", "/v1/jobs", make_job(JobState.QUEUED), status=201)
    picture = tmp_path / "in.png"
    picture.write_bytes(b"\x89PNG data")
    result = run_cli(
        daemon, "submit", "t2i",
        "--prompt", "a red fox",
        "--input", "style=oil, on canvas",
        "--input", "seed=42",  # --input values stay strings
        "--file", f"image={picture}",
        "--param", "draw.num_inference_steps=30",
        "--param", "draw.guidance_scale=7.5",
        "--param", "draw.scheduler=ddim",
        "--param", "expand.stop=[\"\\n\", \"END\"]",
        "--param", "expand.greedy=true",
        "--timeout", "60",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{JOB_ID}\n"
    [request] = daemon.requests
    assert (request.method, request.path) == ("POST", "/v1/jobs")
    assert request.body == {
        "pipeline": "t2i",
        "inputs": {
            "prompt": "a red fox",
            "style": "oil, on canvas",
            "seed": "42",
            "image": {"b64": base64.b64encode(b"\x89PNG data").decode(), "filename": "in.png"},
        },
        "params": {
            "draw": {"num_inference_steps": 30, "guidance_scale": 7.5, "scheduler": "ddim"},
            "expand": {"stop": ["\n", "END"], "greedy": True},
        },
        "timeout_s": 60.0,
    }


def test_the_lora_guides_command_runs_as_written(daemon: FakeDaemon) -> None:
    """The LoRA guide's (docs/guides/lora.md) `omnictl submit chat -p chat.adapter=a`: `-p` is `--param`'s short form."""
    readme = (REPO_ROOT / "docs/guides/lora.md").read_text()
    [command] = re.findall(r"`omnictl (submit chat -p [^`]+)`", readme)
    daemon.json("POST", "/v1/jobs", make_job(JobState.QUEUED), status=201)
    result = run_cli(daemon, *command.split())
    assert result.exit_code == 0, result.output
    [request] = daemon.requests
    assert request.body["params"] == {"chat": {"adapter": "a"}}


def test_a_refused_reload_exits_4_with_the_daemons_status(daemon: FakeDaemon) -> None:
    status = "reload refused: 1 problem(s) in /etc/omnid/omnid.toml (see omnid --check); still serving"
    daemon.json("POST", "/v1/reload", {"status": status, "reloaded": False})
    result = run_cli(daemon, "reload")
    assert result.exit_code == 4, result.output
    assert result.stderr == f"omnictl: {status}\n"
    daemon.json("POST", "/v1/reload", {"status": "reloaded", "reloaded": True})
    result = run_cli(daemon, "reload")
    assert (result.exit_code, result.stdout) == (0, "reloaded\n")


def test_param_values() -> None:
    assert parse_param_value("20") == 20
    assert parse_param_value("0.5") == 0.5
    assert parse_param_value("false") is False
    assert parse_param_value("null") is None
    assert parse_param_value("[1, 2]") == [1, 2]
    assert parse_param_value("ddim") == "ddim"
    assert parse_param_value("NaN") == "NaN"  # not JSON: kept as a string, never sent as NaN
    assert parse_param_value("") == ""


def test_submit_json_prints_exactly_the_job(daemon: FakeDaemon) -> None:
    daemon.json("POST", "/v1/jobs", make_job(JobState.QUEUED), status=201)
    result = run_cli(daemon, "--json", "submit", "t2i", "--prompt", "x")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == make_job(JobState.QUEUED)


def test_submit_wait_failed_job_writes_outputs_and_exits_1(daemon: FakeDaemon, tmp_path: Path) -> None:
    serve_failed_job(daemon)
    out = tmp_path / "out"
    result = run_cli(daemon, "submit", "t2i", "--prompt", "a red fox", "--wait", "-o", str(out))
    assert result.exit_code == 1, result.output
    assert (out / "text.txt").read_bytes() == b"Hello world"
    lines = result.stdout.splitlines()
    assert lines[0] == JOB_ID
    assert lines[1] == str(out / "text.txt")
    assert lines[-1].startswith(f"{JOB_ID} failed after 4.2s")
    assert "CUDA out of memory (stage_failed)" in lines[-1]
    assert len(lines) == 3
    # Progress went to stderr, plainly, since it is not a terminal.
    assert "expand: started\n" in result.stderr
    assert "expand: Hello world\n" in result.stderr
    assert "draw: step 1/20\ndraw: step 2/20\n" in result.stderr
    assert "draw: error: CUDA out of memory (stage_failed)" in result.stderr
    assert "\r" not in result.stderr


def test_submit_wait_succeeded_writes_into_job_dir(
    daemon: FakeDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon.json("POST", "/v1/jobs", make_job(JobState.QUEUED), status=201)
    daemon.events(JOB_ID, [event(E.STATE, state=JobState.RUNNING), event(E.STATE, state=JobState.SUCCEEDED)])
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.SUCCEEDED, outputs=[TEXT_OUTPUT, IMAGE_OUTPUT]))
    daemon.bytes("GET", f"/v1/jobs/{JOB_ID}/outputs/text", b"Hello world", "text/plain")
    daemon.bytes("GET", f"/v1/jobs/{JOB_ID}/outputs/image", b"\x89PNG", "image/png")
    monkeypatch.chdir(tmp_path)
    result = run_cli(daemon, "submit", "t2i", "--prompt", "x", "--wait")
    assert result.exit_code == 0, result.output
    assert (tmp_path / JOB_ID / "image.png").read_bytes() == b"\x89PNG"
    assert (tmp_path / JOB_ID / "text.txt").read_bytes() == b"Hello world"
    assert result.stdout.splitlines() == [
        JOB_ID, f"{JOB_ID}/text.txt", f"{JOB_ID}/image.png", f"{JOB_ID} succeeded in 4.2s",
    ]
    assert not list((tmp_path / JOB_ID).glob("*.part"))


def test_submit_wait_json_prints_only_events(daemon: FakeDaemon, tmp_path: Path) -> None:
    serve_failed_job(daemon)
    result = run_cli(daemon, "--json", "submit", "t2i", "--prompt", "x", "--wait", "-o", str(tmp_path))
    assert result.exit_code == 1
    assert [json.loads(line) for line in result.stdout.splitlines()] == FAILED_EVENTS
    assert (tmp_path / "text.txt").exists()


# --- events ----------------------------------------------------------------------------------------


def test_events_arrive_incrementally(daemon: FakeDaemon) -> None:
    gate = threading.Event()
    released: list[bool] = []

    def stream(h: FakeHandler) -> None:
        h.start_chunked()
        h.write_chunk(json.dumps(event(E.STATE, state=JobState.RUNNING)).encode() + b"\n")
        # The rest is sent only once the client has shown it already holds the first event.
        released.append(gate.wait(5))
        line = json.dumps(event(E.PROGRESS, stage="draw", done=1, total=2)).encode() + b"\n"
        h.write_chunk(line[:10])  # one event split over two chunks
        h.write_chunk(line[10:] + json.dumps(event(E.STATE, state=JobState.SUCCEEDED)).encode() + b"\n")
        h.end_chunked()

    daemon.route("GET", f"/v1/jobs/{JOB_ID}/events", stream)
    events = Client(daemon.socket_path, timeout=10).events(JOB_ID)
    first = next(events)
    assert first["state"] == "running"
    gate.set()
    rest = list(events)
    assert released == [True]
    assert [e["type"] for e in rest] == ["progress", "state"]
    assert rest[0]["done"] == 1


def test_events_stream_has_no_read_timeout(daemon: FakeDaemon) -> None:
    def stream(h: FakeHandler) -> None:
        h.start_chunked()
        time.sleep(0.5)  # longer than the client's timeout below
        h.write_chunk(json.dumps(event(E.STATE, state=JobState.SUCCEEDED)).encode() + b"\n")
        h.end_chunked()

    daemon.route("GET", f"/v1/jobs/{JOB_ID}/events", stream)
    assert [e["state"] for e in Client(daemon.socket_path, timeout=0.2).events(JOB_ID)] == ["succeeded"]


def test_events_stop_at_terminal_state_even_if_stream_stays_open(daemon: FakeDaemon) -> None:
    hold = threading.Event()

    def stream(h: FakeHandler) -> None:
        h.start_chunked()
        h.write_chunk(json.dumps(event(E.STATE, state=JobState.CANCELLED)).encode() + b"\n")
        hold.wait(5)  # a daemon that forgets to end the stream

    daemon.route("GET", f"/v1/jobs/{JOB_ID}/events", stream)
    try:
        started = time.monotonic()
        assert [e["state"] for e in Client(daemon.socket_path).events(JOB_ID)] == ["cancelled"]
        assert time.monotonic() - started < 2
    finally:
        hold.set()


def test_slow_answer_times_out(daemon: FakeDaemon) -> None:
    hold = threading.Event()
    daemon.route("GET", "/v1/health", lambda h: hold.wait(5))
    try:
        with pytest.raises(DaemonUnreachable, match="no answer within 0.2 s"):
            Client(daemon.socket_path, timeout=0.2).health()
    finally:
        hold.set()


def test_events_stream_cut_short_is_connection_lost(daemon: FakeDaemon) -> None:
    daemon.events(JOB_ID, [event(E.STATE, state=JobState.RUNNING)])
    with pytest.raises(ConnectionLost):
        list(Client(daemon.socket_path).events(JOB_ID))
    result = run_cli(daemon, "watch", JOB_ID)
    assert result.exit_code == 3


def test_events_unknown_job_is_api_error(daemon: FakeDaemon) -> None:
    with pytest.raises(ApiError) as caught:
        next(Client(daemon.socket_path).events("nope"))
    assert (caught.value.status, caught.value.code) == (404, ErrorCode.UNKNOWN_JOB)


def test_watch_json_is_ndjson_of_events(daemon: FakeDaemon) -> None:
    serve_failed_job(daemon)
    result = run_cli(daemon, "watch", JOB_ID, "--json")
    assert result.exit_code == 1
    assert [json.loads(line) for line in result.stdout.splitlines()] == FAILED_EVENTS


def test_watch_human_ends_with_state(daemon: FakeDaemon) -> None:
    daemon.events(JOB_ID, [event(E.STATE, state=JobState.RUNNING), event(E.STATE, state=JobState.SUCCEEDED)])
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.SUCCEEDED))
    result = run_cli(daemon, "watch", JOB_ID)
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [f"job {JOB_ID} running", f"{JOB_ID} succeeded in 4.2s"]


# --- the other commands ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_is_exactly_the_api_document(daemon: FakeDaemon, where: str) -> None:
    daemon.json("GET", "/v1/stages", STAGES_DOC)
    args = ["--json", "stages"] if where == "before" else ["stages", "--json"]
    result = run_cli(daemon, *args)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == STAGES_DOC


def test_status_list(daemon: FakeDaemon) -> None:
    listing = {"jobs": [make_job(JobState.FAILED, error=FAILED_ERROR), make_job(JobState.RUNNING, id="aaaa")]}
    daemon.json("GET", "/v1/jobs", listing)
    result = run_cli(daemon, "--json", "status", "--state", "failed")
    assert json.loads(result.stdout) == listing
    assert daemon.requests[-1].query == {"state": ["failed"], "limit": ["20"]}
    result = run_cli(daemon, "status")
    assert result.exit_code == 0
    header, first, second = result.stdout.splitlines()
    assert header.split() == ["ID", "PIPELINE", "STATE", "AGE", "DURATION", "ERROR"]
    assert first.startswith(JOB_ID) and "failed" in first and "4.2s" in first and "stage_failed" in first
    assert second.startswith("aaaa") and "running" in second


def test_status_job_detail(daemon: FakeDaemon) -> None:
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.FAILED, outputs=[TEXT_OUTPUT], error=FAILED_ERROR))
    result = run_cli(daemon, "status", JOB_ID)
    assert result.exit_code == 0  # status succeeds whatever the job's state
    text = result.stdout
    for expected in ("t2i", "failed", "a red fox", "expand", "2/2", "text.txt", "CUDA out of memory"):
        assert expected in text


def test_result_of_running_job_is_refused(daemon: FakeDaemon) -> None:
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.RUNNING))
    result = run_cli(daemon, "result", JOB_ID)
    assert result.exit_code == 4
    assert "running" in result.stderr


def test_result_output_gone_is_refused(daemon: FakeDaemon, tmp_path: Path) -> None:
    daemon.json("GET", f"/v1/jobs/{JOB_ID}", make_job(JobState.SUCCEEDED, outputs=[IMAGE_OUTPUT]))
    message = f"output 'image' of job {JOB_ID} is no longer on disk"
    daemon.error("GET", f"/v1/jobs/{JOB_ID}/outputs/image", ErrorCode.OUTPUT_GONE, message)
    with pytest.raises(ApiError) as caught:
        Client(daemon.socket_path).output(JOB_ID, "image")
    assert (caught.value.status, caught.value.code) == (410, "output_gone")
    result = run_cli(daemon, "result", JOB_ID, "-o", str(tmp_path / "r"))
    assert result.exit_code == 4
    assert result.stderr == f"omnictl: {message} (output_gone)\n"
    assert not (tmp_path / "r" / "image.png").exists()
    assert not list((tmp_path / "r").glob("*.part"))


def test_result_of_failed_job_exits_1(daemon: FakeDaemon, tmp_path: Path) -> None:
    serve_failed_job(daemon)
    result = run_cli(daemon, "result", JOB_ID, "-o", str(tmp_path))
    assert result.exit_code == 1
    assert (tmp_path / "text.txt").read_bytes() == b"Hello world"


def test_output_in_memory(daemon: FakeDaemon) -> None:
    daemon.bytes("GET", f"/v1/jobs/{JOB_ID}/outputs/image", b"\x89PNG", "image/png")
    assert Client(daemon.socket_path).output(JOB_ID, "image") == (b"\x89PNG", "image/png")


def test_cancel_many_reports_each(daemon: FakeDaemon) -> None:
    daemon.json("POST", f"/v1/jobs/{JOB_ID}/cancel", make_job(JobState.CANCELLED))
    daemon.error("POST", "/v1/jobs/other/cancel", ErrorCode.NOT_YOURS, "job other belongs to another user")
    result = run_cli(daemon, "cancel", JOB_ID, "other", "abc")
    assert result.exit_code == 4
    assert result.stdout == f"{JOB_ID} cancelled\n"
    assert result.stderr == ("omnictl: other: job other belongs to another user (not_yours)\n"
                             "omnictl: abc: no job 'abc' (unknown_job)\n")
    assert daemon.answered == [ErrorCode.NOT_YOURS, ErrorCode.UNKNOWN_JOB]


def test_json_with_several_ids_is_one_document(daemon: FakeDaemon) -> None:
    daemon.json("POST", f"/v1/jobs/{JOB_ID}/cancel", make_job(JobState.CANCELLED))
    daemon.error("POST", "/v1/jobs/other/cancel", ErrorCode.NOT_YOURS, "job other belongs to another user")
    result = run_cli(daemon, "--json", "cancel", JOB_ID, "other")
    assert result.exit_code == 4
    docs = json.loads(result.stdout)                # one document: json.load reads it whole
    assert [d["id"] for d in docs] == [JOB_ID, "other"] and docs[0]["state"] == JobState.CANCELLED
    assert docs[1]["error"] == {"code": ErrorCode.NOT_YOURS, "message": "job other belongs to another user"}
    assert result.stderr == "omnictl: other: job other belongs to another user (not_yours)\n"
    result = run_cli(daemon, "--json", "cancel", JOB_ID)
    assert json.loads(result.stdout)["state"] == JobState.CANCELLED       # one id: its document


def test_rm(daemon: FakeDaemon) -> None:
    daemon.json("DELETE", f"/v1/jobs/{JOB_ID}", {"deleted": JOB_ID})
    result = run_cli(daemon, "rm", JOB_ID)
    assert (result.exit_code, result.stdout) == (0, f"{JOB_ID}\n")
    result = run_cli(daemon, "--json", "rm", JOB_ID)
    assert json.loads(result.stdout) == {"deleted": JOB_ID}


def test_health(daemon: FakeDaemon) -> None:
    daemon.json("GET", "/v1/ready", {"ready": True, "stages": {"expand": "ready", "draw": "ready"}})
    result = run_cli(daemon, "health")
    assert (result.exit_code, result.stdout.splitlines()[0]) == (0, "ready")
    not_ready = {"ready": False, "not_ready": ["draw"], "stages": {"expand": "ready", "draw": "loading"}}
    daemon.json("GET", "/v1/ready", not_ready, status=503)
    result = run_cli(daemon, "health")
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == "not ready: draw"
    assert result.stdout.splitlines()[1:] == ["  expand  ready", "  draw    loading"]    # aligned
    result = run_cli(daemon, "--json", "health")
    assert (result.exit_code, json.loads(result.stdout)) == (1, not_ready)
    assert Client(daemon.socket_path).ready() == (False, not_ready)


def test_health_says_the_disk_is_full_and_submit_is_refused_507(daemon: FakeDaemon) -> None:
    full = {"ready": False, "not_ready": [], "stages": {"expand": "ready"}, "reasons": ["disk_full"],
            "disk": {"full": True, "reason": "3 MiB free on /var/lib/omnid, under daemon.min_free_mb = 512",
                     "free_mb": 3, "min_free_mb": 512}}
    daemon.json("GET", "/v1/ready", full, status=503)
    result = run_cli(daemon, "health")
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0] == ("not ready: disk full (3 MiB free on /var/lib/omnid, under "
                                             "daemon.min_free_mb = 512); new jobs are refused")
    daemon.error("POST", "/v1/jobs", ErrorCode.INSUFFICIENT_STORAGE, "the daemon is short of disk space")
    result = run_cli(daemon, "submit", "t2i", "--prompt", "x")
    assert result.exit_code == 4
    assert "the daemon is short of disk space (insufficient_storage)" in result.stderr


def test_stages_and_pipelines_tables(daemon: FakeDaemon) -> None:
    daemon.json("GET", "/v1/stages", STAGES_DOC)
    daemon.json("GET", "/v1/pipelines", PIPELINES_DOC)
    stages = run_cli(daemon, "stages").stdout.splitlines()
    assert stages[0].split()[:6] == ["NAME", "ENGINE", "STATE", "PID", "NODE", "DEVICES"]
    assert stages[1].split()[:7] == ["expand", "vllm", "ready", "4242", "local", "0", "1/4"]
    assert "ray:10.0.0.2/97859021" in stages[2]      # a Ray-placed stage: its node's address and id
    assert "3.0GiB" in stages[1] and "1h02m" in stages[1]
    assert "cpu" in stages[2] and "model directory missing" in stages[2]
    pipelines = run_cli(daemon, "pipelines").stdout
    assert "t2i" in pipelines and "expand, draw" in pipelines and "expand -> draw" in pipelines
    assert "prompt=text" in pipelines


def test_metrics(daemon: FakeDaemon) -> None:
    text = "# TYPE omnid_jobs_total counter\nomnid_jobs_total 3\n"
    daemon.bytes("GET", "/metrics", text.encode(), "text/plain; version=0.0.4")
    assert Client(daemon.socket_path).metrics() == text
    assert run_cli(daemon, "metrics").stdout == text


# --- rendering and packaging -----------------------------------------------------------------------


def test_live_progress_rewrites_one_line() -> None:
    stream = io.StringIO()
    printer = EventPrinter(stream, live=True)
    for e in FAILED_EVENTS[6:9]:
        printer.feed(e)
    printer.close_line()
    # On a terminal: a rich bar (done/total, rate, time left) rewritten in place, one line.
    first, second = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue()).split("\r\x1b[K")
    assert re.fullmatch(r"draw: started\ndraw: [━╸╺]+ +1/20 \? steps/s -:--:--", first), first
    assert re.fullmatch(r"draw: [━╸╺]+ +2/20 [\d.]+ steps/s \S+\n", second), second


def test_final_state_line_of_cancelled_job() -> None:
    job = make_job(JobState.CANCELLED, error={"code": ErrorCode.CANCELLED, "message": "cancelled by uid 1000"})
    assert final_state_line(job) == f"{JOB_ID} cancelled after 4.2s: cancelled by uid 1000 (cancelled)"


def test_import_is_light() -> None:
    code = (
        "import sys, omnictl\n"
        "heavy = [m for m in ('click', 'torch', 'vllm', 'diffusers', 'requests', 'aiohttp') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT, timeout=30)


def test_the_printer_says_when_the_first_audio_came() -> None:
    stream = io.StringIO()
    printer = EventPrinter(stream, live=False, sinks=["thinker", "code2wav"], created_at=100.0)
    for ev in [{"type": "stage_started", "stage": "thinker", "ts": 100.1},
               {"type": "segment", "stage": "thinker", "index": 0, "is_last": False, "text": " hi", "ts": 100.2},
               {"type": "stage_started", "stage": "code2wav", "ts": 100.5},
               {"type": "segment", "stage": "code2wav", "index": 0, "is_last": False, "audio_s": 0.24, "ts": 101.25},
               {"type": "segment", "stage": "code2wav", "index": 1, "is_last": False, "audio_s": 0.24, "ts": 101.5}]:
        printer.feed(ev)
    out = stream.getvalue()
    assert "first output after 0.20s" in out
    assert out.count("first audio after") == 1 and "first audio after 1.25s (thinker still running)" in out


def test_stages_table_says_how_a_batching_diffusers_stage_batches() -> None:
    from omnictl.render import stages_table

    stages = [{"name": "draw", "engine": "diffusers", "state": "ready", "info": {"batching": "step"}},
              {"name": "old", "engine": "diffusers", "state": "ready",
               "info": {"batching": "call", "batching_why": "omnid has no denoising loop for PixArtAlphaPipeline"}},
              {"name": "one", "engine": "diffusers", "state": "ready", "info": {}}]
    rows = stages_table(stages).splitlines()
    assert [row.split()[:2] for row in rows[1:]] == [["draw", "diffusers/step"], ["old", "diffusers/call"],
                                                      ["one", "diffusers"]]
