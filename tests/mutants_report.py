"""`make mutants`' report: the score of each module and every mutant that survived, from mutmut's
results (mutants/**/*.meta), counting only the mutants named by the globs on the command line (the
Makefile's MUTANTS). Runs after `mutmut run`, in the repository root; standard library only.

A mutant is killed when a test failed (or timed out: the change made a test hang); it survives when
every test that calls its function passed; "no tests" when no selected test calls its function (a
survivor too: nothing would notice the change). Equivalent mutants are not made at all: their line
says `# pragma: no mutate`, with the reason.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1: "killed", 3: "killed", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}
SURVIVED = {0: "survived", 5: "no tests", 33: "no tests"}


def status(code: int | None) -> str:
    if code in KILLED:
        return KILLED[code]
    if code in SURVIVED:
        return SURVIVED[code]
    return "not run" if code is None else f"exit {code}"


def main(globs: list[str]) -> int:
    root = Path("mutants")
    by_module: dict[str, Counter[str]] = {}
    alive: list[tuple[str, str]] = []
    for meta in sorted(root.rglob("*.py.meta")):
        module = str(meta.relative_to(root))[:-len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items(), key=lambda kv: (kv[0].rsplit("__mutmut_", 1)[0],
                                                                 int(kv[0].rsplit("_", 1)[1]))):
            if globs and not any(fnmatch.fnmatch(name, g) for g in globs):
                continue
            s = status(code)
            by_module.setdefault(module, Counter())[s] += 1
            if s in ("survived", "no tests", "not run") or s.startswith("exit"):
                alive.append((name, s))
    if not by_module:
        print("no mutmut results under mutants/: run `make mutants`", file=sys.stderr)
        return 1
    print(f"{'module':52} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} {'other':>5} "
          f"{'score':>6}")
    total: Counter[str] = Counter()
    for module, c in sorted(by_module.items()):
        total.update(c)
        print(_row(module, c))
    print(_row("all", total))
    if alive:
        print(f"\n{len(alive)} mutants alive (`.venv/bin/mutmut show NAME` shows the change):")
        for name, s in alive:
            print(f"  {s:9} {name}")
    return 0


def _row(module: str, c: Counter[str]) -> str:
    n = sum(c.values())
    dead = c["killed"] + c["timeout"]
    score = f"{100 * dead / n:.1f}%" if n else "-"
    other = n - dead - c["survived"] - c["no tests"]
    return f"{module:52} {n:7} {c['killed']:6} {c['timeout']:7} {c['survived']:8} {c['no tests']:8} {other:5} {score:>6}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
