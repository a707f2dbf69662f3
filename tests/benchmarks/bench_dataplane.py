"""The data plane between stages: pipelining of two python stages, and a big tensor's hand-off.

Both on the shared "control" daemon (python stages only).
"""

from __future__ import annotations

import json
import time

from _harness import Ctx, Row, at_least, at_most, fmt, p50


def bench_pipelining(ctx: Ctx) -> list[Row]:
    """N jobs through two python stages of T s each (pipeline `ab`): wall time vs (N+1)T and 2NT.

    Wall = the last job's terminal event minus the wall clock before the first POST; median of runs.
    """
    d = ctx.daemon("control")
    t, n = 0.25, 8
    params = {"sa": {"seconds": t}, "sb": {"seconds": t}}
    walls: list[float] = []
    for i in range(ctx.n(3, 1)):
        ctx.check(f"run {i}")

        t0 = time.time()
        jobs = [d.submit("ab", {"text": str(k)}, params) for k in range(n)]
        ends = []
        for job in jobs:
            events = d.events(job, timeout=min(60.0, max(5.0, ctx.left())))
            if events[-1].get("state") != "succeeded":
                raise RuntimeError(f"job {job} ended {events[-1]}")
            ends.append(float(events[-1]["ts"]))
        walls.append(max(ends) - t0)
        ctx.log(f"run {i}: {walls[-1]:.2f} s")
    wall = p50(walls)
    ideal, serial = (n + 1) * t, 2 * n * t
    runs = ", ".join(f"{w:.2f}" for w in walls)
    return [
        Row(f"pipelining: {n} jobs x 2 stages of {t} s, wall", wall, "s", "ideal (N+1)T", ideal, "s",
            wall / ideal, "wall / ideal", at_most(1.1, "<= 1.1x (README: about (N+1)T)"),
            f"runs: {runs} s"),
        Row("pipelining: same wall vs serial", wall, "s", "serial 2NT", serial, "s", wall / serial,
            "wall / serial", None, f"perfect pipelining would be {ideal / serial:.2f}x"),
    ]


def bench_tensor_handoff(ctx: Ctx) -> list[Row]:
    """A 256 MiB float16 tensor from one python stage to the next, vs a clone of it in-process.

    `tensor_make` times 3 clones of the tensor in its own worker (median) and stamps the wall clock
    as it returns; `tensor_take` reports how long after that stamp its function was entered: the
    pickling, the socket copy and the unpickling. Ratio: clone time / hand-off time.
    """
    d = ctx.daemon("control")
    # warm-up: imports torch in both workers and grows their heaps to the size
    d.run("tensor", params={"tx": {"mb": 256, "clones": 1}}, timeout=min(120.0, max(10.0, ctx.left()))).check()
    hand: list[float] = []
    clone: list[float] = []
    for i in range(ctx.n(5, 3)):
        ctx.check(f"run {i}")
        r = d.run("tensor", params={"tx": {"mb": 256}}, timeout=min(120.0, max(10.0, ctx.left()))).check()
        out = {name: json.loads(d.client.output(r.job, name)[0]) for name in ("handoff_s", "clone_s", "nbytes")}
        if out["nbytes"] != 256 << 20:
            raise RuntimeError(f"the tensor arrived with {out['nbytes']} bytes")
        hand.append(out["handoff_s"])
        clone.append(out["clone_s"])
        ctx.log(f"run {i}: hand-off {1000 * hand[-1]:.0f} ms, clone {1000 * clone[-1]:.0f} ms")
        d.client.delete(r.job)
    h, c = p50(hand), p50(clone)
    return [Row("tensor hand-off: 256 MiB fp16, stage -> stage", 1000 * h, "ms", "tensor.clone() in-process",
                1000 * c, "ms", c / h, "clone / hand-off", at_least(0.5, ">= 0.5x"),
                f"median of {len(hand)}; hand-offs {', '.join(fmt(1000 * x) for x in hand)} ms; "
                f"{256 / h:.0f} MiB/s")]
