"""omnid.retention against a real JobStore in a temporary state dir (no daemon)."""

from __future__ import annotations

from pathlib import Path

from omnid import retention
from omnid.config import DaemonConfig
from omnid.retention import Retention
from omnid.store import JobStore
from omnid.vocabulary import JobRecord, JobState

DAY = 86400.0


def add(store: JobStore, n: int, state: JobState, t0: float, step: float = 1.0, prefix: str = "j") -> list[str]:
    ids = []
    for i in range(n):
        job = JobRecord(id=f"{prefix}{i:05d}", pipeline="p", owner_uid=1, created_at=t0 + i * step,
                        timeout_s=10, inputs={}, params={}, stages={}, state=state)
        store.save(job)
        store.append_event(job.id, 1, {"type": "state", "state": str(state)})
        store.append_event(job.id, 2, {"type": "segment", "text": "x"})
        store.keep_inputs(job.id, {"prompt": "x"})
        store.job_dir(job.id).mkdir()
        (store.job_dir(job.id) / "out.txt").write_text("x")
        ids.append(job.id)
    return ids


def config(**kw: float) -> DaemonConfig:
    return DaemonConfig(socket=Path("/s"), state_dir=Path("/d"), lock_dir=Path("/l"), **kw)  # type: ignore[arg-type]


def test_count_bound_removes_the_oldest_finished_with_events_inputs_and_folders(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    try:
        done = add(store, 50, JobState.SUCCEEDED, 1000.0)
        live = add(store, 3, JobState.RUNNING, 0.0, prefix="live") + add(store, 2, JobState.QUEUED, 1.0, prefix="q")
        r = Retention(config(keep_jobs=10, keep_jobs_days=0), store)
        assert r.run_once(now=2000.0) == (40, False)
        left = {j.id for j in store.list(limit=1000)}
        assert left == set(done[-10:]) | set(live)
        assert store.counts()["events"] == 2 * len(left)
        assert sorted(p.name for p in store.jobs_dir.iterdir()) == sorted(left)
        assert store.db.execute("SELECT COUNT(*) FROM job_inputs").fetchone()[0] == len(left)
        assert r.run_once(now=2000.0) == (0, False)
    finally:
        store.close()


def test_age_bound_and_busy_jobs(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    try:
        now = 100 * DAY
        old = add(store, 5, JobState.FAILED, now - 40 * DAY, prefix="old")
        new = add(store, 5, JobState.CANCELLED, now - 1 * DAY, prefix="new")
        r = Retention(config(keep_jobs=0, keep_jobs_days=30), store, busy=lambda: {old[0]})
        assert r.run_once(now=now) == (4, False)
        assert {j.id for j in store.list(limit=100)} == {old[0], *new}
    finally:
        store.close()


def test_maybe_run_works_off_a_backlog_in_batches_then_waits_the_interval(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    clock = [0.0]
    try:
        add(store, retention.BATCH + 50, JobState.SUCCEEDED, 1000.0)
        r = Retention(config(keep_jobs=10, keep_jobs_days=0, retention_interval_s=60), store,
                      clock=lambda: clock[0])
        assert r.maybe_run() == retention.BATCH          # at start, one batch
        assert r.maybe_run() == 40                       # the rest at the next tick
        assert r.maybe_run() == 0                        # then not before the interval
        add(store, 5, JobState.SUCCEEDED, 5000.0, prefix="n")
        assert r.maybe_run() == 0
        clock[0] = 61.0
        assert r.maybe_run() == 5
        assert store.counts()["jobs"] == 10
    finally:
        store.close()


def test_disabled_does_nothing(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    try:
        add(store, 5, JobState.SUCCEEDED, 0.0)
        r = Retention(config(keep_jobs=0, keep_jobs_days=0), store)
        assert not r.enabled and r.maybe_run() == 0 and store.counts()["jobs"] == 5
    finally:
        store.close()
