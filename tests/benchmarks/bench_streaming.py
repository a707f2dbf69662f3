"""Streaming edges: a vLLM stage feeding a python consumer, window = 8 against window = -1.

One daemon ("engines"), two pipelines sharing the vLLM stage `gen`: `s8` (gen -> down8 over a
`window = 8` edge) and `sall` (gen -> downall over a `window = -1` edge). The consumers are the
same function (`_stages.consume_windows`): one segment per window it receives, 2 ms of work each.
vLLM: the tiny Llama, max_model_len 512, 256 tokens, temperature 0, ignore_eos.
"""

from __future__ import annotations

from _harness import Ctx, Row, at_most, fmt, p50

TOKENS = 256
PROMPT = "a lighthouse on a cliff at dusk"


def bench_streaming(ctx: Ctx) -> list[Row]:
    """Submit -> first final-stage segment, and submit -> end, for window 8 and window -1.

    Runs alternate (w8, w-1, w8, ...) after one discarded warm-up each; medians are reported.
    Times are the daemon's event timestamps minus the wall clock just before the POST.
    """
    d = ctx.daemon("engines")
    runs = ctx.n(5, 3)
    gen = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    params = {"s8": {"gen": gen, "down8": {"work_s": 0.002}}, "sall": {"gen": gen, "downall": {"work_s": 0.002}}}
    first: dict[str, list[float]] = {"s8": [], "sall": []}
    total: dict[str, list[float]] = {"s8": [], "sall": []}
    windows: dict[str, int] = {}
    consumer = {"s8": "down8", "sall": "downall"}
    for i in range(runs + 1):
        for pipeline in ("s8", "sall"):
            ctx.check(f"run {i} of {pipeline}")
            r = d.run(pipeline, {"prompt": PROMPT}, params[pipeline], timeout=min(90.0, max(5.0, ctx.left()))).check()
            segs = r.all(type="segment", stage=consumer[pipeline])
            tokens = r.all(type="segment", stage="gen")
            if len(tokens) < TOKENS:
                raise RuntimeError(f"{pipeline}: vLLM gave {len(tokens)} token segments, not {TOKENS}")
            windows[pipeline] = len(segs)
            if i == 0:
                continue                      # warm-up
            first[pipeline].append(float(segs[0]["ts"]) - r.t0)
            total[pipeline].append(r.end_ts() - r.t0)
            ctx.log(f"{pipeline}: first {1000 * first[pipeline][-1]:.0f} ms, total {1000 * total[pipeline][-1]:.0f} ms")

    def spread(xs: list[float]) -> str:
        return f"{1000 * min(xs):.0f}..{1000 * max(xs):.0f} ms"

    f8, fall, t8, tall = p50(first["s8"]), p50(first["sall"]), p50(total["s8"]), p50(total["sall"])
    n = len(first["s8"])
    return [
        Row("streaming: submit -> 1st consumer segment, window 8", 1000 * f8, "ms",
            "same, window -1", 1000 * fall, "ms", f8 / fall, "w8 / w-1", at_most(0.2, "<= 0.2x"),
            f"median of {n}; w8 {spread(first['s8'])}, w-1 {spread(first['sall'])}; "
            f"{windows['s8']} consumer segments per w8 job, {windows['sall']} per w-1 job"),
        Row("streaming: submit -> job end, window 8", 1000 * t8, "ms",
            "same, window -1", 1000 * tall, "ms", t8 / tall, "w8 / w-1", at_most(1.1, "<= 1.1x"),
            f"median of {n}; w8 {spread(total['s8'])}, w-1 {spread(total['sall'])}; "
            f"{TOKENS} tokens: {fmt(1000 * tall / TOKENS)} ms per token end to end with w-1"),
    ]
