"""A job's event stream with a client that stops reading: the daemon neither slows down nor
holds the backlog; the client, when it reads again, gets every event, in order, from the store."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable

import psutil

from conftest import RunningDaemon, py_stage, wait_for


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("omnid")
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(self.path)
        self.sock = sock


def test_a_stalled_event_reader_does_not_slow_the_job_or_grow_the_daemon(
        start_daemon: Callable[..., RunningDaemon]) -> None:
    d = start_daemon({"gen": py_stage("count", defaults={"n": 8000, "delay": 0.0})}, {"p": {"stages": ["gen"]}})
    rss_before = psutil.Process(d.proc.pid).memory_info().rss
    job = d.submit("p")
    stalled = UnixHTTPConnection(str(d.socket))
    stalled.request("GET", f"/v1/jobs/{job}/events")      # ... and read nothing for now
    t0 = time.monotonic()
    wait_for(lambda: d.client.job(job)["state"] == "succeeded", 60, f"job {job} to succeed")
    took = time.monotonic() - t0
    rss_after = psutil.Process(d.proc.pid).memory_info().rss
    assert rss_after - rss_before < 50 << 20, (rss_before, rss_after)
    stored = d.events(job)                                    # a reader that keeps up
    assert len(stored) > 8000 and stored[-1]["type"] == "state" and stored[-1]["state"] == "succeeded"
    # The stalled reader now reads: everything, once, in order.
    response = stalled.getresponse()
    got = [json.loads(line) for line in response.read().splitlines()]
    assert got == stored, (len(got), len(stored))
    assert "lagged" not in {e["type"] for e in got}
    assert "event reader fell behind; catching up from the store" in d.log()   # it was dropped, bounded
    print(f"8000 segments in {took:.2f}s with a stalled reader")
