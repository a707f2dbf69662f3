"""Capacity: stage replicas and sleeping stages.

- replicas: the same CPU-bound python stage (each job spins `cpu_s` of CPU) with `replicas = 1` and
  `replicas = 2` in one daemon; bursts of N jobs to each, alternating, so that both see the same
  noise. On this 2-core machine two replicas should nearly double the throughput.
- wake: a tiny-vLLM stage with `idle_unload_s`, put to sleep; the first job after it (submit ->
  end, the wake included) against a cold daemon's launch -> same job done, in the same run.
"""

from __future__ import annotations

import time

from _harness import (
    Ctx,
    Daemon,
    Row,
    at_least,
    at_most,
    fmt,
    in_threads,
    p50,
    py_stage,
    raise_first,
    start_daemon,
    vllm_stage,
)


def _burst(d: Daemon, pipeline: str, n: int, cpu_s: float) -> float:
    """Wall seconds for n jobs submitted at once (one client thread each) to all end."""
    t0 = time.monotonic()
    results = in_threads(n, lambda i: d.run(pipeline, {"text": str(i)}, {pipeline: {"cpu_s": cpu_s}},
                                            timeout=300).check(), timeout=600)
    raise_first(results)
    return time.monotonic() - t0


def bench_replicas(ctx: Ctx) -> list[Row]:
    """Bursts of CPU-bound jobs (1 s of CPU each) to the same python stage with 1 and 2 replicas: jobs/s."""
    # Jobs of a second of CPU each: the supervisor's and the clients' own work (a few ms a job) shares
    # the 2 cores with the replicas, and must stay small beside the work being measured.
    n, cpu_s, rounds = ctx.n(8, 4), 1.0, ctx.n(3, 2)
    stages = {"one": py_stage("burn", queue_capacity=64), "two": py_stage("burn", replicas=2, queue_capacity=64)}
    d = start_daemon(stages, {"one": {"stages": ["one"]}, "two": {"stages": ["two"]}})
    try:
        _burst(d, "one", 2, 0.05)
        _burst(d, "two", 4, 0.05)
        walls: dict[str, list[float]] = {"one": [], "two": []}
        for r in range(rounds):
            for name in ("one", "two"):
                ctx.check(f"round {r} {name}")
                walls[name].append(_burst(d, name, n, cpu_s))
        used = [rep["jobs_done"] for rep in d.stages()["two"]["replicas"]]
    finally:
        d.stop()
    one, two = n / p50(walls["one"]), n / p50(walls["two"])
    return [Row(f"CPU-bound python stage, {n} jobs of {cpu_s} s CPU: 2 replicas, jobs/s", two, "jobs/s",
                "same stage, 1 replica", one, "jobs/s", two / one, "2 replicas / 1",
                at_least(1.8, ">= 1.8x"),
                f"median of {rounds} bursts each, alternating; jobs per replica {used}; "
                f"walls 1 replica {', '.join(fmt(w) for w in walls['one'])} s, "
                f"2 replicas {', '.join(fmt(w) for w in walls['two'])} s")]


def bench_wake(ctx: Ctx) -> list[Row]:
    """A sleeping tiny-vLLM stage's next job (submit -> end, its wake included) vs a cold daemon's first job."""
    params = {"llm": {"max_tokens": 16}}
    stages = {"llm": vllm_stage(idle_unload_s=3600)}
    d = start_daemon(stages, {"p": {"stages": ["llm"]}})
    try:
        cold_job = d.run("p", {"prompt": "a lighthouse"}, params, timeout=120).check()
        cold = cold_job.end_ts() - d.launched_wall
        warm = [d.run("p", {"prompt": "a lighthouse"}, params, timeout=60).check() for _ in range(3)]
        warm_s = p50([r.end_ts() - r.t0 for r in warm])
        wakes = []
        for _ in range(ctx.n(2, 1)):
            ctx.check("sleep")
            d.client.sleep_stage("llm")
            deadline = time.monotonic() + 60
            while d.stages()["llm"]["state"] != "sleeping":
                if time.monotonic() > deadline:
                    raise TimeoutError("the stage did not go to sleep")
                time.sleep(0.05)
            r = d.run("p", {"prompt": "a lighthouse"}, params, timeout=120).check()
            wakes.append(r.end_ts() - r.t0)
        wake_s = d.stages()["llm"]["wake_s"]
    finally:
        d.stop()
    woke = p50(wakes)
    return [Row("sleeping tiny-vLLM stage: submit -> job done (wake included)", woke, "s",
                "cold daemon: launch -> same job done", cold, "s", woke / cold, "wake / cold",
                at_most(1.0, "< cold start"),
                f"{len(wakes)} wake(s): {', '.join(fmt(w) for w in wakes)} s; the stage's own wake_s {fmt(wake_s)} s; "
                f"the same job warm: {fmt(warm_s)} s")]
