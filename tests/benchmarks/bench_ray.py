"""Ray-placed stages vs local ones, in one run: the extra cost of a stage hop through Ray, and a
256 MiB tensor handed to and from a Ray-placed stage. `make bench BENCH_ARGS="--only ray"`.

Starts its own Ray cluster (a head and a second raylet on this machine, object stores of 600 MB
each: a 256 MiB value must fit in each node's store) and one daemon whose Ray-placed stages run
on the second raylet, so every hand-off crosses raylets (loopback TCP) as it would cross machines.
The cluster and the daemon are stopped at the end. Needs the `ray` extra.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from _harness import ROOT, Ctx, Row, at_most, fmt, p50, pct, py_stage, start_daemon

sys.path.insert(0, str(ROOT / "tests"))

ON_NODE2: dict[str, Any] = {"placement": "ray", "ray": {"num_cpus": 0, "resources": {"node2": 1}}}


def ray_config(address: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    stages = {
        "n1": py_stage("noop"), "n2": py_stage("noop"), "n3": py_stage("noop"), "r2": py_stage("noop", **ON_NODE2),
        "tx": py_stage("tensor_make"), "ty": py_stage("tensor_take"),
        "rtx": py_stage("tensor_make", **ON_NODE2), "rty": py_stage("tensor_take", **ON_NODE2),
    }
    pipelines = {
        "local3": {"stages": ["n1", "n2", "n3"]}, "ray3": {"stages": ["n1", "r2", "n3"]},
        "t_local": {"stages": ["tx", "ty"]}, "t_to_ray": {"stages": ["tx", "rty"]},
        "t_from_ray": {"stages": ["rtx", "ty"]},
    }
    return stages, pipelines, {"ray_address": address}


def _raw_ray_transfer(address: str, n: int) -> list[float]:
    """What Ray alone takes for the same bytes on the same path: this process (a driver on the head)
    passes a 256 MiB float16 numpy array to an actor on the second raylet; seconds from the call to
    the method's entry (put into the head's store, transfer, zero-copy get), median of `n`."""
    import time

    import numpy as np
    import ray

    ray.init(address=address, namespace="omnid-bench", log_to_driver=False)
    try:
        @ray.remote(num_cpus=0, resources={"node2": 1}, max_restarts=0)
        class Taker:
            def take(self, arr: Any, t_sent: float) -> float:
                return time.time() - t_sent

        taker = Taker.remote()              # type: ignore[attr-defined]
        arr = np.ones(128 << 20, dtype=np.float16)
        ray.get(taker.take.remote(arr, time.time()))      # warm-up
        times = [float(ray.get(taker.take.remote(arr, time.time()))) for _ in range(n)]
        ray.kill(taker)
        return times
    finally:
        ray.shutdown()


def bench_ray(ctx: Ctx) -> list[Row]:
    """A stage hop and a 256 MiB hand-off into and out of a Ray-placed stage, vs local and raw Ray."""
    from raycluster import CLIENT_ENV, start_cluster
    os.environ.update(CLIENT_ENV)       # this process's driver and the daemons it starts talk to that cluster
    ctx.log("starting a Ray cluster (head + second raylet)")
    cluster = start_cluster(head_store=600_000_000, node2_store=600_000_000)
    d = None
    try:
        stages, pipelines, daemon = ray_config(cluster.address)
        d = start_daemon(stages, pipelines, daemon, timeout=180)
        n = ctx.n(100, 40)
        for _ in range(5):
            d.run("local3", timeout=30).check()
            d.run("ray3", timeout=30).check()
        local: list[float] = []
        ray: list[float] = []
        for i in range(n):
            if i % 10 == 0:
                ctx.check(f"job {i}")
            r = d.run("local3", timeout=30).check()
            local.append(r.end_ts() - r.t0)
            r = d.run("ray3", timeout=30).check()
            ray.append(r.end_ts() - r.t0)
        pl, pr = p50(local), p50(ray)
        hop = (pr - pl) / 2        # the Ray-placed middle stage: one hop in, one hop out
        ctx.log(f"3-stage no-op p50: local {1000 * pl:.1f} ms, middle stage on Ray {1000 * pr:.1f} ms")
        rows = [Row("Ray hop: 3-stage no-op, middle stage Ray-placed, p50", 1000 * pr, "ms",
                    "same, all 3 local", 1000 * pl, "ms", pr / pl, "ray / local", None,
                    f"{n} jobs each, alternated; extra per hop into or out of a Ray-placed stage "
                    f"(p50 difference / 2): {fmt(1000 * hop)} ms; p90 ray {fmt(1000 * pct(ray, 0.9))} ms, "
                    f"local {fmt(1000 * pct(local, 0.9))} ms")]
        handoff: dict[str, list[float]] = {"t_local": [], "t_to_ray": [], "t_from_ray": []}
        first = {"t_local": "tx", "t_to_ray": "tx", "t_from_ray": "rtx"}
        for p in handoff:          # warm-up: torch imported in every worker, heaps grown
            d.run(p, params={first[p]: {"mb": 256, "clones": 1}}, timeout=min(180.0, max(20.0, ctx.left()))).check()
        for i in range(ctx.n(5, 3)):
            for p, times in handoff.items():
                ctx.check(f"{p} run {i}")
                r = d.run(p, params={first[p]: {"mb": 256, "clones": 1}},
                          timeout=min(180.0, max(20.0, ctx.left()))).check()
                out = {k: json.loads(d.client.output(r.job, k)[0]) for k in ("handoff_s", "nbytes")}
                if out["nbytes"] != 256 << 20:
                    raise RuntimeError(f"{p}: the tensor arrived with {out['nbytes']} bytes")
                times.append(out["handoff_s"])
                d.client.delete(r.job)
            ctx.log(f"run {i}: " + ", ".join(f"{p} {1000 * t[-1]:.0f} ms" for p, t in handoff.items()))
        raw = _raw_ray_transfer(cluster.address, ctx.n(5, 3))
        ctx.log(f"raw Ray: 256 MiB numpy, driver -> actor on the second raylet: {', '.join(fmt(1000 * x) for x in raw)} ms")
        base, floor = p50(handoff["t_local"]), p50(raw)
        rows.append(Row("256 MiB fp16 hand-off, local -> local (same run)", 1000 * base, "ms", "", None, "", None, "",
                        None, f"median of {len(handoff['t_local'])}: through the receiver's shared-memory pool"))
        for p, label in (("t_to_ray", "local -> Ray-placed"), ("t_from_ray", "Ray-placed -> local")):
            h = p50(handoff[p])
            rows.append(Row(f"256 MiB fp16 hand-off, {label} (across raylets)", 1000 * h, "ms",
                            "raw Ray: 256 MiB numpy to an actor across raylets", 1000 * floor, "ms", h / floor,
                            "omnid / raw Ray", at_most(3.0, "<= 3x raw Ray"),
                            f"median of {len(handoff[p])}: {', '.join(fmt(1000 * x) for x in handoff[p])} ms; "
                            f"{h / base:.0f}x the local -> local hand-off ({fmt(1000 * base)} ms)"))
        return rows
    finally:
        if d is not None:
            d.stop()
        cluster.stop()
