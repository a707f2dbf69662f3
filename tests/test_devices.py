"""Device binding inside one daemon: stages that share a GPU load one at a time.

On this CPU-only machine device indices are lock-file and CUDA_VISIBLE_DEVICES
indices only; the ordering and the visible `waiting_for_device` state are
what the test proves.
"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import RunningDaemon

SLOW_IMPORT = '''
import os, time
time.sleep(float(os.environ.get("SLOW_IMPORT_S", "1.0")))

def visible(inputs, params, ctx):
    return {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")}
'''


def test_stages_sharing_a_device_load_one_at_a_time(start_daemon, tmp_path: Path) -> None:
    (tmp_path / "slowstage.py").write_text(SLOW_IMPORT)
    stage = {"engine": "python", "function": "slowstage:visible", "python_path": [str(tmp_path)],
             "env": {"SLOW_IMPORT_S": "1.0"}}
    d: RunningDaemon = start_daemon(
        {"a": {**stage, "devices": [0, 1]}, "b": {**stage, "devices": [1, 2]}, "c": {**stage, "devices": [3]},
         "cpu": {**stage, "devices": []}},
        {"pa": {"stages": ["a"]}, "pb": {"stages": ["b"]}, "pc": {"stages": ["c"]}, "pcpu": {"stages": ["cpu"]}},
        wait=False)
    seen_waiting = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            snaps = d.stages()
        except Exception:
            time.sleep(0.05)
            continue
        seen_waiting |= {n for n, s in snaps.items() if s["state"] == "waiting_for_device"}
        if all(s["state"] == "ready" for s in snaps.values()):
            break
        time.sleep(0.05)
    snaps = d.stages()
    assert all(s["state"] == "ready" for s in snaps.values()), snaps
    a, b = snaps["a"], snaps["b"]
    first, second = (a, b) if a["ready_at"] <= b["ready_at"] else (b, a)
    # a and b share GPU 1: the second was spawned only after the first was warm
    assert second["spawned_at"] >= first["ready_at"]
    assert second["name"] in seen_waiting
    # c and the CPU stage share nothing with them: they loaded in parallel with the first
    assert snaps["c"]["spawned_at"] < first["ready_at"]
    assert snaps["cpu"]["spawned_at"] < first["ready_at"]
    # each worker sees exactly its own devices
    for pipeline, want in (("pa", "0,1"), ("pb", "1,2"), ("pc", "3"), ("pcpu", "")):
        job = d.wait(d.submit(pipeline))
        data, _ = d.client.output(job["id"], "cvd")
        assert data.decode() == want
    # the daemon holds one lock file per device for as long as it lives
    assert sorted(p.name for p in d.lock_dir.iterdir()) == [f"gpu{i}.lock" for i in range(4)]
