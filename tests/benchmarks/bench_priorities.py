"""Who goes first (omnid/fair_queue.py): fair share between owners, priorities in a vLLM stage, and
what fair share costs the door.

Each bench starts its own daemon(s). Owners other than root are API keys over TCP (made over the
socket, as root), so the bench needs no other uid.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import time
from typing import Any

from _harness import Ctx, Row, at_least, at_most, fmt, kill_daemon, py_stage, start_daemon, vllm_stage
from bench_control import _hammer

from omnictl.client import Client

RUN_S = 0.05            # one job's work in the fair-share row


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, key: str, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/jobs", json.dumps(body), {"Authorization": f"Bearer {key}",
                                                            "Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        if resp.status != 201:
            raise RuntimeError(f"POST /v1/jobs: {resp.status} {doc}")
        return dict(doc)
    finally:
        conn.close()


def _wait_started(c: Client, job: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = c.job(job)
        if doc.get("started_at"):
            return dict(doc)
        time.sleep(0.01)
    raise TimeoutError(f"job {job} did not start within {timeout:g} s")


def bench_fair_wait(ctx: Ctx) -> list[Row]:
    """Owner A queues 200 jobs (python stage, 50 ms each); then owner B submits one: B's wait (its
    submit -> its start, the daemon's stamps) against one job's run time (its stage's elapsed).

    FIFO would make B wait behind all of A's jobs (about 200 run times); with fair share B's job is
    next after about one of A's (plus the one running and the ones already given a place)."""
    port = _free_port()
    d = start_daemon({"s": py_stage("sleep", defaults={"seconds": RUN_S})}, {"s": {"stages": ["s"]}},
                     {"listen": [f"127.0.0.1:{port}"]}, timeout=120)
    try:
        keys = {name: str(d.client.add_key(name, uid)["key"]) for name, uid in (("a", 62001), ("b", 62002))}
        a_jobs = [_post(port, keys["a"], {"pipeline": "s"})["id"] for _ in range(200)]
        _wait_started(d.client, a_jobs[2], 60)
        ctx.check("A's jobs")
        b = _post(port, keys["b"], {"pipeline": "s"})["id"]
        doc = _wait_started(d.client, b, 60)
        wait = float(doc["started_at"]) - float(doc["created_at"])
        ahead = sum(1 for j in a_jobs if (a := d.client.job(j))["started_at"] and a["started_at"] < doc["started_at"])
        end = time.monotonic() + 30
        while d.client.job(b)["state"] != "succeeded" and time.monotonic() < end:
            time.sleep(0.02)
        run = float(d.client.job(b)["stages"]["s"]["elapsed_s"] or RUN_S)
        for j in a_jobs:
            d.client.cancel(j)
        d.drain(60)
    finally:
        kill_daemon(d)
    return [Row("fair share: owner B's job behind owner A's 200 queued (50 ms each): B's wait", wait, "s",
                "one job's run time", run, "s", wait / run, "wait / run", at_most(3.0, "<= 3 (FIFO: about 200)"),
                f"{ahead} of A's jobs started before B's (A's 3rd had started when B submitted)")]


def bench_priority_ttft(ctx: Ctx) -> list[Row]:
    """A priority -1 chat's time to its first token while 64 priority-0 chats stream (256 tokens each,
    the tiny Llama on vLLM, scheduling_policy "priority"), against the same chat on the idle stage
    (medians; submit -> first segment event, the daemon's stamps)."""
    d = start_daemon({"gen": vllm_stage(max_inflight=128)}, {"chat": {"stages": ["gen"]}}, timeout=300)

    def ttft(priority: int) -> float:
        t0 = time.time()
        job = str(d.client.submit("chat", {"prompt": "Tell me about the sea."}, {"gen": {"max_tokens": 8}},
                                  None, priority)["id"])
        for ev in d.follow(job, 120):
            if ev.get("type") == "segment":
                return float(ev["ts"]) - t0
        raise RuntimeError(f"job {job}: no segment")

    try:
        for _ in range(2):
            ttft(-1)                                    # warm
        idle = statistics.median(ttft(-1) for _ in range(3))
        ctx.check("idle")
        background = [str(d.client.submit("chat", {"prompt": f"Write a long story number {i}."}, None, None, 0)["id"])
                      for i in range(64)]
        end = time.monotonic() + 120
        while time.monotonic() < end and sum(1 for j in background if d.client.job(j)["stages"]["gen"]["segments"]) < 64:
            time.sleep(0.1)
        streaming = sum(1 for j in background if d.client.job(j)["stages"]["gen"]["segments"])
        urgent: list[float] = []
        plain: list[float] = []
        for _ in range(4):                              # interleaved: both see the same load
            urgent.append(ttft(-1))
            plain.append(ttft(0))
        loaded, same = statistics.median(urgent), statistics.median(plain)
        still = sum(1 for j in background if d.client.job(j)["state"] == "running")
        for j in background:
            d.client.cancel(j)
        d.drain(60)
    finally:
        kill_daemon(d)
    return [Row("priority -1 chat TTFT while 64 priority-0 chats stream", loaded, "s", "its TTFT on the idle stage",
                idle, "s", loaded / idle, "loaded / idle", at_most(1.5, "<= 1.5x"),
                f"{streaming} of 64 streaming when measured, {still} still running after; medians of 4, "
                f"interleaved with a priority 0 chat's: {fmt(same, 's')} (on a CPU a step of 65 sequences "
                f"costs many times one's: the ratio is the step's, not the queue's)")]


def bench_fair_post(ctx: Ctx) -> list[Row]:
    """POST /v1/jobs per second (16 socket clients, 2.5 s, a 1-stage no-op), fair share on / off,
    each on a daemon of its own, measured twice in turn (on, off, on, off); the best of each."""
    rates: dict[bool, list[float]] = {True: [], False: []}
    for fair in (True, False, True, False):
        d = start_daemon({"n": py_stage("noop")}, {"p": {"stages": ["n"]}}, {"fair_share": fair}, timeout=120)
        try:
            rate, _ok, _refused = _hammer(d, 16, ctx.n(2.5, 1.5), 4000, lambda c, i: bool(c.submit("p", {})))
            rates[fair].append(rate)
            d.drain(120)
        finally:
            kill_daemon(d)
        ctx.check("POST")
    on, off = max(rates[True]), max(rates[False])
    return [Row("POST /v1/jobs per second, fair share on", on, "/s", "fair share off", off, "/s", on / off,
                "on / off", at_least(0.95, ">= 0.95x"),
                f"runs: on {', '.join(fmt(r) for r in rates[True])}; off {', '.join(fmt(r) for r in rates[False])}")]


FIGURES = ["fair share: owner B's job behind owner A's 200 queued (50 ms each): B's wait",
           "priority -1 chat TTFT while 64 priority-0 chats stream",
           "POST /v1/jobs per second, fair share on"]
