"""Benchmark: pipelining, throughput and cancel latency, printed as figures.

Not a test (pytest does not collect it): run `.venv/bin/python tests/bench_pipeline.py`.
It starts real daemons, as the tests do, and prints:

1. two python stages of T seconds each, N jobs: wall time against the ideal
   (N+1)·T and the serial 2N·T;
2. the tiny t2i pipeline (vLLM -> diffusers), N jobs: jobs/s, p50/p95 latency,
   and each stage's busy share;
3. cancel latency: cancel of a long diffusers job -> the next job's first step.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import (MODELS, RunningDaemon, daemon_config, launch, py_stage,  # noqa: E402
                      short_tmpdir, wait_ready)


def _daemon(stages: dict, pipelines: dict) -> RunningDaemon:
    d = short_tmpdir()
    cfg = daemon_config(d, stages, pipelines, {"log_level": "warning"})
    rd = RunningDaemon(launch(cfg, d / "omnid.log"), d, cfg, d / "omnid.sock", d / "state", d / "lock",
                       d / "omnid.log")
    wait_ready(rd, timeout=300)
    return rd


def bench_pipelining(t: float = 0.25, n: int = 8) -> None:
    d = _daemon({"a": py_stage("sleep", defaults={"seconds": t}), "b": py_stage("sleep", defaults={"seconds": t})},
                {"ab": {"stages": ["a", "b"]}})
    try:
        t0 = time.time()
        jobs = [d.submit("ab", {"text": str(i)}) for i in range(n)]
        docs = [d.wait(j) for j in jobs]
        wall = max(doc["finished_at"] for doc in docs) - t0
        print(f"pipelining: {n} jobs through 2 stages of {t:.2f} s: {wall:.2f} s "
              f"(ideal (N+1)T = {(n + 1) * t:.2f} s, serial 2NT = {2 * n * t:.2f} s)")
    finally:
        d.stop()


def bench_t2i(n: int = 12) -> None:
    stages = {
        "expand": {"engine": "vllm", "model": str(MODELS / "llm"), "args": {"max_model_len": 256, "seed": 0},
                   "defaults": {"max_tokens": 24, "include_prompt": True}},
        "draw": {"engine": "diffusers", "model": str(MODELS / "sd"),
                 "defaults": {"num_inference_steps": 12, "seed": 0}},
    }
    d = _daemon(stages, {"t2i": {"stages": ["expand", "draw"],
                                 "edges": [{"from": "expand", "to": "draw", "map": {"prompt": "text"}}]},
                         "draw": {"stages": ["draw"]}})
    try:
        d.wait(d.submit("t2i", {"prompt": "warm up"}))
        t0 = time.time()
        jobs = [d.submit("t2i", {"prompt": f"prompt {i}"}) for i in range(n)]
        docs = [d.wait(j) for j in jobs]
        wall = max(doc["finished_at"] for doc in docs) - t0
        lat = sorted(doc["finished_at"] - doc["created_at"] for doc in docs)
        busy = {s: sum(doc["stages"][s]["elapsed_s"] for doc in docs) / wall for s in ("expand", "draw")}
        print(f"t2i tiny: {n} jobs in {wall:.2f} s = {n / wall:.2f} jobs/s; latency p50 "
              f"{statistics.median(lat):.2f} s, p95 {lat[int(0.95 * (n - 1))]:.2f} s; busy share "
              + ", ".join(f"{s} {v:.0%}" for s, v in busy.items()))
        rss = {n_: s["rss_bytes"] / 2**20 for n_, s in d.stages().items()}
        print("  worker RSS: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss.items()))
        # cancel latency inside diffusers
        long = d.submit("draw", {"prompt": "long"}, params={"draw": {"num_inference_steps": 500}})
        nxt = d.submit("draw", {"prompt": "next"})
        for ev in d.client.events(long):
            if ev["type"] == "progress" and ev["done"] >= 3:
                break
        t_cancel = time.time()
        d.client.cancel(long)
        started = next(e["ts"] for e in d.client.events(nxt) if e["type"] == "stage_started")
        first_step = next(e["ts"] for e in d.events(nxt) if e["type"] == "progress")
        print(f"cancel: running diffusers job -> next job started {1000 * (started - t_cancel):.0f} ms, "
              f"its first step {1000 * (first_step - t_cancel):.0f} ms after the cancel")
    finally:
        d.stop()


if __name__ == "__main__":
    bench_pipelining()
    bench_t2i()
