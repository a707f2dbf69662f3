"""The fork server's start (omnid.worker.preload) freezes what it imported out of the cyclic garbage
collector before it forks a worker: a worker's collections then never walk (and copy) those shared
pages. Run as the server runs it: a fresh interpreter that imports the module, its engine named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_fork_server_freezes_what_it_imported() -> None:
    code = "import gc, omnid.worker.preload; print(gc.get_freeze_count(), len(gc.get_objects()))"
    env = {**os.environ, "OMNID_PRELOAD": "python", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    frozen, tracked = map(int, out.stdout.split())
    assert frozen > 10_000, out.stdout          # the modules it imported (for a python stage: omnid's own)
    assert tracked < frozen / 10, out.stdout    # and what they made; after it, a few
