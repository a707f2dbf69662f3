"""`engine_core = "process"` against `"inline"`: the same tiny Llama twice in one daemon.

One daemon of its own, two vllm stages (max_inflight 16), alike but for where the engine core
runs: in the worker's thread (`inline`) or in a process of its own (`process`, the default, as
`vllm serve` runs it). Rows, each the process figure against the inline one of the same run:
- 16 concurrent 64-token jobs: jobs/s (before the first POST -> the last terminal event);
- the first token's latency over those 16 jobs: p50 and p99 (POST -> the first segment);
- a running generation cancelled -> the next job started, in decode steps of the process core.
Rounds alternate the two stages, medians over rounds.
"""

from __future__ import annotations

import time
from typing import Any

from _harness import Ctx, Daemon, Row, at_least, at_most, fmt, p50, pct, start_daemon, vllm_stage
from bench_engines import _cancel_to_next

FIGURES = ["vLLM 16 x 64 tokens, engine core in a process: jobs/s",
           "vLLM 16 x 64 tokens, engine core in a process: first token p50",
           "vLLM 16 x 64 tokens, engine core in a process: first token p99",
           "cancel vLLM (engine core in a process) -> next job started"]


def _round(ctx: Ctx, d: Daemon, where: str, n: int = 16, tokens: int = 64) -> tuple[float, list[float]]:
    """n jobs at once: (wall s, each job's POST -> first segment s)."""
    t0 = time.time()
    posted: list[tuple[str, float]] = []
    for i in range(n):
        posted.append((d.submit(where, {"prompt": f"prompt {i}"}, {where: {"max_tokens": tokens}}), time.time()))
    ends: list[float] = []
    firsts: list[float] = []
    for job, at in posted:
        events = d.events(job, timeout=min(120.0, max(10.0, ctx.left())))
        if events[-1].get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {events[-1]}")
        seg = next(float(e["ts"]) for e in events if e["type"] == "segment")
        firsts.append(seg - at)
        ends.append(float(events[-1]["ts"]))
    return max(ends) - t0, firsts


def bench_engine_core(ctx: Ctx) -> list[Row]:
    stages: dict[str, Any] = {"inline": vllm_stage(max_inflight=16, engine_core="inline"),
                              "process": vllm_stage(max_inflight=16, engine_core="process")}
    d = start_daemon(stages, {"inline": {"stages": ["inline"]}, "process": {"stages": ["process"]}}, timeout=300)
    try:
        for where in ("inline", "process"):
            _round(ctx, d, where, 4, 8)                       # warm-up
        walls: dict[str, list[float]] = {"inline": [], "process": []}
        firsts: dict[str, list[float]] = {"inline": [], "process": []}
        for i in range(ctx.n(5, 2)):
            ctx.check(f"round {i}")
            for where in (("inline", "process") if i % 2 == 0 else ("process", "inline")):
                wall, first = _round(ctx, d, where)
                walls[where].append(wall)
                firsts[where].extend(first)
            ctx.log(f"round {i}: inline {walls['inline'][-1]:.2f} s, process {walls['process'][-1]:.2f} s")
    finally:
        d.stop()
    # The cancel: one job at a time (max_inflight 1), so the next job starts when the cancelled one is out.
    stages = {f"{w}1": vllm_stage(max_inflight=1, engine_core=w) for w in ("inline", "process")}
    d = start_daemon(stages, {s: {"stages": [s]} for s in stages}, timeout=300)
    lat: dict[str, list[float]] = {"inline": [], "process": []}
    step: dict[str, list[float]] = {"inline": [], "process": []}
    try:
        for i in range(ctx.n(3, 2)):
            ctx.check(f"cancel {i}")
            for where in ("inline", "process"):
                s = f"{where}1"
                a, b, _ = _cancel_to_next(ctx, d, s, {s: {"max_tokens": 480}}, {s: {"max_tokens": 4}},
                                          "segment", s, after=40, skip=10)
                lat[where].append(a)
                step[where].append(b)
    finally:
        d.stop()
    jps = {w: 16 / p50(x) for w, x in walls.items()}
    f50 = {w: 1000 * p50(x) for w, x in firsts.items()}
    f99 = {w: 1000 * pct(x, 0.99) for w, x in firsts.items()}
    cancel = {w: p50(lat[w]) / p50(step[w]) for w in lat}
    walls_note = "; ".join(f"{w} {', '.join(fmt(x) for x in v)} s" for w, v in walls.items())
    return [
        Row(FIGURES[0], jps["process"], "/s", "engine core inline", jps["inline"], "/s",
            jps["process"] / jps["inline"], "process / inline", at_least(1.0, ">= 1.0x"), f"walls: {walls_note}"),
        Row(FIGURES[1], f50["process"], "ms", "engine core inline", f50["inline"], "ms",
            f50["process"] / f50["inline"], "process / inline", None, f"{len(firsts['process'])} jobs each"),
        Row(FIGURES[2], f99["process"], "ms", "engine core inline", f99["inline"], "ms",
            f99["process"] / f99["inline"], "process / inline", at_most(1.0, "<= 1.0x"), ""),
        Row(FIGURES[3], 1000 * p50(lat["process"]), "ms", "one decode step (process core)",
            1000 * p50(step["process"]), "ms", cancel["process"], "latency / step", at_most(2.0, "<= 2 steps"),
            f"inline: {cancel['inline']:.2f} steps ({fmt(1000 * p50(lat['inline']))} ms)"),
    ]
