"""The benchmarks' regression guard: `make bench-check` (`.venv/bin/python tests/benchmarks/check.py`).

Runs the benches marked `fast` in run.py's BENCHES (quick mode) twice, each time on fresh shared
daemons, and compares each row's ratio with the baseline kept beside this file (baseline.json). A row
is flagged when the mean of its two ratios is more than 10 % worse than the baseline's (worse: the
way its `better` says) AND that shortfall is larger than the spread of the two runs (|run 1 - run 2|),
and than the spread of the two runs the baseline was written from: the runs agree with each other,
not with the baseline, and the baseline's own runs agreed, so noise alone does not explain it. Exits 1
naming the flagged rows (and 2 when a row is missing or failed), 0 otherwise; prints one table.

`--update` writes the baseline from this run (the mean of the two ratios per row). A change that
moves a row on purpose updates the baseline in the same commit, and says why in the message.

Not part of `make test`: the machine is shared and noisy. Runs in one process; the benches in the
runner's thread (run.py's run_bench), the daemons as run.py starts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BENCH_DIR, Row, fmt  # noqa: E402
from run import BENCHES, run_suite  # noqa: E402

BASELINE = BENCH_DIR / "baseline.json"
WORSE_BY = 0.10         # flagged past 10 % worse than the baseline (and past the two runs' spread)
RUNS = 2


@dataclass
class Verdict:
    figure: str
    base: float | None
    runs: list[float]
    better: str | None
    status: str          # "ok", "FLAGGED", "missing", "new", "unchecked"
    worse: float = 0.0   # how much worse than the baseline, as a fraction (negative: better)


def judge(figure: str, base: dict[str, object] | None, runs: list[float], better: str | None) -> Verdict:
    """One row's verdict from its baseline entry and its ratios in the runs (see the module doc)."""
    if base is None:
        return Verdict(figure, None, runs, better, "new")
    ratio = base.get("ratio")
    direction = base.get("better") or better
    if not isinstance(ratio, (int, float)) or direction not in ("lower", "higher") or ratio == 0:
        return Verdict(figure, None, runs, better, "unchecked")
    if len(runs) < RUNS:
        return Verdict(figure, float(ratio), runs, str(direction), "missing")
    mean = sum(runs) / len(runs)
    kept = [float(r) for r in base.get("runs") or () if isinstance(r, (int, float))]   # (the baseline's own runs)
    spread = max(max(runs) - min(runs), max(kept) - min(kept) if len(kept) >= 2 else 0.0)
    shortfall = (mean - ratio) if direction == "lower" else (ratio - mean)     # > 0: worse
    worse = shortfall / abs(ratio)
    flagged = worse > WORSE_BY and shortfall > spread
    return Verdict(figure, float(ratio), runs, str(direction), "FLAGGED" if flagged else "ok", worse)


def report(verdicts: list[Verdict]) -> str:
    head = ["row", "baseline", "run 1", "run 2", "vs baseline", "verdict"]
    body = [[v.figure, fmt(v.base), *[fmt(x) for x in (v.runs + [None] * RUNS)[:RUNS]],
             f"{100 * v.worse:+.0f}% {'worse' if v.worse > 0 else 'better'}" if v.base is not None and v.runs else "-",
             v.status] for v in verdicts]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + body]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true", help="write the baseline from this run")
    ap.add_argument("--baseline", default=str(BASELINE), help="the baseline JSON (default: %(default)s)")
    ap.add_argument("--json", default="", help="also write both runs' rows and the verdicts here")
    args = ap.parse_args(argv)
    fast = [b for b in BENCHES if b.fast]
    runs: list[list[Row]] = []
    problems: list[str] = []
    for i in range(RUNS):
        print(f"bench-check: run {i + 1} of {RUNS} ({', '.join(b.name for b in fast)}); "
              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        rows, probs, _, _ = run_suite(fast, quick=True)
        runs.append(rows)
        problems += probs
    figures: dict[str, str | None] = {}
    ratios: dict[str, list[float]] = {}
    for rows in runs:
        for r in rows:
            figures.setdefault(r.figure, r.direction)
            if r.error is None and r.ratio is not None:
                ratios.setdefault(r.figure, []).append(r.ratio)
    path = Path(args.baseline)
    if args.update:
        doc = {"about": "make bench-check's baseline: the mean ratio of two quick runs of the fast benches "
                        "(tests/benchmarks/check.py); update it in the commit that moves a row on purpose",
               "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_avg": os.getloadavg()[0],
               "rows": {f: {"ratio": round(sum(xs) / len(xs), 4), "runs": [round(x, 4) for x in xs],
                            "better": figures[f]}
                        for f, xs in ratios.items() if len(xs) == RUNS and figures[f] is not None}}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"baseline written to {path} ({len(doc['rows'])} rows)")
        return 0
    baseline = json.loads(path.read_text())["rows"] if path.exists() else {}
    verdicts = [judge(f, baseline.get(f), ratios.get(f, []), figures[f]) for f in figures]
    verdicts += [Verdict(f, None, [], None, "missing") for f in baseline if f not in figures]
    print()
    print(report(verdicts))
    for p in problems:
        print(f"problem: {p}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [[r.to_json() for r in rows] for rows in runs],
                                               "verdicts": [v.__dict__ for v in verdicts]}, indent=2) + "\n")
    flagged = [v.figure for v in verdicts if v.status == "FLAGGED"]
    missing = [v.figure for v in verdicts if v.status == "missing"]
    if flagged:
        print(f"\nbench-check: {len(flagged)} row(s) more than {100 * WORSE_BY:.0f} % worse than the baseline "
              f"and outside the runs' spread (this run's and the baseline's):")
        for f in flagged:
            print(f"  - {f}")
    if missing:
        print(f"\nbench-check: {len(missing)} row(s) of the baseline gave no figure in both runs:")
        for f in missing:
            print(f"  - {f}")
    if flagged:
        return 1
    if missing:
        return 2
    print(f"\nbench-check: {len(verdicts)} rows, none flagged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
