"""One figure for a python stage's `batch_function`: throughput of a CPU-bound torch stage
(tests/fixtures/batchstages.py `matmul`: each job's (4 x 1024) input, 50 rounds through a
(1024 x 1024) weight, 400 rounds by default) for 1 vs 8 concurrent jobs, beside the same work as a plain `function`.

`.venv/bin/python tests/benchmarks/python_batching_figure.py [--jobs 16] [--rounds 400]`. Not a test, not in
run.py's suite: it prints a small table (each figure the best of --repeat runs;
torch runs one thread per stage). The machine is shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from conftest import (
    FIXTURES,
    RunningDaemon,
    daemon_config,
    launch,
    short_tmpdir,
    stop_and_check,
    wait_ready,  # noqa: E402
)


def _run(d: RunningDaemon, pipeline: str, jobs: int, concurrent: int, rounds: int) -> float:
    """Run `jobs` jobs, `concurrent` at a time (each thread submits and waits for its own); jobs/s."""
    counter = iter(range(jobs))
    lock = threading.Lock()
    failed: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            doc = d.wait(d.submit(pipeline, {"seed": i}, {pipeline: {"rounds": rounds}}), timeout=300)
            if doc["state"] != "succeeded":
                failed.append(str(doc["error"]))

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed: {failed[0]}")
    return jobs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3, help="each figure is the best of this many runs")
    args = ap.parse_args()
    # one torch thread per stage: the figure is batching's, not the thread pool's (and less noisy)
    py = {"engine": "python", "python_path": [str(FIXTURES)], "queue_capacity": 16,
          "env": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}}
    stages = {"plain": {**py, "function": "batchstages:matmul_one", "max_inflight": 1},
              "batch": {**py, "batch_function": "batchstages:matmul", "max_inflight": 8}}
    tmp = short_tmpdir()
    cfg = daemon_config(tmp, stages, {name: {"stages": [name]} for name in stages})
    d = RunningDaemon(launch(cfg, tmp / "omnid.log"), tmp, cfg, tmp / "omnid.sock", tmp / "state", tmp / "lock",
                      tmp / "omnid.log")
    try:
        wait_ready(d, timeout=120)
        for name in stages:                     # warm: torch imported, weight made
            _run(d, name, 2, 1, args.rounds)
        rows = [(f"{stage} ({how}), {c} concurrent",
                 max(_run(d, stage, args.jobs, c, args.rounds) for _ in range(args.repeat)))
                for stage, how, c in (("plain", "function, max_inflight 1", 1),
                                      ("plain", "function, max_inflight 1", 8),
                                      ("batch", "batch_function, max_inflight 8", 1),
                                      ("batch", "batch_function, max_inflight 8", 8))]
    finally:
        problems = stop_and_check(d)
        shutil.rmtree(tmp, ignore_errors=True)
        if problems:
            print("\n".join(problems), file=sys.stderr)
    base = rows[0][1]
    print(f"{'stage, concurrency':<58} {'jobs/s':>8} {'x':>6}")
    for label, rate in rows:
        print(f"{label:<58} {rate:8.2f} {rate / base:6.2f}")


if __name__ == "__main__":
    main()
