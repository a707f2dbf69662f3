"""A job's event stream with a client that stops reading: the daemon neither slows down nor
holds the backlog; the client, when it reads again, gets every event, in order, from the store.
And a client that keeps reading gets a lone vLLM stream's tokens step by step, as they are made."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable

import psutil
from conftest import RunningDaemon, py_stage, tiny_llm, wait_for


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


def test_a_lone_streams_tokens_reach_its_reader_step_by_step(start_daemon: Callable[..., RunningDaemon]) -> None:
    """One vLLM job, nothing else running: each decode step's token is its own segment event when
    the reader gets it. The worker sends a step's token at once on an idle pipe, and may join it
    with the next step's only while the supervisor has not read the last one; a token held any
    longer (two steps or more) would arrive joined with two others, its index skipped."""
    n = 48
    d = start_daemon({"gen": tiny_llm({"max_tokens": n, "ignore_eos": True, "temperature": 0.0})},
                     {"chat": {"stages": ["gen"]}})
    warm = d.submit("chat", {"prompt": "warm up"})
    wait_for(lambda: d.client.job(warm)["state"] == "succeeded", 120, f"warm-up job {warm} to succeed")
    job = d.submit("chat", {"prompt": "one stream alone"})
    arrivals: list[tuple[float, dict[str, object]]] = []
    for ev in d.client.events(job, idle_timeout=60):
        if ev["type"] == "segment":
            arrivals.append((time.monotonic(), ev))
    indices = [int(str(ev["index"])) for _, ev in arrivals]
    assert d.client.job(job)["state"] == "succeeded"
    assert indices[0] == 0 and arrivals[-1][1]["is_last"] is True, indices
    steps = [b - a for a, b in zip(indices, indices[1:])]
    assert all(1 <= s <= 2 for s in steps), f"tokens held more than one step: indices {indices}"
    # the last segment covers the rest of the tokens (n of them in all): at most two as well
    assert n - indices[-1] <= 2, indices
    spread = arrivals[-1][0] - arrivals[0][0]
    print(f"{len(arrivals)} segment events for {n} tokens over {spread:.3f} s; "
          f"{sum(s == 2 for s in steps)} joined two steps")
