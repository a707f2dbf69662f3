"""`make gpu-check` (tests/gpu/check.py) where there is no GPU: the real make target skips in one
line and exits 0; its dry run drives the same checks on the CPU (real daemons, lock files, a
second daemon refused, kill -9, tensor hand-offs through the staged path) and all of them pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.skipif(_has_gpu(), reason="this host has a GPU: `make gpu-check` runs the real checks here")
def test_make_gpu_check_skips_in_one_line_without_a_gpu() -> None:
    out = subprocess.run(["make", "--no-print-directory", "gpu-check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no NVIDIA GPU"), out.stdout
    assert out.stderr == ""


@pytest.mark.timeout(240)
def test_the_dry_run_drives_every_check_it_can_on_the_cpu(tmp_path: Path) -> None:
    report = tmp_path / "rows.json"
    (tmp_path / "carry").mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "check.py"), "--dry-run",
                          "--carry", str(tmp_path / "carry"), "--json", str(report)],
                         cwd=ROOT, capture_output=True, text=True, timeout=230,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["check"]: r for r in json.loads(report.read_text())["rows"]}
    for check in ("devices = [0] / []", "exclusive stage sharing GPU 0", "second daemon on a held GPU",
                  "GPU lock files", "tensor hand-off 16 MiB (CPU, staged)", "tensor hand-off 64 MiB (CPU, staged)",
                  "kill -9 of sender and receiver"):
        assert rows[check]["result"] == "pass", rows[check]
    assert "free after stop" in rows["GPU lock files"]["figure"]
    assert "kill -9" in rows["GPU lock files"]["figure"]
    assert "nothing left allocated" in rows["tensor hand-off 64 MiB (CPU, staged)"]["figure"]
    for check in ("GPU memory per stage", "tiny SD, CUDA fp16, batched", "vLLM stage on GPU 0"):
        assert rows[check]["result"] == "skipped", rows[check]
    assert "| result  | figure" in out.stdout        # the table itself
