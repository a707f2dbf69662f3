"""LoRA adapters on one warm base model (`lora` table): the tiny Llama with its two tiny adapters
(.models/llm-loras/{a,b}) on vLLM, the tiny SD with its adapter (.models/sd-loras/style) on diffusers.

One daemon of its own: `chat` (vLLM, lora a and b, max_inflight 8), `plain` (the same vLLM stage
without a lora table: vLLM's LoRA off), `draw` (diffusers, lora style).

- 8 vLLM jobs mixing the base model and the two adapters (3 base, 3 a, 2 b) against 8 base jobs, on
  the same stage: jobs/s (8 / wall, before the first POST to the last end); and, reported, 8 base
  jobs on `chat` against 8 on `plain` (what turning LoRA on costs the base model's jobs).
- diffusers: a job with the adapter against one without, steps/s (its steps over its stage time,
  prompt encoding and decoding included).
- an adapter added to the running vLLM stage while 8 jobs stream: jobs failed (none), and the
  longest gap between two token segments of a running job around the add against the median gap.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from _harness import MODELS, Ctx, Daemon, Row, at_least, at_most, fmt, p50, sd_stage, start_daemon, vllm_stage

LLM_LORAS = MODELS / "llm-loras"
SD_LORAS = MODELS / "sd-loras"
TOKENS = 64
MIX = [None, "a", "b", None, "a", "b", None, "a"]
FIGURES = ["vLLM 8 x 64 tokens, base + 2 adapters mixed: jobs/s",
           "vLLM 8 x 64 tokens, base jobs on a LoRA stage: jobs/s",
           "diffusers with an adapter: steps/s",
           "adapter added while 8 jobs stream: jobs failed",
           "adapter added while 8 jobs stream: longest token gap"]


def _config() -> tuple[dict[str, Any], dict[str, Any]]:
    lora = {"adapters": {"a": str(LLM_LORAS / "a"), "b": str(LLM_LORAS / "b")}, "max_loras": 2, "max_lora_rank": 8}
    stages = {"chat": vllm_stage(8, lora=lora, queue_capacity=16),
              "plain": vllm_stage(8, queue_capacity=16),
              "draw": sd_stage(lora={"adapters": {"style": str(SD_LORAS / "style")}, "max_lora_rank": 8})}
    return stages, {name: {"stages": [name]} for name in stages}


def _wall(ctx: Ctx, d: Daemon, stage: str, adapters: list[str | None]) -> float:
    t0 = time.time()
    jobs = [d.submit(stage, {"prompt": f"prompt {i}"},
                     {stage: {"max_tokens": TOKENS, **({"adapter": a} if a else {})}}) for i, a in enumerate(adapters)]
    ends = []
    for job in jobs:
        end = d.events(job, timeout=min(120.0, max(10.0, ctx.left())))[-1]
        if end.get("state") != "succeeded":
            raise RuntimeError(f"job {job} ended {end}")
        ends.append(float(end["ts"]))
    return max(ends) - t0


def _steps_per_s(d: Daemon, adapters: dict[str, float] | None, steps: int) -> float:
    params: dict[str, Any] = {"num_inference_steps": steps, **({"adapters": adapters} if adapters else {})}
    run = d.run("draw", {"prompt": "a red fox in the snow"}, {"draw": params}, timeout=120).check()
    return steps / float(run.first(type="stage_finished", stage="draw")["elapsed_s"])


def _add_while_streaming(ctx: Ctx, d: Daemon) -> tuple[int, float, float]:
    """(jobs failed, longest token gap around the add, median gap) of 8 jobs streaming on `chat`
    while adapter `c` is added (and removed after)."""
    jobs = [d.submit("chat", {"prompt": f"story {i}"}, {"chat": {"max_tokens": 256, **({"adapter": a} if a else {})}})
            for i, a in enumerate(MIX)]
    stamps: list[float] = []
    added: list[float] = []

    def add() -> None:
        time.sleep(1.0)
        t = time.time()
        d.client.add_adapter("chat", "c", str(LLM_LORAS / "a"))
        added.extend([t, time.time()])

    adder = threading.Thread(target=add)
    adder.start()
    ends = []
    for i, job in enumerate(jobs):
        for ev in d.follow(job, timeout=min(180.0, max(10.0, ctx.left()))):
            if i == 0 and ev.get("type") == "segment":
                stamps.append(float(ev["ts"]))
            if ev.get("type") == "state" and ev.get("state") in ("succeeded", "failed", "cancelled", "timed_out"):
                ends.append(ev.get("state"))
    adder.join()
    d.client.remove_adapter("chat", "c")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    if not gaps or not added:
        raise RuntimeError("no token gaps measured")
    around = [b - a for a, b in zip(stamps, stamps[1:]) if b >= added[0] - 0.5 and a <= added[1] + 0.5] or [0.0]
    return sum(1 for e in ends if e != "succeeded"), max(around), p50(gaps)


def bench_lora(ctx: Ctx) -> list[Row]:
    stages, pipelines = _config()
    d = start_daemon(stages, pipelines, timeout=480)      # (two vLLM stages and SD loading on a busy host)
    ctx.log(f"daemon ready in {fmt(d.ready_s)} s")
    try:
        _wall(ctx, d, "chat", ["a", None])          # warm
        _wall(ctx, d, "plain", [None, None])
        mixed: list[float] = []
        base: list[float] = []
        plain: list[float] = []
        for i in range(ctx.n(3, 1)):
            ctx.check(f"vllm run {i}")
            mixed.append(_wall(ctx, d, "chat", MIX))
            base.append(_wall(ctx, d, "chat", [None] * 8))
            plain.append(_wall(ctx, d, "plain", [None] * 8))
            ctx.log(f"run {i}: mixed {mixed[-1]:.2f} s, base {base[-1]:.2f} s, no lora {plain[-1]:.2f} s")
        m, b, p = 8 / p50(mixed), 8 / p50(base), 8 / p50(plain)
        ctx.check("add while streaming")
        failed, gap, median_gap = _add_while_streaming(ctx, d)
        ctx.log(f"add while streaming: {failed} failed, longest gap {gap * 1000:.0f} ms, median {median_gap * 1000:.0f} ms")
        steps = ctx.n(12, 6)
        _steps_per_s(d, None, 2)
        _steps_per_s(d, {"style": 1.0}, 2)
        with_a: list[float] = []
        without: list[float] = []
        for i in range(ctx.n(3, 2)):
            ctx.check(f"diffusers run {i}")
            without.append(_steps_per_s(d, None, steps))
            with_a.append(_steps_per_s(d, {"style": 1.0}, steps))
            ctx.log(f"run {i}: {with_a[-1]:.1f} steps/s with the adapter, {without[-1]:.1f} without")
    finally:
        d.stop()
    return [
        Row(FIGURES[0], m, "/s", "8 base jobs, same stage", b, "/s", m / b, "mixed / base", at_least(0.7, ">= 0.7x"),
            f"3 base, 3 a, 2 b (rank 8), {TOKENS} tokens each, max_inflight 8, max_loras 2; "
            f"walls mixed {', '.join(fmt(x) for x in mixed)} s, base {', '.join(fmt(x) for x in base)} s"),
        Row(FIGURES[1], b, "/s", "the same stage without lora", p, "/s", b / p, "lora on / off",
            note="what vLLM's LoRA costs jobs of the base model (reported, no goal)"),
        Row(FIGURES[2], p50(with_a), "/s", "the same job without", p50(without), "/s", p50(with_a) / p50(without),
            "adapter / none", at_least(0.8, ">= 0.8x"),
            f"tiny SD, {steps} steps, 64 px, rank 8 fused for the call on the UNet's attention; stage time, medians of {len(with_a)}"),
        Row(FIGURES[3], float(failed), "", goal=at_most(0, "none", on="value"),
            note="8 jobs of 256 tokens (base, a, b) streaming while POST /v1/stages/chat/adapters runs"),
        Row(FIGURES[4], gap * 1000, "ms", "median gap", median_gap * 1000, "ms", gap / max(median_gap, 1e-6),
            "around the add / median", note="between two token segments of a running job (reported, no goal)"),
    ]
