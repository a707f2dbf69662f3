"""`make bench-check`'s verdict on one row (tests/benchmarks/check.py `judge`), in-process: flagged only
when the two runs' mean is more than 10 % worse than the baseline and further off than the runs
are from each other; which way is worse comes from the row."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from check import host_baseline, host_id, judge  # noqa: E402


def test_a_row_worse_than_its_baseline_beyond_noise_is_flagged_either_way() -> None:
    assert judge("r", {"ratio": 5.0, "better": "lower"}, [6.0, 6.1], "lower").status == "FLAGGED"
    assert judge("r", {"ratio": 5.0, "better": "higher"}, [4.0, 4.1], "higher").status == "FLAGGED"


def test_noise_or_an_improvement_or_a_small_change_is_not() -> None:
    assert judge("r", {"ratio": 5.0, "better": "lower"}, [5.2, 6.3], "lower").status == "ok"     # runs disagree
    assert judge("r", {"ratio": 5.0, "better": "lower"}, [4.0, 4.1], "lower").status == "ok"     # better
    assert judge("r", {"ratio": 5.0, "better": "lower"}, [5.4, 5.45], "lower").status == "ok"   # 9 % worse
    # 12 % worse than a baseline whose own runs were 1.02 and 0.82: within the baseline's noise
    assert judge("r", {"ratio": 0.92, "runs": [1.02, 0.82], "better": "lower"}, [1.02, 1.03], "lower").status == "ok"
    assert judge("r", {"ratio": 0.92, "runs": [0.93, 0.91], "better": "lower"}, [1.02, 1.03], "lower").status \
        == "FLAGGED"


def test_a_row_without_a_baseline_or_without_both_runs_is_said_so() -> None:
    assert judge("r", None, [4.0, 4.1], "lower").status == "new"
    assert judge("r", {"ratio": 5.0, "better": "lower"}, [6.0], "lower").status == "missing"
    assert judge("r", {"ratio": 5.0}, [6.0, 6.1], None).status == "unchecked"


def test_each_host_is_compared_with_its_own_baseline() -> None:
    rows_a, rows_b = {"r": {"ratio": 5.9}}, {"r": {"ratio": 8.5}}
    doc = {"hosts": {"A, 2 cores": {"rows": rows_a}, "B, 2 cores": {"rows": rows_b}}}
    assert host_baseline(doc, "B, 2 cores") == ("B, 2 cores", rows_b)
    assert host_baseline(doc, "C, 2 cores") == ("A, 2 cores", rows_a)      # (another's: said so, nothing flagged)
    assert host_baseline({"rows": rows_a}, "B, 2 cores") == ("unrecorded", rows_a)   # (written before hosts)
    assert host_baseline({}, "B, 2 cores") == (None, {})
    assert "cores" in host_id()


def test_make_bench_list_names_every_bench_with_a_line_of_what_it_measures() -> None:
    """`make bench BENCH_ARGS=--list` (a newcomer's first look): it crashed on a bench without a
    docstring of its own; each now says its own, or its module's, first line."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "tests" / "benchmarks" / "run.py"), "--list"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert len(out) > 20, out
    assert all(len(line.split(None, 2)) == 3 for line in out), [x for x in out if len(x.split(None, 2)) < 3]
    assert any(line.startswith("omni_load ") and "Speech under load" in line for line in out), out
