"""The benchmarks' regression guard: `make bench-check` (`.venv/bin/python tests/benchmarks/check.py`).

Runs the benches marked `fast` in run.py's BENCHES (quick mode) twice, each time on fresh shared
daemons, and compares each row's ratio with the baseline kept beside this file (baseline.json). A row
is flagged when the mean of its two ratios is more than 10 % worse than the baseline's (worse: the
way its `better` says) AND that shortfall is larger than the spread of the two runs (|run 1 - run 2|),
and than the spread of the two runs the baseline was written from: the runs agree with each other,
not with the baseline, and the baseline's own runs agreed, so noise alone does not explain it. Exits 1
naming the flagged rows (and 2 when a row is missing or failed), 0 otherwise; prints one table.

A ratio is steady on one host, not across hosts (the segment row reads 5.9x on host A and 8-9x on an
AMD EPYC, on the same tree: system calls cost more there against the plain-Python anchor), so the
baseline keeps one entry per host, named by its CPU model, core count and AMX (`host_id`). A host
with no entry is compared with another's, said so, and nothing is flagged: write its own first,
with `--update` on an untouched tree.

`--update` writes this host's baseline from four runs (the mean of the ratios per row, and the runs,
whose spread is the noise a later check allows for), beside the other hosts'. A change that moves a
row on purpose updates the baseline in the same commit, and says why in the message.

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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BENCH_DIR, Row, fmt  # noqa: E402
from run import BENCHES, run_suite  # noqa: E402

BASELINE = BENCH_DIR / "baseline.json"
WORSE_BY = 0.10         # flagged past 10 % worse than the baseline (and past the two runs' spread)
RUNS = 2
UPDATE_RUNS = 4         # a baseline's runs: their spread is the host's noise the check allows for


@dataclass
class Verdict:
    figure: str
    base: float | None
    runs: list[float]
    better: str | None
    status: str          # "ok", "FLAGGED", "missing", "new", "unchecked"
    worse: float = 0.0   # how much worse than the baseline, as a fraction (negative: better)


def host_id() -> str:
    """This host's name in the baseline: its CPU model with its family and model numbers (a cloud's
    "AMD EPYC" names Zen 4 and Zen 5 alike, and the segment row read 7.7-10.4x on one, 5.1-5.6x on
    the other), its cores (the ones this process may use) and whether it has AMX (oneDNN's matmuls
    differ with it)."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), " ".join(value.split()))
    except OSError:
        pass
    model = found.get("model name", "unknown CPU")
    if "cpu family" in found and "model" in found:
        model += f" (family {found['cpu family']}, model {found['model']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores" + (", AMX" if "amx_tile" in found.get("flags", "").split() else "")


def _hosts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The baseline's entries by host (a baseline written before hosts were kept has its rows at the
    top: "unrecorded")."""
    hosts = dict(doc.get("hosts") or {})
    if isinstance(doc.get("rows"), dict):
        hosts.setdefault("unrecorded", {k: doc[k] for k in ("written_at", "load_avg", "rows") if k in doc})
    return hosts


def host_baseline(doc: dict[str, Any], host: str) -> tuple[str | None, dict[str, dict[str, object]]]:
    """The rows to compare with and whose they are: this host's entry, else the first host's."""
    hosts = _hosts(doc)
    if not hosts:
        return None, {}
    name = host if host in hosts else next(iter(hosts))
    return name, dict(hosts[name].get("rows") or {})


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
    n_runs = UPDATE_RUNS if args.update else RUNS
    for i in range(n_runs):
        print(f"bench-check: run {i + 1} of {n_runs} ({', '.join(b.name for b in fast)}); "
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
    host = host_id()
    doc = json.loads(path.read_text()) if path.exists() else {}
    if args.update:
        hosts = _hosts(doc)
        rows = {f: {"ratio": round(sum(xs) / len(xs), 4), "runs": [round(x, 4) for x in xs], "better": figures[f]}
                for f, xs in ratios.items() if len(xs) == n_runs and figures[f] is not None}
        hosts[host] = {"written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_avg": os.getloadavg()[0],
                       "rows": rows}
        out = {"about": "make bench-check's baseline, one entry per host (check.py host_id): the mean ratio of "
                        f"{UPDATE_RUNS} quick runs of the fast benches (tests/benchmarks/check.py); update it in "
                        "the commit that moves a row on purpose", "hosts": hosts}
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"baseline for {host} written to {path} ({len(rows)} rows)")
        return 0
    whose, baseline = host_baseline(doc, host)
    verdicts = [judge(f, baseline.get(f), ratios.get(f, []), figures[f]) for f in figures]
    for v in verdicts:
        if whose != host and v.status == "FLAGGED":
            v.status = "worse (another host's baseline)"
    verdicts += [Verdict(f, None, [], None, "missing") for f in baseline if f not in figures]
    print()
    print(f"this host: {host}; baseline: {whose if whose != host else 'its own'}")
    print(report(verdicts))
    for p in problems:
        print(f"problem: {p}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [[r.to_json() for r in rows] for rows in runs],
                                               "verdicts": [v.__dict__ for v in verdicts]}, indent=2) + "\n")
    if whose != host:
        print(f"\nbench-check: no baseline for this host ({host}); compared with {whose or 'none'}'s, for "
              f"information: ratios differ between hosts, so nothing is flagged. Write this host's from an "
              f"untouched tree: make bench-check BENCH_CHECK_ARGS=--update")
        return 0
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
