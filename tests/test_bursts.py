"""Bursts and slow clients on the API socket: 300 connects at once, and connections that never
send a (whole) request. A stalled event reader is covered in test_events.py."""

from __future__ import annotations

import select
import socket
import time

from conftest import RunningDaemon, py_stage, wait_for

HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: omnid\r\nConnection: close\r\n\r\n"


def read_all(s: socket.socket, timeout: float) -> bytes:
    """What the daemon sends until it closes the connection (or `timeout` s pass)."""
    s.setblocking(True)
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_300_nonblocking_connects_at_once_all_get_answers(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}}, {"log_level": "info"})
    socks = []
    try:
        for _ in range(300):                      # all connect before the daemon accepts any
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            assert s.connect_ex(str(d.socket)) == 0, "EAGAIN: the listen backlog is too small"
            socks.append(s)
        for s in socks:
            s.sendall(HEALTH)
        answers = [read_all(s, 30) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 200") and b'"status": "ok"' in a for a in answers), \
        [a[:80] for a in answers if not a.startswith(b"HTTP/1.1 200")][:5]


def test_idle_and_half_sent_connections_are_dropped_after_the_timeout(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}},
                                    {"client_idle_timeout_s": 1.0, "log_level": "info"})
    idle = []
    t0 = time.monotonic()
    try:
        for i in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.socket))
            if i % 2:
                s.sendall(HEALTH[:20])            # half a request line, then nothing
            idle.append(s)
        assert d.client.health()["status"] == "ok"        # meanwhile others are served
        open_ = set(idle)
        deadline = time.monotonic() + 15
        while open_ and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_), [], [], 0.5)
            for s in ready:
                assert s.recv(4096) == b"", "an idle connection got an answer instead of being closed"
                open_.discard(s)
        elapsed = time.monotonic() - t0
        assert not open_, f"{len(open_)} of 50 idle connections still open after {elapsed:.1f} s"
        assert elapsed >= 0.9, f"closed after {elapsed:.2f} s, before the 1 s timeout"
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: d.client.health()["status"] == "ok", 5, "the daemon to keep serving")
    job = d.submit("p", {"text": "after"})
    assert d.wait(job, timeout=30)["state"] == "succeeded"
