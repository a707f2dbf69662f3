"""Step-level batching of diffusers stages (`batching = "step"`) against call-level (`"call"`).

One daemon of its own, on the tiny SD and the tiny Flux DiT (64 px), each with two stages of
`max_inflight = 8`: `sd` / `dit` (step: a job joins the running batch at the next denoising step)
and `sdcall` / `ditcall` (call: compatible jobs run as one pipeline call, new ones wait for the
next). Per model:

- join: 7 jobs start; an 8th is submitted when the first of them is half-way: its submit -> 1st
  step, against the same job at an idle stage (goal <= 2x). The note has the same on the call stage.
- Poisson: jobs arrive at 1.5x one job's rate (1 / a lone job's time on the call stage), the same
  seeded arrival times for both stages: p95 of submit -> end (goal <= 0.7x the call stage's) and
  images/s (first submit -> last end; goal >= the call stage's).
- lone job: submit -> end of one job at an idle stage, step vs call (goal <= 1.05x), alternated.
"""

from __future__ import annotations

import random
import time
from typing import Any

from _harness import MODELS, Ctx, Daemon, Row, at_least, at_most, fmt, p50, pct, start_daemon

MODELS_ = {"sd": MODELS / "sd", "dit": MODELS / "dit"}
LABEL = {"sd": "tiny SD", "dit": "tiny DiT"}
FIGURES = [f"{LABEL[m]} {what}" for m in MODELS_ for what in (
    "join: 8th job arriving mid-batch, submit -> 1st step", "Poisson 1.5x: p95 job time",
    "Poisson 1.5x: images/s", "Poisson 0.8x: p95 job time", "lone job: submit -> end")]


def _config() -> tuple[dict[str, Any], dict[str, Any]]:
    stages = {}
    for model, path in MODELS_.items():
        stage = {"engine": "diffusers", "model": str(path), "devices": [], "max_inflight": 8, "queue_capacity": 64,
                 "defaults": {"height": 64, "width": 64, "seed": 0, "guidance_scale": 5.0}}
        stages[model] = stage
        stages[f"{model}call"] = {**stage, "batching": "call"}
    return stages, {name: {"stages": [name]} for name in stages}


def _first_step(d: Daemon, stage: str, params: dict[str, Any], prompt: str) -> tuple[float, float]:
    """(submit -> 1st step, submit -> end) of one job."""
    run = d.run(stage, {"prompt": prompt}, {stage: params}, timeout=180).check()
    return float(run.first(type="progress")["ts"]) - run.t0, run.end_ts() - run.t0


def _mid_batch(ctx: Ctx, d: Daemon, stage: str, steps: int) -> float:
    """7 jobs start; the 8th's submit -> 1st step, submitted when the first is half-way."""
    params = {stage: {"num_inference_steps": steps}}
    first = [d.submit(stage, {"prompt": f"a fox {j}"}, params) for j in range(7)]
    for ev in d.follow(first[0], 180):
        if ev.get("type") == "progress" and int(ev.get("done", 0)) >= steps // 2:
            break
    late, _ = _first_step(d, stage, {"num_inference_steps": steps}, "the late one")
    for job in first:
        if d.events(job, 180)[-1].get("state") != "succeeded":
            raise RuntimeError(f"a first-batch job {job} failed")
    return late


def _poisson(ctx: Ctx, d: Daemon, stage: str, steps: int, gaps: list[float]) -> tuple[list[float], float]:
    """Submit one job per gap (s after the last); (each job's submit -> end, images/s)."""
    sent: list[tuple[str, float]] = []
    t_next = time.time()
    for i, gap in enumerate(gaps):
        t_next += gap
        time.sleep(max(0.0, t_next - time.time()))
        t0 = time.time()
        sent.append((d.submit(stage, {"prompt": f"a bird {i}"}, {stage: {"num_inference_steps": steps, "seed": i}}),
                     t0))
    times, ends = [], []
    for job, t0 in sent:
        end = d.events(job, max(30.0, min(300.0, ctx.left())))[-1]
        if end.get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {end}")
        times.append(float(end["ts"]) - t0)
        ends.append(float(end["ts"]))
    return times, len(sent) / (max(ends) - sent[0][1])


def _rows(ctx: Ctx, d: Daemon, model: str) -> list[Row]:
    step, call = model, f"{model}call"
    steps = ctx.n(16, 8)
    label = LABEL[model]
    for stage in (step, call):
        d.run(stage, {"prompt": "warm"}, {stage: {"num_inference_steps": 2}}, timeout=120).check()
    lone: dict[str, list[float]] = {step: [], call: []}
    idle: dict[str, list[float]] = {step: [], call: []}
    for _ in range(ctx.n(3, 2)):
        for stage in (step, call):
            ctx.check(f"{stage} lone")
            first, end = _first_step(d, stage, {"num_inference_steps": steps}, "the late one")
            idle[stage].append(first)
            lone[stage].append(end)
    late: dict[str, list[float]] = {step: [], call: []}
    for _ in range(ctx.n(2, 1)):
        for stage in (step, call):
            ctx.check(f"{stage} mid-batch")
            late[stage].append(_mid_batch(ctx, d, stage, steps))
    ctx.log(f"{model}: lone {fmt(p50(lone[step]))} / {fmt(p50(lone[call]))} s, mid-batch 1st step "
            f"{fmt(p50(late[step]))} / {fmt(p50(late[call]))} s")
    rate = 1.5 / p50(lone[call])
    rng = random.Random(46)
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(ctx.n(24, 8) - 1)]
    ctx.check(f"{model} poisson")
    step_times, step_rate = _poisson(ctx, d, step, steps, gaps)
    ctx.check(f"{model} poisson, call")
    call_times, call_rate = _poisson(ctx, d, call, steps, gaps)
    n = len(gaps)
    # within capacity: on the CPU a batch's forward costs about the same per row at any size, so the stage
    # makes about one lone job's rate of images at most, and 1.5x that is an overload whose p95 is its backlog
    # (the same for both modes); at 0.8x a job's wait is what the batching mode makes it
    low = 0.8 / p50(lone[call])
    low_gaps = [0.0] + [rng.expovariate(low) for _ in range(ctx.n(24, 8) - 1)]
    ctx.check(f"{model} poisson 0.8x")
    step_low, _ = _poisson(ctx, d, step, steps, low_gaps)
    ctx.check(f"{model} poisson 0.8x, call")
    call_low, _ = _poisson(ctx, d, call, steps, low_gaps)
    join_idle = p50(idle[step])
    call_ratio = p50(late[call]) / max(p50(idle[call]), 1e-3)
    return [
        Row(f"{label} join: 8th job arriving mid-batch, submit -> 1st step", p50(late[step]), "s",
            "the same job at an idle stage", join_idle, "s", p50(late[step]) / max(join_idle, 1e-3), "mid-batch / idle",
            at_most(2.0, "<= 2x"),
            f"{steps} steps, max_inflight 8, 7 jobs running, the 8th submitted at the first one's step {steps // 2}; "
            f"call-level batching: {fmt(p50(late[call]))} s, {fmt(call_ratio)}x its idle job's "
            f"{fmt(p50(idle[call]))} s; medians of {len(late[step])}"),
        Row(f"{label} Poisson 1.5x: p95 job time", pct(step_times, 0.95), "s", "call-level batching",
            pct(call_times, 0.95), "s", pct(step_times, 0.95) / pct(call_times, 0.95), "step / call",
            at_most(0.7, "<= 0.7x"),
            f"{n} jobs of {steps} steps at {fmt(rate)}/s (1.5 / a lone job's {fmt(p50(lone[call]))} s), the same "
            f"arrival times; p50 {fmt(p50(step_times))} s vs {fmt(p50(call_times))} s"),
        Row(f"{label} Poisson 1.5x: images/s", step_rate, "/s", "call-level batching", call_rate, "/s",
            step_rate / call_rate, "step / call", at_least(1.0, ">= 1x"), "first submit -> last end"),
        Row(f"{label} Poisson 0.8x: p95 job time", pct(step_low, 0.95), "s", "call-level batching",
            pct(call_low, 0.95), "s", pct(step_low, 0.95) / pct(call_low, 0.95), "step / call",
            at_most(0.7, "<= 0.7x"),
            f"{n} jobs at {fmt(low)}/s (0.8 / a lone job's time: within what the stage makes), the same arrival "
            f"times; p50 {fmt(p50(step_low))} s vs {fmt(p50(call_low))} s"),
        Row(f"{label} lone job: submit -> end", p50(lone[step]), "s", "call-level batching (today)", p50(lone[call]),
            "s", p50(lone[step]) / p50(lone[call]), "step / call", at_most(1.05, "<= 1.05x"),
            f"{steps} steps, 64 px, an idle stage; alternated, medians of {len(lone[step])}: step "
            f"{', '.join(fmt(x) for x in lone[step])} s; call {', '.join(fmt(x) for x in lone[call])} s"),
    ]


def bench_join(ctx: Ctx) -> list[Row]:
    """Step-level against call-level batching on the tiny SD and the tiny DiT."""
    stages, pipelines = _config()
    d = start_daemon(stages, pipelines)
    ctx.log(f"daemon ready in {fmt(d.ready_s)} s")
    rows: list[Row] = []
    try:
        for model in MODELS_:
            rows += _rows(ctx, d, model)
    finally:
        d.stop()
    return rows
