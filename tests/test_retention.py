"""Retention in a running daemon: 1,000 no-op jobs with keep_jobs = 100 leave 100 jobs and 100 folders,
the job that is still running is never touched, and the state dir stops growing.

`OMNID_SOAK_JOBS=10000 OMNID_SOAK_KEEP=1000 pytest -s tests/test_retention.py` is the long soak; `-s`
prints the figures (database size, job folders, rows) before and after retention.
"""

from __future__ import annotations

import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from conftest import RunningDaemon, py_stage, sleeper, wait_for

from omnictl.client import Client

JOBS = int(os.environ.get("OMNID_SOAK_JOBS", "1000"))
KEEP = int(os.environ.get("OMNID_SOAK_KEEP", "100"))
THREADS = 16


def disk(d: RunningDaemon) -> dict[str, Any]:
    db = sqlite3.connect(f"file:{d.state_dir / 'omnid.db'}?mode=ro", uri=True)
    try:
        jobs, events = (db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("jobs", "events"))
    finally:
        db.close()
    files = [d.state_dir / n for n in ("omnid.db", "omnid.db-wal")]
    return {"jobs": jobs, "events": events, "folders": sum(1 for _ in (d.state_dir / "jobs").iterdir()),
            "db_kib": sum(p.stat().st_size for p in files if p.exists()) // 1024,
            "state_kib": du(d.state_dir) // 1024}


def du(root: Path) -> int:
    """Bytes in the files under `root` (retention may remove some meanwhile)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def test_finished_jobs_past_keep_jobs_are_removed_and_live_ones_kept(start_daemon) -> None:
    d: RunningDaemon = start_daemon(
        {"noop": py_stage("echo", max_inflight=8, queue_capacity=512), "slow": sleeper(600)},
        {"p": {"stages": ["noop"]}, "slow": {"stages": ["slow"]}},
        {"keep_jobs": KEEP, "retention_interval_s": 0.5, "max_queued_jobs": JOBS + 10, "log_level": "info"})
    slow = d.submit("slow")                      # the oldest job of all, running throughout
    t0 = time.monotonic()

    def submit_some(n: int) -> list[str]:
        c = Client(str(d.socket))
        return [c.submit("p", {"text": "x"})["id"] for _ in range(n)]

    with ThreadPoolExecutor(THREADS) as pool:
        ids = [j for part in pool.map(submit_some, [JOBS // THREADS + (i < JOBS % THREADS) for i in range(THREADS)])
               for j in part]
    submitted_s = time.monotonic() - t0
    assert len(ids) == JOBS
    wait_for(lambda: d.client.health()["live_jobs"] == 1, 120, "every no-op job to finish")
    done_s = time.monotonic() - t0
    peak = disk(d)
    wait_for(lambda: disk(d)["jobs"] == KEEP + 1, 60, f"retention to bring the jobs down to {KEEP} (+1 live)",
             every=0.2)
    wait_for(lambda: disk(d)["folders"] <= KEEP + 1, 10, "the job folders to go with them")
    after = disk(d)
    print(f"\n{JOBS} jobs, keep_jobs={KEEP}: submitted in {submitted_s:.1f} s, all done at {done_s:.1f} s; "
          f"peak {peak}; after retention {after} ({time.monotonic() - t0:.1f} s)")
    assert after["folders"] <= KEEP + 1 and after["jobs"] == KEEP + 1
    assert after["events"] < peak["events"] or peak["jobs"] <= KEEP + 1    # (retention may have run already)
    assert d.client.job(slow)["state"] == "running", "retention must never touch a live job"
    kept = {j["id"] for j in d.client.jobs(limit=1000)["jobs"]}
    assert len(kept) == min(1000, KEEP + 1) and (slow in kept or KEEP + 1 > 1000)    # (the API lists 1000 at most)
    d.client.cancel(slow)


def test_rows_per_64_token_job(start_daemon) -> None:
    """A 64-segment job (one segment per decode step, as vLLM's) and how many event rows it stores."""
    d: RunningDaemon = start_daemon({"gen": py_stage("count")}, {"t": {"stages": ["gen"]}},
                                    {"keep_jobs": 1, "retention_interval_s": 0.5})
    first = d.submit("t", params={"gen": {"n": 64, "delay": 0}})
    events = d.events(first, timeout=60)
    db = sqlite3.connect(f"file:{d.state_dir / 'omnid.db'}?mode=ro", uri=True)
    rows = db.execute("SELECT COUNT(*) FROM events WHERE job = ?", (first,)).fetchone()[0]
    db.close()
    segments = sum(1 for e in events if e["type"] == "segment")
    print(f"\n64-token job: {rows} event rows ({segments} segment events, {len(events)} events)")
    assert rows == len(events) and 1 <= segments <= 65      # (a generator's end is one segment more)
    second = d.submit("t", params={"gen": {"n": 64, "delay": 0}})
    d.wait(second, timeout=60)

    def first_gone() -> bool:
        db = sqlite3.connect(f"file:{d.state_dir / 'omnid.db'}?mode=ro", uri=True)
        try:
            return db.execute("SELECT COUNT(*) FROM events WHERE job = ?", (first,)).fetchone()[0] == 0
        finally:
            db.close()
    wait_for(first_gone, 10, "retention to delete the first job's event rows", every=0.2)
    assert not Path(d.state_dir / "jobs" / first).exists()
