"""The control plane: per-job overhead, the API under 32 concurrent clients, supervisor memory, the
supervisor's CPU per streamed segment.

All on the shared "control" daemon (python no-op stages: `p1` = 1 stage, `p2` = 2, `p3` = 3; `seg`
streams text segments).
Clients are `omnictl.client.Client`s: one new Unix-socket connection per request, as omnictl does.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psutil
from _harness import Ctx, Daemon, Row, at_least, at_most, fmt, health_p50, in_threads, p50, pct, raise_first

from omnictl.client import ApiError, Client


def _job_latencies(ctx: Ctx, d: Daemon, pipeline: str, n: int) -> list[float]:
    """Submit -> terminal event (the daemon's timestamp), one job at a time."""
    out = []
    for i in range(n):
        if i % 20 == 0:
            ctx.check(f"{pipeline} job {i}")
        r = d.run(pipeline, timeout=30).check()
        out.append(r.end_ts() - r.t0)
    return out


def bench_noop_latency(ctx: Ctx) -> list[Row]:
    """p50 of submit -> terminal event for a 1-stage and a 3-stage no-op pipeline, one job at a time.

    The jobs alternate (p1, p3, p1, ...) so that both see the same noise. The anchor is a bare
    `GET /v1/health` round trip (p50, measured before and after). A further stage hop is
    (p50(3 stages) - p50(1 stage)) / 2; the note also gives the hop as the daemon stamps it inside
    the 3-stage jobs (stage_finished of one stage -> stage_started of the next, median).
    """
    d = ctx.daemon("control")
    n = ctx.n(200, 100)
    for _ in range(10):
        d.run("p1", timeout=30).check()
        d.run("p3", timeout=30).check()
    health = health_p50(d, n)
    one: list[float] = []
    three: list[float] = []
    inside: list[float] = []
    for i in range(n):
        if i % 20 == 0:
            ctx.check(f"job {i}")
        r = d.run("p1", timeout=30).check()
        one.append(r.end_ts() - r.t0)
        r = d.run("p3", timeout=30).check()
        three.append(r.end_ts() - r.t0)
        for a, b in (("n1", "n2"), ("n2", "n3")):
            inside.append(float(r.first(type="stage_started", stage=b)["ts"])
                          - float(r.first(type="stage_finished", stage=a)["ts"]))
    health = (health + health_p50(d, n)) / 2
    p1, p3 = p50(one), p50(three)
    hop = (p3 - p1) / 2
    return [
        Row("no-op job, 1 stage: submit -> terminal event, p50", 1000 * p1, "ms", "GET /v1/health p50",
            1000 * health, "ms", p1 / health, "job / health", at_most(2.0, "<= 2 ms", on="value"),
            f"{len(one)} jobs; p10 {fmt(1000 * pct(one, 0.1))} ms, p90 {fmt(1000 * pct(one, 0.9))} ms"),
        Row("no-op job, each further stage hop, p50", 1000 * hop, "ms", "GET /v1/health p50",
            1000 * health, "ms", hop / health, "hop / health", at_most(0.5, "<= 0.5 ms", on="value"),
            f"(p50 3-stage {fmt(1000 * p3)} ms - p50 1-stage) / 2; stamped inside the 3-stage jobs "
            f"(stage_finished -> next stage_started): p50 {fmt(1000 * p50(inside))} ms"),
    ]


def _hammer(d: Daemon, clients: int, seconds: float, max_count: int,
            request: Any) -> tuple[float, int, int]:
    """`clients` threads calling request(client, i) until `seconds` pass or `max_count` calls are made.

    Returns (successful calls per second, calls that succeeded, calls refused (an API error)).
    """
    lock = threading.Lock()
    counter = [0]
    ok = [0] * clients
    refused = [0] * clients
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def body(k: int) -> None:
        c = Client(str(d.socket), timeout=30)
        start.wait(30)
        while time.monotonic() < stop_at[0]:
            with lock:
                i = counter[0]
                if i >= max_count:
                    return
                counter[0] += 1
            try:
                if request(c, i):
                    ok[k] += 1
            except ApiError:
                refused[k] += 1

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    stop_at[0] = time.monotonic() + seconds
    t0 = time.monotonic()
    start.wait(30)
    for t in threads:
        t.join(seconds + 60)
    elapsed = time.monotonic() - t0
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a client thread is stuck")
    return sum(ok) / elapsed, sum(ok), sum(refused)


def bench_api_concurrency(ctx: Ctx) -> list[Row]:
    """32 client threads for a few seconds each: GET /v1/health, POST /v1/jobs (p2), GET /v1/jobs/{id}.

    Each loop stops after `seconds` or `max_count` requests. The submitted jobs run (2 no-op stages)
    while the later loops go on; the daemon is drained at the end.
    """
    d = ctx.daemon("control")
    d.drain(60)
    clients, seconds = 32, ctx.n(3.0, 1.5)
    cap = ctx.n(6000, 3000)          # jobs: they all run afterwards
    health_rate, health_ok, _ = _hammer(d, clients, seconds, 100000, lambda c, i: bool(c.health()))
    ctx.log(f"health: {health_rate:.0f} req/s ({health_ok})")
    ctx.check("after health")
    ids: list[str] = []
    ids_lock = threading.Lock()

    def post(c: Client, i: int) -> bool:
        job = c.submit("p2", {"text": str(i)})
        with ids_lock:
            ids.append(job["id"])
        return True

    post_rate, posted, refused = _hammer(d, clients, seconds, cap, post)
    ctx.log(f"POST: {post_rate:.0f} jobs/s ({posted} accepted, {refused} refused)")
    ctx.check("after POST")
    get_rate, got, _ = _hammer(d, clients, seconds, 100000, lambda c, i: bool(c.job(ids[i % len(ids)])))
    ctx.log(f"GET job: {get_rate:.0f} req/s ({got})")
    t = time.monotonic()
    d.drain(max(10.0, min(180.0, ctx.left())))
    drain_s = time.monotonic() - t
    return [
        Row("POST /v1/jobs, 32 clients, 2-stage no-op: jobs/s", post_rate, "/s", "GET /v1/health, 32 clients", health_rate, "/s",
            post_rate / health_rate, "POST / health", at_least(1000, ">= 1000/s", on="value"),
            f"{posted} accepted, {refused} refused in {seconds:g} s; the jobs then ran to the end in "
            f"{drain_s:.1f} s more"),
        Row("GET /v1/jobs/{id}, 32 clients: req/s", get_rate, "/s", "GET /v1/health, 32 clients",
            health_rate, "/s", get_rate / health_rate, "GET job / health",
            at_least(3000, ">= 3000/s (keep)", on="value"), f"{got} requests while those jobs ran"),
    ]


def bench_supervisor_rss(ctx: Ctx) -> list[Row]:
    """Supervisor RSS (psutil, the daemon's own pid) before and after N no-op jobs (p1).

    8 threads submit N jobs without following them (bounded in time: fewer if the budget runs
    out, said in the note); then the daemon is drained and its RSS read again.
    """
    d = ctx.daemon("control")
    d.drain(60)
    proc = psutil.Process(d.proc.pid)
    n = ctx.n(10000, 1000)
    before = proc.memory_info().rss
    deadline = time.monotonic() + max(10.0, ctx.left() - 60)
    lock = threading.Lock()
    counter = [0]

    def body(k: int) -> int:
        c = Client(str(d.socket), timeout=30)
        done = 0
        while time.monotonic() < deadline:
            with lock:
                if counter[0] >= n:
                    break
                counter[0] += 1
            try:
                c.submit("p1", {"text": "x"})
                done += 1
            except ApiError as e:
                if e.status != 429:
                    raise
                time.sleep(0.05)
        return done

    t = time.monotonic()
    results = in_threads(8, body, timeout=max(20.0, ctx.left()))
    raise_first(results)
    submitted = sum(results)
    d.drain(max(10.0, min(120.0, ctx.left())))
    elapsed = time.monotonic() - t
    after = proc.memory_info().rss
    mib = 1 << 20
    short = "" if submitted >= n else f" (only {submitted} of {n} within the budget)"
    return [Row(f"supervisor RSS after {submitted} no-op jobs", after / mib, "MiB", "RSS before them",
                before / mib, "MiB", after / before, "after / before", None,
                f"{(after - before) / max(1, submitted):.0f} B per job; {submitted / elapsed:.0f} jobs/s "
                f"submitted and run by 8 clients{short}")]


def _reference_op_s(ops: int) -> float:
    """CPU seconds (this thread's) of one op of plain Python of the kind the supervisor does for a
    segment (an event's dict, its JSON both ways): the yardstick of this machine's speed now."""
    t = time.thread_time()
    for i in range(ops):
        ev = {"type": "segment", "job": "j0123456789", "ts": 1.0e9 + i, "stage": "seg", "index": i,
              "is_last": False, "text": "w1 "}
        json.loads(json.dumps(ev))
    return (time.thread_time() - t) / ops


def _cpu_s(proc: psutil.Process) -> float:
    """A process's CPU seconds, to the nanosecond where Linux says (the sum of its threads'
    /proc/PID/task/TID/schedstat): psutil's user + system count 10 ms ticks, and a job of 3000
    segments takes about 150 ms of the supervisor's CPU, so they moved a figure 7 % a tick."""
    total, found = 0, False
    try:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
                    found = True
            except (OSError, ValueError, IndexError):
                continue        # (a thread that ended meanwhile)
    except OSError:
        pass
    if found:
        return total / 1e9
    t = proc.cpu_times()
    return t.user + t.system


def bench_segment_path(ctx: Ctx) -> list[Row]:
    """The supervisor's CPU time per streamed segment, one job of N text segments (`seg`, a python
    generator that yields as fast as it can: one message per segment) followed by an event reader.

    The supervisor's CPU (its threads' schedstat, to the ns; psutil's ticks elsewhere) over the job, per segment event
    the reader got; against a reference op of plain Python timed in this process just before and
    after (this machine's speed now), so the ratio moves with omnid's per-segment path, not the load.
    """
    d = ctx.daemon("control")
    n = 3000        # (the same in both modes: the figure names it, and bench-check's baseline is by figure)
    proc = psutil.Process(d.proc.pid)
    d.run("seg", {"text": "x"}, {"seg": {"n": 200}}, timeout=60).check()   # warm
    per_segment: list[float] = []
    refs: list[float] = []
    events = 0
    for i in range(7):         # (the median of 7: steady enough for bench-check, under a second each)
        ctx.check(f"job {i}")
        refs.append(_reference_op_s(20000))
        before = _cpu_s(proc)
        r = d.run("seg", {"text": "x"}, {"seg": {"n": n}}, timeout=120).check()
        after = _cpu_s(proc)
        events = len(r.all(type="segment"))
        per_segment.append((after - before) / events)
    refs.append(_reference_op_s(20000))
    seg, ref = p50(per_segment), p50(refs)
    return [Row(f"supervisor CPU per streamed segment ({n} segments, an event reader)", 1e6 * seg, "us",
                "a plain-Python op (event dict, JSON out and in)", 1e6 * ref, "us", seg / ref, "segment / op",
                None, f"median of {len(per_segment)} jobs: {', '.join(fmt(1e6 * x) for x in per_segment)} us; "
                f"{events} segment events in the last", better="lower")]
