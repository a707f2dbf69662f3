"""`GET /v1/jobs/{id}/outputs/{name}?stream=1` and `omnictl submit --wait`'s live final stage, on a real daemon.

One daemon serves every test here (python stages of tests/fixtures/streamstages.py):
- `b`: a last stage yielding bytes chunks slowly (output `data`);
- `plain`: a last stage that streams nothing (a plain function, output `text`);
- `ws`: an upstream streaming words into a last stage through a `window = 1` edge.
Requests go through a small `http.client` connection over the Unix socket (defined here), so the
bytes of a chunked response can be timed as they arrive.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, RunningDaemon, module_daemon, python_stage, report_from_a_child, run_on_a_pty, short_tmpdir

NOBODY = 65534


def _stage(function: str, **extra: Any) -> dict[str, Any]:
    return python_stage("streamstages", function, **extra)


STAGES = {
    "bytes": _stage("chunks", defaults={"n": 5, "delay": 0.2}),
    "plain": _stage("slow_text", defaults={"seconds": 0.4}),
    "words": _stage("words", defaults={"n": 6, "delay": 0.12}),
    "shout": _stage("shout"),
}
PIPELINES = {
    "b": {"stages": ["bytes"]},
    "plain": {"stages": ["plain"]},
    "ws": {"stages": ["words", "shout"], "edges": [{"from": "words", "to": "shout", "window": 1}]},
}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 30) -> None:
        super().__init__("omnid", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def get(sock: Path | str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = _UnixConnection(str(sock))
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def read_timed(sock: Path | str, path: str) -> tuple[int, dict[str, str], list[tuple[float, bytes]]]:
    """A response's body as (time.time() it arrived, bytes) pieces, as they come."""
    conn = _UnixConnection(str(sock))
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        pieces: list[tuple[float, bytes]] = []
        while True:
            data = resp.read1(65536)
            if not data:
                break
            pieces.append((time.time(), data))
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, pieces
    finally:
        conn.close()


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    # The conftest fixture is function-scoped; one daemon for the module keeps the file fast.
    with module_daemon(short_tmpdir(), STAGES, PIPELINES, {"socket_mode": "0666"}, ready_timeout=60,
                       forbid_in_log=("Traceback", "request failed")) as rd:
        os.chmod(rd.dir, 0o755)                   # the socket's folder, for the uid-65534 client
        yield rd


def _out(job: str, name: str, query: str = "") -> str:
    return f"/v1/jobs/{job}/outputs/{name}" + (f"?{query}" if query else "")


def test_stream_sends_bytes_before_the_job_ends(daemon: RunningDaemon) -> None:
    job = daemon.submit("b")
    status, headers, pieces = read_timed(daemon.socket, _out(job, "data", "stream=1"))
    doc = daemon.client.job(job)
    assert status == 200 and doc["state"] == "succeeded", (status, doc)
    assert headers.get("transfer-encoding") == "chunked"
    assert headers["content-type"] == "application/octet-stream"
    # The first chunk came well before the job ended (its last 4 chunks take 0.8 s), and the body
    # came in several pieces, as produced.
    first_at = pieces[0][0]
    assert first_at < doc["finished_at"] - 0.4, (first_at, doc["finished_at"])
    assert len(pieces) >= 3, pieces
    streamed = b"".join(p for _, p in pieces)
    # Streamed bytes equal the final file's, byte for byte.
    status, _, final = get(daemon.socket, _out(job, "data"))
    assert status == 200 and streamed == final and final.count(b"\n") == 5, (streamed, final)
    # ... and each chunk was sent once it was written (its own timestamp), not at the end.
    stamps = [float(m) for m in re.findall(rb"at (\d+\.\d+)", final)]
    assert first_at - stamps[0] < 0.5 and stamps[-1] - first_at > 0.5, (first_at, stamps)
    # The worker's .stream folder is gone once the job ended.
    assert not (daemon.state_dir / "jobs" / job / ".stream").exists()


def test_stream_of_a_finished_job_is_the_plain_download(daemon: RunningDaemon) -> None:
    job = daemon.submit("b", params={"bytes": {"delay": 0.0}})
    daemon.wait(job, timeout=20)
    plain = get(daemon.socket, _out(job, "data"))
    for query in ("stream=1", "stream=true", "stream=TRUE", "stream=0", "stream=false"):
        status, headers, body = get(daemon.socket, _out(job, "data", query))
        assert (status, headers["content-type"], body) == (plain[0], plain[1]["content-type"], plain[2]), query
    # The file name serves too; an unknown output is 404, as without stream.
    assert get(daemon.socket, _out(job, "data.bin", "stream=1"))[2] == plain[2]
    status, _, body = get(daemon.socket, _out(job, "nope", "stream=1"))
    assert status == 404 and b"unknown_output" in body


def test_bad_stream_value_is_400(daemon: RunningDaemon) -> None:
    job = daemon.submit("b", params={"bytes": {"delay": 0.0}})
    for value in ("yes", "2", ""):
        status, _, body = get(daemon.socket, _out(job, "data", f"stream={value}"))
        assert status == 400 and b'"invalid_request"' in body, (value, status, body)
    daemon.wait(job, timeout=20)


def test_stream_of_a_last_stage_that_streams_nothing_waits_for_its_file(daemon: RunningDaemon) -> None:
    job = daemon.submit("plain", {"text": "hello"})
    status, headers, pieces = read_timed(daemon.socket, _out(job, "text", "stream=1"))
    assert status == 200, pieces
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert b"".join(p for _, p in pieces) == b"slow:hello"
    assert daemon.client.job(job)["state"] == "succeeded"
    # A name the last stage never writes: answered after the job's end, 404.
    job = daemon.submit("plain", {"text": "x"}, params={"plain": {"seconds": 0.2}})
    status, _, body = get(daemon.socket, _out(job, "nothing", "stream=1"))
    assert status == 404 and b"unknown_output" in body, body


def _daemon_stream_fds(daemon: RunningDaemon) -> list[str]:
    fd_dir = Path(f"/proc/{daemon.proc.pid}/fd")
    targets = []
    for fd in fd_dir.iterdir():
        try:
            targets.append(os.readlink(fd))
        except OSError:
            continue
    return [t for t in targets if "/.stream/" in t]


def test_a_reader_that_hangs_up_mid_stream_leaves_nothing(daemon: RunningDaemon) -> None:
    job = daemon.submit("b", params={"bytes": {"n": 3, "delay": 0.6}})
    conn = _UnixConnection(str(daemon.socket))
    conn.request("GET", _out(job, "data", "stream=1"))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(65536).startswith(b"chunk 0")
    assert _daemon_stream_fds(daemon), "the daemon should hold the stream file open"
    conn.close()                                  # gone mid-stream
    # The daemon lets go of the file at once (it looks at its reader every poll), not when it next
    # has bytes to send (0.6 s later) or at the job's end.
    deadline = time.monotonic() + 0.3
    while _daemon_stream_fds(daemon) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _daemon_stream_fds(daemon)
    assert daemon.client.job(job)["state"] == "running"
    assert daemon.wait(job, timeout=20)["state"] == "succeeded"
    assert not _daemon_stream_fds(daemon)


def _as_nobody(socket_path: str, jobs: list[str], conn: Any) -> None:
    """In a forked child running as uid 65534: the status of `?stream=1` on each of root's jobs."""
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        conn.send([get(socket_path, _out(job, "data", "stream=1"))[::2] for job in jobs])
    except BaseException as e:                    # report, never hang the parent
        conn.send(f"{type(e).__name__}: {e}")
    conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another uid")
def test_someone_elses_job_is_403(daemon: RunningDaemon) -> None:
    running = daemon.submit("b", params={"bytes": {"n": 10, "delay": 0.2}})
    done = daemon.submit("b", params={"bytes": {"delay": 0.0}})
    daemon.wait(done, timeout=20)
    seen = report_from_a_child(_as_nobody, str(daemon.socket), [running, done], timeout=20,
                               what="the uid-65534 client")
    assert isinstance(seen, list), seen
    for status, body in seen:
        assert status == 403 and b"not_yours" in body, seen
    daemon.client.cancel(running)


def test_submit_wait_says_when_the_first_output_came(daemon: RunningDaemon, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "omnictl", "--socket", str(daemon.socket)]
    r = subprocess.run([*cmd, "submit", "ws", "--wait", "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, r
    err = r.stderr.splitlines()
    firsts = [i for i, line in enumerate(err) if line.startswith("first output after")]
    assert len(firsts) == 1, r.stderr
    line = err[firsts[0]]
    # The upstream streams 6 words 0.12 s apart: it was still running when the last stage's first came.
    assert re.fullmatch(r"first output after \d+\.\d+s \(words still running\)", line), line
    assert firsts[0] < next(i for i, x in enumerate(err) if x.startswith("words: finished")), r.stderr
    # Both stages' streamed text shows, each line labelled with its stage.
    texts = [x for x in err if x.startswith(("words: w", "shout: W"))]
    assert "".join(x.split(": ", 1)[1] for x in texts if x.startswith("words:")) == "w0 w1 w2 w3 w4 w5 "
    assert "".join(x.split(": ", 1)[1] for x in texts if x.startswith("shout:")) == "W0 W1 W2 W3 W4 W5 "
    assert r.stdout.splitlines()[-1].split()[1] == "succeeded"
    assert (tmp_path / "out" / "text.txt").read_text() == "W0 W1 W2 W3 W4 W5 "

    # --json: exactly the API's events, nothing more.
    r = subprocess.run([*cmd, "--json", "submit", "ws", "--wait", "-o", str(tmp_path / "j")],
                       capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0, r
    import json
    events = [json.loads(x) for x in r.stdout.splitlines()]
    assert events == daemon.events(events[0]["job"])
    assert "first output" not in r.stdout + r.stderr


def test_first_output_line_on_a_terminal(daemon: RunningDaemon) -> None:
    """On a TTY too, the line is printed once, on its own line."""
    code, text = run_on_a_pty([sys.executable, "-m", "omnictl", "--socket", str(daemon.socket), "submit", "b",
                               "--wait", "-o", str(daemon.dir / "tty-out")])
    assert code == 0, text
    lines = [x.split("\r")[-1] for x in text.replace("\x1b[K", "").splitlines()]
    firsts = [x for x in lines if x.startswith("first output after")]
    assert len(firsts) == 1 and re.fullmatch(r"first output after \d+\.\d+s", firsts[0]), text
