"""omnid benchmarks: `make bench` (or `.venv/bin/python tests/benchmarks/run.py [--quick] [--only X]`).

Runs every bench function in BENCHES, in order, each in its own time budget, against real daemons
on the tiny models, and prints ONE table: figure, value, anchor (what it is compared with, measured
in the same run), ratio, goal, and whether the goal is met. The table also goes, as JSON, to
.run/bench.json. A bench that fails or runs out of time prints `error: ...` in its value cells and
the suite goes on. Progress goes to stderr; the table to stdout.

The machine is shared and noisy: read the ratios, not the absolute values.
Not collected by pytest (no file here matches test_*.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_capacity  # noqa: E402
import bench_control  # noqa: E402
import bench_dataplane  # noqa: E402
import bench_dit  # noqa: E402
import bench_engine_core  # noqa: E402
import bench_engines  # noqa: E402
import bench_join  # noqa: E402
import bench_lora  # noqa: E402
import bench_omni  # noqa: E402
import bench_omni_load  # noqa: E402
import bench_peer  # noqa: E402
import bench_priorities  # noqa: E402
import bench_ray  # noqa: E402
import bench_realtime  # noqa: E402
import bench_resources  # noqa: E402
import bench_streaming  # noqa: E402
import bench_tensors  # noqa: E402
import bench_tracing  # noqa: E402
import bench_vad  # noqa: E402
from _harness import ROOT, Ctx, Row, Shared, fmt, shared_daemons  # noqa: E402


@dataclass
class Bench:
    name: str
    area: str
    fn: Callable[[Ctx], list[Row]]
    figures: list[str]            # the rows it gives, named for the error case
    budget_s: tuple[float, float]  # (full, --quick), not counting a shared daemon's start
    uses: tuple[str, ...]         # shared daemons
    fast: bool = False            # short and steady enough for `make bench-check` (check.py), twice a run


# The suite, in the order it runs. Streaming first: it is the priority.
BENCHES: list[Bench] = [
    Bench("windows", "streaming", bench_streaming.bench_streaming,
          ["streaming: submit -> 1st consumer segment, window 8", "streaming: submit -> job end, window 8"],
          (200, 90), ("engines",)),
    Bench("omni", "streaming", bench_omni.bench_omni, bench_omni.FIGURES, (900, 600), ()),
    Bench("omni_load", "streaming", bench_omni_load.bench_omni_load, bench_omni_load.FIGURES, (2700, 700), ()),
    Bench("realtime", "streaming", bench_realtime.bench_realtime, bench_realtime.FIGURES, (900, 700), ()),
    Bench("vad", "streaming", bench_vad.bench_vad, bench_vad.FIGURES, (600, 400), ()),
    Bench("tap_cost", "streaming", bench_tensors.bench_tap_cost,
          [f"vLLM decode step, {bench_tensors.BATCH} jobs: hidden-state tap + token_ids on"], (150, 90), ()),
    Bench("tensor_streams", "streaming", bench_tensors.bench_tensor_streams,
          ["hidden-state stream: submit -> 1st consumer window, window 8",
           "hidden-state stream: submit -> 1st consumer window, window [2, 8]"], (200, 120), ()),
    Bench("no_tensor_edge", "streaming", bench_tensors.bench_no_tensor_edge,
          ["vLLM decode step, no tensor edge: this tree"], (200, 120), ()),
    Bench("cancel_diffusers", "engines", bench_engines.bench_cancel_diffusers,
          ["cancel diffusers (500 steps) -> next job started"], (60, 40), ("engines",)),
    Bench("cancel_vllm", "engines", bench_engines.bench_cancel_vllm,
          ["cancel vLLM generation -> next job started"], (60, 40), ("engines",)),
    Bench("vllm_batching", "engines", bench_engines.bench_vllm_batching,
          ["vLLM 16 x 64 tokens, max_inflight 16: jobs/s"], (120, 60), ("engines",)),
    Bench("vllm_vs_raw", "engines", bench_engines.bench_vllm_vs_raw_engine,
          ["vLLM 16 x 64 tokens through omnid: jobs/s",
           "vLLM 16 x 64 tokens through omnid, against a split engine: jobs/s",
           "raw LLMEngine 16 x 64 tokens at once: jobs/s"], (240, 150), ("engines",)),
    Bench("engine_core", "engines", bench_engine_core.bench_engine_core, bench_engine_core.FIGURES, (900, 600), ()),
    Bench("sd_concurrency", "engines", bench_engines.bench_sd_concurrency,
          [f"tiny SD, {k} concurrent jobs: jobs/s" for k in (2, 4, 8)], (120, 70), ("engines",)),
    Bench("dit", "engines", bench_dit.bench_dit, bench_dit.FIGURES, (600, 420), ()),
    Bench("join", "engines", bench_join.bench_join, bench_join.FIGURES, (1500, 900), ()),
    Bench("lora", "engines", bench_lora.bench_lora, bench_lora.FIGURES, (900, 600), ()),   # its daemon's start too
    Bench("t2i", "engines", bench_engines.bench_t2i_throughput,
          ["t2i (vLLM 24 tok -> SD 12 steps), N jobs: jobs/s"], (120, 60), ("engines",)),
    Bench("startup", "engines", bench_engines.bench_startup,
          ["ready: all 5 stages (2 vLLM, SD, 2 python)", "cold process: launch -> first job done"],
          (150, 100), ("engines",)),
    Bench("pipelining", "dataplane", bench_dataplane.bench_pipelining,
          ["pipelining: 8 jobs x 2 stages of 0.25 s, wall", "pipelining: same wall vs serial"],
          (40, 20), ("control",), fast=True),
    Bench("tensor_handoff", "dataplane", bench_dataplane.bench_tensor_handoff,
          ["tensor hand-off: 256 MiB fp16, stage -> stage"], (120, 60), ("control",)),
    Bench("noop_latency", "control", bench_control.bench_noop_latency,
          ["no-op job, 1 stage: submit -> terminal event, p50", "no-op job, each further stage hop, p50"],
          (90, 45), ("control",)),
    Bench("segment_path", "control", bench_control.bench_segment_path,
          ["supervisor CPU per streamed segment (3000 segments, an event reader)"], (90, 60), ("control",), fast=True),
    Bench("api_concurrency", "control", bench_control.bench_api_concurrency,
          ["POST /v1/jobs, 32 clients, 2-stage no-op: jobs/s", "GET /v1/jobs/{id}, 32 clients: req/s"],
          (120, 60), ("control",)),
    Bench("replicas", "capacity", bench_capacity.bench_replicas,
          ["CPU-bound python stage, N jobs: 2 replicas, jobs/s"], (150, 80), ()),
    Bench("wake", "capacity", bench_capacity.bench_wake,
          ["sleeping tiny-vLLM stage: submit -> job done (wake included)"], (200, 120), ()),
    Bench("ray", "ray", bench_ray.bench_ray,
          ["Ray hop: 3-stage no-op, middle stage Ray-placed, p50",
           "256 MiB fp16 hand-off, local -> local (same run)",
           "256 MiB fp16 hand-off, local -> Ray-placed (across raylets)",
           "256 MiB fp16 hand-off, Ray-placed -> local (across raylets)"],
          (240, 150), ()),
    Bench("peer", "engines", bench_peer.bench_peer, bench_peer.FIGURES, (3600, 1500), ()),  # 4 or 12 server starts
    Bench("tracing", "control", bench_tracing.bench_tracing, bench_tracing.FIGURES, (420, 240), ()),
    Bench("held_streams", "control", bench_resources.bench_held_streams,
          ["GET /v1/health p50 with N event streams held"], (90, 45), ("control",), fast=True),
    Bench("fair_wait", "priorities", bench_priorities.bench_fair_wait, [bench_priorities.FIGURES[0]], (120, 90), ()),
    Bench("priority_ttft", "priorities", bench_priorities.bench_priority_ttft, [bench_priorities.FIGURES[1]],
          (300, 240), ()),
    Bench("fair_post", "priorities", bench_priorities.bench_fair_post, [bench_priorities.FIGURES[2]], (150, 100), ()),
    Bench("supervisor_rss", "control", bench_control.bench_supervisor_rss,
          ["supervisor RSS after N no-op jobs"], (150, 45), ("control",)),
]

GRACE_S = 15.0     # past its budget, a bench's thread gets this long to notice before it is abandoned


def run_bench(b: Bench, quick: bool, shared: Shared) -> tuple[list[Row], list[str], float]:
    """Run one bench in a thread, bounded by its budget; rows (error rows on failure), problems, seconds."""
    budget = b.budget_s[1] if quick else b.budget_s[0]
    ctx = Ctx(quick, shared, budget, b.name)
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["rows"] = b.fn(ctx)
        except BaseException as e:      # reported in the table
            box["error"] = e
            box["trace"] = traceback.format_exc()

    t = threading.Thread(target=body, name=f"bench-{b.name}", daemon=True)
    started = time.monotonic()
    t.start()
    while t.is_alive() and (ctx.starting or time.monotonic() < ctx.deadline + GRACE_S):
        t.join(0.2)
    seconds = time.monotonic() - started
    if t.is_alive():
        err = f"timed out after {seconds:.0f} s (budget {budget:g} s)"
        return [Row(f, error=err) for f in b.figures], ctx.problems, seconds
    if "error" in box:
        e = box["error"]
        print(str(box.get("trace", "")), file=sys.stderr)
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return [Row(f, error=msg) for f in b.figures], ctx.problems, seconds
    rows = box["rows"]
    assert isinstance(rows, list)
    return rows, ctx.problems, seconds


def cells(r: Row) -> list[str]:
    if r.error is not None:
        return [r.figure, f"error: {r.error}", "", "", r.goal.text if r.goal else "", ""]
    anchor = f"{r.anchor}: {fmt(r.anchor_value, r.anchor_unit)}" if r.anchor else "-"
    ratio = f"{fmt(r.ratio, 'x')} ({r.ratio_def})" if r.ratio is not None else "-"
    met = {True: "yes", False: "NO", None: "-"}[r.met]
    return [r.figure, fmt(r.value, r.unit), anchor, ratio, r.goal.text if r.goal else "-", met]


def table(rows: list[Row]) -> str:
    head = ["figure", "value", "anchor (same run)", "ratio", "goal", "met"]
    body = [cells(r) for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    widths[1] = min(widths[1], 60)

    def line(cs: list[str]) -> str:
        return " | ".join(c.ljust(w) if len(c) <= w else c for c, w in zip(cs, widths)).rstrip()

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), sep] + [line(c) for c in body])


def run_suite(selected: list[Bench], quick: bool) -> tuple[list[Row], list[str], dict[str, float], float]:
    """Run the benches in order, on shared daemons started for this run; (rows, problems, seconds
    per bench, seconds in all). Progress goes to stderr."""
    shared = shared_daemons()
    rows: list[Row] = []
    problems: list[str] = []
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    print(f"omnid benchmarks ({'quick' if quick else 'full'}): {', '.join(b.name for b in selected)}",
          file=sys.stderr, flush=True)
    try:
        for i, b in enumerate(selected):
            print(f"- {b.name} ...", file=sys.stderr, flush=True)
            got, probs, seconds = run_bench(b, quick, shared)
            for r in got:
                r.bench = b.name
            rows += got
            problems += probs
            timings[b.name] = round(seconds, 1)
            for r in got:
                print(f"  {r.figure}: " + (f"error: {r.error}" if r.error else
                                            f"{fmt(r.value, r.unit)}, ratio {fmt(r.ratio, 'x')}"),
                      file=sys.stderr, flush=True)
            # a shared daemon no later bench needs is stopped now (less noise for the rest)
            later = {u for rest in selected[i + 1:] for u in rest.uses}
            for name in list(shared.daemons):
                if name not in later:
                    problems += shared.stop(name)
    finally:
        problems += shared.stop_all()
    return rows, problems, timings, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about 3 minutes)")
    ap.add_argument("--only", default="", help="comma-separated bench names or areas "
                    f"({', '.join(sorted({b.area for b in BENCHES}))}; {', '.join(b.name for b in BENCHES)})")
    ap.add_argument("--json", default=str(ROOT / ".run" / "bench.json"), help="where to write the table as JSON")
    ap.add_argument("--list", action="store_true", help="list the benches and exit")
    args = ap.parse_args(argv)
    if args.list:
        for b in BENCHES:
            doc = b.fn.__doc__ or sys.modules[b.fn.__module__].__doc__ or ""     # (the bench's, else its module's)
            print(f"{b.name:18} {b.area:10} {(doc.strip().splitlines() or [''])[0]}")
        return 0
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    unknown = wanted - {b.name for b in BENCHES} - {b.area for b in BENCHES}
    if unknown:
        ap.error(f"unknown bench or area: {', '.join(sorted(unknown))}")
    selected = [b for b in BENCHES if not wanted or b.name in wanted or b.area in wanted]

    rows, problems, timings, total = run_suite(selected, args.quick)
    out = table(rows)
    print()
    print(out)
    print(f"\n{len(rows)} rows in {total:.0f} s; {sum(r.error is not None for r in rows)} errors; "
          f"goals met: {sum(r.met is True for r in rows)} of {sum(r.met is not None for r in rows)}")
    for p in problems:
        print(f"problem: {p}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"mode": "quick" if args.quick else "full", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "seconds": round(total, 1), "bench_seconds": timings,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                    "load_avg": os.getloadavg()},
           "rows": [r.to_json() for r in rows], "problems": problems, "table": out}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"(written to {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
