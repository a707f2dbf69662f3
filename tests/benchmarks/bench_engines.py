"""The engines in their warm workers: cancel latency, vLLM batching, start-up, diffusers batching.

Mostly on the shared "engines" daemon (vLLM `gen` with max_inflight 16 and `gen1` with 1,
diffusers `draw`, see _harness.engines_config); the start-up row starts its own daemon, and the
raw-engine row runs vLLM's LLMEngine in a subprocess (_raw_vllm.py).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from typing import Any

from _harness import BENCH_DIR, MODELS, VLLM_ARGS, Ctx, Daemon, Row, at_least, engines_config, fmt, p50, start_daemon


def _steps(ts: list[float], skip: int) -> float:
    """Median gap between consecutive timestamps, after the first `skip` ones."""
    gaps = [b - a for a, b in zip(ts[skip:], ts[skip + 1:])]
    if not gaps:
        raise RuntimeError("too few steps to time one")
    return p50(gaps)


def _cancel_to_next(ctx: Ctx, d: Daemon, pipeline: str, long_params: dict[str, Any],
                    next_params: dict[str, Any], step_type: str, stage: str, after: int,
                    skip: int) -> tuple[float, float, float]:
    """Start a long job, queue a short one behind it, cancel the long one after `after` steps.

    Returns, in s: cancel -> the next job's stage_started; the long job's median step; cancel ->
    the next job's first step. The cancel time is the wall clock just before `POST .../cancel`.
    """
    long = d.submit(pipeline, {"prompt": "a long one"}, long_params)
    nxt = d.submit(pipeline, {"prompt": "the next one"}, next_params)
    ts: list[float] = []
    stream = d.follow(long, timeout=min(60.0, max(5.0, ctx.left())))
    try:
        for ev in stream:
            if ev["type"] == step_type and ev.get("stage") == stage:
                ts.append(float(ev["ts"]))
                if len(ts) >= after:
                    break
            if ev["type"] == "state" and ev["state"] not in ("queued", "running"):
                raise RuntimeError(f"the long job ended early: {ev}")
    finally:
        stream.close()
    t_cancel = time.time()
    d.client.cancel(long)
    started = first_step = None
    for ev in d.follow(nxt, timeout=60):
        if ev["type"] == "stage_started" and started is None:
            started = float(ev["ts"])
        if ev["type"] == step_type and first_step is None:
            first_step = float(ev["ts"])
    if started is None or first_step is None:
        raise RuntimeError("the next job never started, or made no step")
    end = d.events(long, timeout=30)[-1]
    if end.get("state") != "cancelled":
        raise RuntimeError(f"the long job ended {end.get('state')}, not cancelled")
    return started - t_cancel, _steps(ts, skip), first_step - t_cancel


def _cancel_rows(ctx: Ctx, figure: str, anchor: str, first: str, pipeline: str, long_params: dict[str, Any],
                 next_params: dict[str, Any], step_type: str, stage: str, after: int, skip: int) -> list[Row]:
    """The row of a cancel -> next job started figure: `_cancel_to_next` a few times, the medians."""
    d = ctx.daemon("engines")
    lat: list[float] = []
    step: list[float] = []
    firsts: list[float] = []
    for i in range(ctx.n(3, 2)):
        ctx.check(f"run {i}")
        a, b, c = _cancel_to_next(ctx, d, pipeline, long_params, next_params, step_type, stage, after=after, skip=skip)
        lat.append(a)
        step.append(b)
        firsts.append(c)
        ctx.log(f"run {i}: cancel -> next started {1000 * a:.1f} ms; step {1000 * b:.2f} ms")
    latency, one = p50(lat), p50(step)
    return [Row(figure, 1000 * latency, "ms", anchor, 1000 * one, "ms", latency / one, "latency / step", None,
                f"median of {len(lat)}: {', '.join(fmt(1000 * x) for x in lat)} ms; the next job's first "
                f"{first} came {fmt(1000 * p50(firsts))} ms after the cancel")]


def bench_cancel_diffusers(ctx: Ctx) -> list[Row]:
    """A running 500-step tiny-SD job cancelled after 12 steps -> the queued next job's stage_started.

    Anchor: one denoising step of the cancelled job (median gap between its progress events,
    skipping the first 3). Median over runs.
    """
    return _cancel_rows(ctx, "cancel diffusers (500 steps) -> next job started", "one denoising step", "step",
                        "draw", {"draw": {"num_inference_steps": 500}}, {"draw": {"num_inference_steps": 2}},
                        "progress", "draw", after=12, skip=3)


def bench_cancel_vllm(ctx: Ctx) -> list[Row]:
    """A running 480-token generation (gen1, max_inflight 1) cancelled after 40 tokens -> next job started.

    Anchor: one decode step of the cancelled job (median gap between its token segments,
    skipping the first 10). Median over runs.
    """
    return _cancel_rows(ctx, "cancel vLLM generation -> next job started", "one decode step", "token",
                        "llm1", {"gen1": {"max_tokens": 480}}, {"gen1": {"max_tokens": 4}},
                        "segment", "gen1", after=40, skip=10)


def _batch_wall(ctx: Ctx, d: Daemon, pipeline: str, stage: str, n: int, tokens: int) -> float:
    """Submit n jobs of `tokens` tokens at once; seconds from before the first POST to the last end."""
    t0 = time.time()
    jobs = [d.submit(pipeline, {"prompt": f"prompt {i}"}, {stage: {"max_tokens": tokens}}) for i in range(n)]
    ends = []
    for job in jobs:
        end = d.events(job, timeout=min(120.0, max(10.0, ctx.left())))[-1]
        if end.get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {end}")
        ends.append(float(end["ts"]))
    return max(ends) - t0


def bench_vllm_batching(ctx: Ctx) -> list[Row]:
    """16 concurrent 64-token jobs on vLLM with max_inflight 16 (`gen`) vs 1 (`gen1`), through the daemon.

    Value and anchor are jobs/s (16 / wall, wall = before the first POST to the last terminal
    event); ratio = batched / one at a time. Median over runs, the two alternating.
    """
    d = ctx.daemon("engines")
    _batch_wall(ctx, d, "llm", "gen", 2, 8)
    _batch_wall(ctx, d, "llm1", "gen1", 2, 8)
    many: list[float] = []
    one: list[float] = []
    for i in range(ctx.n(3, 1)):
        ctx.check(f"run {i}")
        many.append(_batch_wall(ctx, d, "llm", "gen", 16, 64))
        one.append(_batch_wall(ctx, d, "llm1", "gen1", 16, 64))
        ctx.log(f"run {i}: max_inflight 16 {many[-1]:.2f} s, max_inflight 1 {one[-1]:.2f} s")
    m, o = 16 / p50(many), 16 / p50(one)
    return [Row("vLLM 16 x 64 tokens, max_inflight 16: jobs/s", m, "/s", "same, max_inflight 1", o, "/s",
                m / o, "16 / 1", at_least(10, ">= 10x"),
                f"walls: inflight 16 {', '.join(fmt(x) for x in many)} s; 1 {', '.join(fmt(x) for x in one)} s")]


def _read_json_line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next stdout line of `proc`, as JSON; TimeoutError past `timeout` s, RuntimeError if it exits."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the raw engine said nothing within {timeout:g} s")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the raw engine exited ({proc.poll()})")
            if line.startswith("{"):
                return dict(json.loads(line))
        elif proc.poll() is not None:
            raise RuntimeError(f"the raw engine exited ({proc.returncode})")


class _RawEngine:
    """_raw_vllm.py in a subprocess (`mode` inline or process), loaded; `wall(line)` runs one batch."""

    def __init__(self, ctx: Ctx, mode: str) -> None:
        self.ctx = ctx
        self.log = open(ctx.scratch(f"raw_vllm_{mode}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, str(BENCH_DIR / "_raw_vllm.py"), str(MODELS / "llm"),
                                      json.dumps(VLLM_ARGS), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.load_s = float(_read_json_line(self.proc, max(30.0, min(180.0, ctx.left())))["load_s"])
        ctx.log(f"raw engine ({mode}) loaded in {self.load_s:.1f} s")

    def wall(self, line: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return float(_read_json_line(self.proc, max(10.0, min(120.0, self.ctx.left())))["wall"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench_vllm_vs_raw_engine(ctx: Ctx) -> list[Row]:
    """The same batch (16 x 64 tokens, greedy, ignore_eos) through the daemon vs vLLM's LLMEngine
    driven by one process: its engine core in that process (`inline`, the issue's anchor) and in a
    child process (`process`: vLLM's multiprocessing LLMEngine, split as omnid splits it).

    Daemon: pipeline `llm` (gen, max_inflight 16): before the first POST -> the last terminal event.
    Raw: _raw_vllm.py subprocesses built with omnid's engine arguments, add 16 requests -> all
    finished (their load is not counted). Runs alternate daemon / inline / process, medians are
    compared; ratio = daemon jobs/s / raw jobs/s. A third row: the inline engine's own 16 at once
    against the same 16 one after another (the ceiling of the max_inflight 16 vs 1 row).
    """
    d = ctx.daemon("engines")
    runs = ctx.n(5, 2)
    _batch_wall(ctx, d, "llm", "gen", 2, 8)
    raws: dict[str, _RawEngine] = {}
    walls: dict[str, list[float]] = {"omnid": [], "inline": [], "process": [], "serial": []}
    try:
        for mode in ("inline", "process"):
            raws[mode] = _RawEngine(ctx, mode)
        for i in range(runs):
            ctx.check(f"run {i}")
            walls["omnid"].append(_batch_wall(ctx, d, "llm", "gen", 16, 64))
            walls["inline"].append(raws["inline"].wall("16 64"))
            walls["process"].append(raws["process"].wall("16 64"))
            if i < 2:
                walls["serial"].append(raws["inline"].wall("16 64 serial"))
            ctx.log(f"run {i}: omnid {walls['omnid'][-1]:.2f} s, raw inline {walls['inline'][-1]:.2f} s, "
                    f"raw process {walls['process'][-1]:.2f} s")
    finally:
        for raw in raws.values():
            raw.close()
    dj, ij, pj, sj = (16 / p50(walls[k]) for k in ("omnid", "inline", "process", "serial"))

    def said(key: str) -> str:
        return ", ".join(fmt(x) for x in walls[key])
    return [Row("vLLM 16 x 64 tokens through omnid: jobs/s", dj, "/s", "raw LLMEngine, its core in one process",
                ij, "/s", dj / ij, "omnid / raw", at_least(0.9, ">= 0.9x"),
                f"walls: omnid {said('omnid')} s; raw {said('inline')} s"),
            Row("vLLM 16 x 64 tokens through omnid, against a split engine: jobs/s", dj, "/s",
                "vLLM's LLMEngine, its core in a child process", pj, "/s", dj / pj, "omnid / raw process",
                at_least(0.9, ">= 0.9x"), f"walls: omnid {said('omnid')} s; raw process {said('process')} s"),
            Row("raw LLMEngine 16 x 64 tokens at once: jobs/s", ij, "/s", "the same 16 one after another", sj,
                "/s", ij / sj, "16 / 1", None, f"walls: one after another {said('serial')} s (the max_inflight "
                "16 vs 1 row's ceiling)")]


def bench_startup(ctx: Ctx) -> list[Row]:
    """Ready time of the whole engines daemon vs its slowest stage alone; a cold first job vs a warm one.

    All stages: the shared engines daemon's launch -> /v1/ready (2 vLLM, 1 diffusers, 2 python
    stages loading in parallel). Its slowest stage (by `load_s`) is then started alone in a
    fresh daemon: launch -> ready is the anchor. In that fresh daemon the first job (64 tokens, or
    10 steps) is timed from launch to its terminal event ("cold"), vs the same job on the warm
    engines daemon (median of 4: 2 before the cold daemon, 2 after).
    """
    d = ctx.daemon("engines")
    if d.ready_s is None:
        raise RuntimeError("the engines daemon has no ready time")
    loads = {name: s.get("load_s") or 0.0 for name, s in d.stages().items()}
    slowest = max(loads, key=lambda k: loads[k])
    stages, pipelines = engines_config()
    pipeline = next(p for p, spec in pipelines.items() if spec["stages"] == [slowest])
    kind = stages[slowest]["engine"]
    params = {slowest: {"max_tokens": 64} if kind == "vllm" else {"num_inference_steps": 10}}
    warm_runs = []

    def warm() -> None:
        r = d.run(pipeline, {"prompt": "a lighthouse"}, params, timeout=60).check()
        warm_runs.append(r.end_ts() - r.t0)

    warm()                                   # the warm job: 2 runs before the cold daemon, 2 after
    warm()
    ctx.check("before the cold daemon")
    alone = start_daemon({slowest: stages[slowest]}, {pipeline: {"stages": [slowest]}},
                         timeout=max(30.0, min(300.0, ctx.left())))
    try:
        cold_run = alone.run(pipeline, {"prompt": "a lighthouse"}, params, timeout=60).check()
        cold = cold_run.end_ts() - alone.launched_wall
        cold_job = cold_run.end_ts() - cold_run.t0
    finally:
        try:
            alone.stop()
        except Exception as e:
            ctx.problems.append(f"startup bench, the daemon with {slowest} alone: {e}")
    assert alone.ready_s is not None
    warm()
    warm()
    others = ", ".join(f"{k} {v:.1f}" for k, v in sorted(loads.items(), key=lambda kv: -kv[1]))
    return [
        Row("ready: all 5 stages (2 vLLM, SD, 2 python)", d.ready_s, "s", f"slowest ({slowest}) alone",
            alone.ready_s, "s", d.ready_s / alone.ready_s, "all / alone", None,
            f"load_s in the all-stages daemon: {others}"),
        Row(f"cold process: launch -> first {kind} job done", cold, "s", "same job, warm", p50(warm_runs), "s",
            cold / p50(warm_runs), "cold / warm", None,
            f"the cold job itself (submit -> end) took {fmt(cold_job)} s; warm runs "
            f"{', '.join(fmt(x) for x in warm_runs)} s"),
    ]


def bench_sd_concurrency(ctx: Ctx) -> list[Row]:
    """k = 1, 2, 4, 8 tiny-SD jobs (10 steps; --quick: 6) submitted at once to the batching stage
    (`drawb`, max_inflight 8: jobs batched per denoising step): jobs/s against one job at a
    time on the plain stage (`draw`). Wall = before the first POST to the last end.
    """
    d = ctx.daemon("engines")
    for name in ("draw", "drawb"):
        d.run(name, {"prompt": "warm"}, {name: {"num_inference_steps": 2}}, timeout=60).check()
    steps = ctx.n(10, 6)
    rates: dict[int, list[float]] = {k: [] for k in (1, 2, 4, 8)}
    for i in range(ctx.n(3, 1)):
        for k in rates:
            ctx.check(f"k={k}")
            t0 = time.time()
            stage = "draw" if k == 1 else "drawb"
            jobs = [d.submit(stage, {"prompt": f"a fox {j}"}, {stage: {"num_inference_steps": steps}})
                    for j in range(k)]
            ends = []
            for job in jobs:                 # past the budget: give up (the runner reports a timeout)
                end = d.events(job, timeout=min(120.0, max(1.0, ctx.left())))[-1]
                if end.get("state") != "succeeded":
                    raise RuntimeError(f"job {job} ended {end}")
                ends.append(float(end["ts"]))
            rates[k].append(k / (max(ends) - t0))
    one = p50(rates[1])
    return [Row(f"tiny SD, {k} concurrent jobs, batched: jobs/s", p50(rates[k]), "/s", "1 job at a time", one,
                "/s", p50(rates[k]) / one, f"k={k} / k=1", None, f"{steps} steps; median of {len(rates[k])}")
            for k in (2, 4, 8)]


def bench_t2i_throughput(ctx: Ctx) -> list[Row]:
    """N t2i jobs (vLLM 24 tokens -> diffusers 12 steps) submitted at once: jobs/s vs the bottleneck stage.

    The anchor is what the slower stage alone allows: 1 / (its mean elapsed_s per job, from the job
    documents), so the ratio is how well the two stages overlap. The note has latency p50/p95 and
    each stage's busy share (sum of its elapsed_s / wall), and the workers' RSS. (The figures of
    the old tests/bench_pipeline.py.)
    """
    d = ctx.daemon("engines")
    n = ctx.n(12, 4)
    params = {"gen": {"max_tokens": 24, "include_prompt": True}, "draw": {"num_inference_steps": 12}}
    d.run("t2i", {"prompt": "warm up"}, params, timeout=60).check()
    ctx.check("after the warm-up")
    t0 = time.time()
    jobs = [d.submit("t2i", {"prompt": f"prompt {i}"}, params) for i in range(n)]
    for job in jobs:
        end = d.events(job, timeout=min(120.0, max(10.0, ctx.left())))[-1]
        if end.get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {end}")
    docs = [d.client.job(job) for job in jobs]
    wall = max(doc["finished_at"] for doc in docs) - t0
    lat = sorted(doc["finished_at"] - doc["created_at"] for doc in docs)
    per_job = {s: sum(doc["stages"][s]["elapsed_s"] for doc in docs) / n for s in ("gen", "draw")}
    bottleneck = max(per_job, key=lambda k: per_job[k])
    rate, ideal = n / wall, 1 / per_job[bottleneck]
    busy = ", ".join(f"{s} {per_job[s] * n / wall:.0%}" for s in per_job)
    rss = ", ".join(f"{k} {v['rss_bytes'] / 2**20:.0f}" for k, v in d.stages().items() if k in ("gen", "draw"))
    return [Row(f"t2i (vLLM 24 tok -> SD 12 steps), {n} jobs: jobs/s", rate, "/s",
                f"bottleneck stage ({bottleneck}) alone", ideal, "/s", rate / ideal, "t2i / bottleneck", None,
                f"latency p50 {fmt(p50(lat))} s, p95 {fmt(lat[round(0.95 * (n - 1))])} s; busy {busy}; "
                f"worker RSS MiB: {rss}")]
