"""DiT caching and joining on a diffusers stage, on the tiny DiT (.models/dit, a random-weight Flux).

One daemon of its own: `plain` (no cache), `fbc02` and `fbc05` (cache = first_block, threshold 0.2
and 0.5), and `batch` (no cache, max_inflight 8, `batching = "call"`) for the joining rows: they keep
the call-level figure; step-level batching has its own bench (bench_join.py).

- steps/s with the first-block cache against without (same prompt, same seed): a job's steps over
  its stage time (stage_finished's elapsed_s: prompt encoding and VAE decoding included, as a user
  sees them); and the PSNR of the cached image against the uncached one.
- joining: a diffusers batch takes new jobs only when a pipeline call starts. 7 jobs start one call
  on `batch`; an 8th arrives when that call is about half-way: its submit -> 1st step, and its
  submit -> end, against the same job arriving at an idle stage.
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

from _harness import MODELS, Ctx, Daemon, Row, at_least, fmt, p50, start_daemon

DIT = MODELS / "dit"
SIZE = {"height": 64, "width": 64}
THRESHOLDS = (0.2, 0.5)
FIGURES = [f"tiny DiT, first_block {t}: steps/s" for t in THRESHOLDS] + \
          [f"tiny DiT, first_block {t}: PSNR vs uncached" for t in THRESHOLDS] + \
          ["diffusers join: 8th job arriving mid-call, submit -> 1st step",
           "diffusers join: 8th job arriving mid-call, submit -> end"]


def _stage(**extra: Any) -> dict[str, Any]:
    return {"engine": "diffusers", "model": str(DIT), "devices": [], "defaults": {**SIZE, "seed": 0}, **extra}


def _config() -> tuple[dict[str, Any], dict[str, Any]]:
    stages = {"plain": _stage(), "batch": _stage(max_inflight=8, queue_capacity=16, batching="call")}
    for t in THRESHOLDS:
        stages[_name(t)] = _stage(cache={"kind": "first_block", "threshold": t})
    return stages, {name: {"stages": [name]} for name in stages}


def _name(threshold: float) -> str:
    return f"fbc{str(threshold).replace('.', '')}"


def _psnr(a: bytes, b: bytes) -> float:
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(io.BytesIO(a)).convert("RGB"), dtype=np.float64)
    y = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def _one(d: Daemon, stage: str, steps: int, prompt: str = "a red fox in the snow") -> tuple[float, bytes, dict[str, int]]:
    """(steps/s, the PNG, the cache's usage) of one job."""
    run = d.run(stage, {"prompt": prompt}, {stage: {"num_inference_steps": steps}}, timeout=120).check()
    finished = run.first(type="stage_finished", stage=stage)
    png, _ = d.client.output(run.job, "image")
    return steps / float(finished["elapsed_s"]), png, dict(finished.get("usage") or {})


def _cache_rows(ctx: Ctx, d: Daemon) -> list[Row]:
    steps = ctx.n(30, 20)
    for stage in ["plain", *(_name(t) for t in THRESHOLDS)]:
        _one(d, stage, 2)                                   # warm
    rates: dict[str, list[float]] = {}
    images: dict[str, bytes] = {}
    usage: dict[str, dict[str, int]] = {}
    for _ in range(ctx.n(3, 2)):
        for stage in ["plain", *(_name(t) for t in THRESHOLDS)]:
            ctx.check(stage)
            rate, images[stage], usage[stage] = _one(d, stage, steps)
            rates.setdefault(stage, []).append(rate)
            ctx.log(f"{stage}: {fmt(rate)} steps/s, {usage[stage] or 'no cache'}")
    plain = p50(rates["plain"])
    rows = []
    for t in THRESHOLDS:
        name = _name(t)
        u = usage[name]
        rows.append(Row(f"tiny DiT, first_block {t}: steps/s", p50(rates[name]), "/s", "no cache", plain, "/s",
                        p50(rates[name]) / plain, "cached / uncached", at_least(1.3, ">= 1.3x"),
                        f"{steps} steps, 64 px; {u.get('cache_hits')} hits, {u.get('cache_misses')} misses; "
                        f"median of {len(rates[name])} (stage time, encode and decode included)"))
    for t in THRESHOLDS:
        name = _name(t)
        rows.append(Row(f"tiny DiT, first_block {t}: PSNR vs uncached", _psnr(images["plain"], images[name]), "dB",
                        note="same seed and prompt; reported, no goal (random weights: an image of noise)"))
    return rows


def _join_rows(ctx: Ctx, d: Daemon) -> list[Row]:
    steps = ctx.n(32, 16)
    params = {"batch": {"num_inference_steps": steps}}
    d.run("batch", {"prompt": "warm"}, {"batch": {"num_inference_steps": 2}}, timeout=60).check()
    alone_start: list[float] = []
    alone_end: list[float] = []
    late_start: list[float] = []
    late_end: list[float] = []
    call_s: list[float] = []
    for _ in range(ctx.n(3, 1)):
        ctx.check("alone")
        run = d.run("batch", {"prompt": "the late one"}, params, timeout=120).check()
        alone_start.append(float(run.first(type="progress")["ts"]) - run.t0)
        alone_end.append(run.end_ts() - run.t0)
        ctx.check("mid-call")
        t_first = time.time()
        first = [d.submit("batch", {"prompt": f"a fox {j}"}, params) for j in range(7)]
        half = None
        for ev in d.follow(first[0], 120):           # until the 7-job call is half-way
            if ev.get("type") == "progress" and int(ev.get("done", 0)) >= steps // 2:
                half = ev
                break
        if half is None:
            raise RuntimeError("the 7-job call never reported half of its steps")
        ctx.log(f"7-job call at step {half.get('done')}: the 8th goes in")
        late = d.run("batch", {"prompt": "the late one"}, params, timeout=120).check()
        late_start.append(float(late.first(type="progress")["ts"]) - late.t0)
        late_end.append(late.end_ts() - late.t0)
        ends = [d.events(j, 120)[-1] for j in first]
        if any(e.get("state") != "succeeded" for e in ends):
            raise RuntimeError(f"a first-call job failed: {ends}")
        call_s.append(max(float(e["ts"]) for e in ends) - t_first)
    note = (f"{steps} steps, max_inflight 8: 7 jobs in one call, the 8th submitted at its step {steps // 2}; "
            f"the 7-job call took {fmt(p50(call_s))} s; medians of {len(late_start)}")
    return [
        Row("diffusers join: 8th job arriving mid-call, submit -> 1st step", p50(late_start), "s",
            "at an idle stage", p50(alone_start), "s", p50(late_start) / max(p50(alone_start), 1e-3),
            "mid-call / idle", None, note),
        Row("diffusers join: 8th job arriving mid-call, submit -> end", p50(late_end), "s",
            "at an idle stage", p50(alone_end), "s", p50(late_end) / p50(alone_end), "mid-call / idle", None,
            "it waits for the running call's remaining steps, then runs a call of its own"),
    ]


def bench_dit(ctx: Ctx) -> list[Row]:
    """The tiny DiT: first-block cache steps/s and PSNR vs uncached; a job joining a running batch."""
    stages, pipelines = _config()
    d = start_daemon(stages, pipelines)
    ctx.log(f"daemon ready in {fmt(d.ready_s)} s")
    try:
        rows = _cache_rows(ctx, d)
        ctx.log("cache rows done")
        rows += _join_rows(ctx, d)
    finally:
        d.stop()
    return rows
