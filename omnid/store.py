"""The job store: a sqlite database of jobs and their events, plus output folders.

Runs in the supervisor's event-loop thread; every call is a short local
sqlite transaction (WAL, synchronous=NORMAL), so it blocks for well under a
millisecond. With `write_behind(loop)` (the daemon), writes are gathered and
committed together once per turn of the event loop (one transaction for all the
events of a batch of token streams, not one per token); every read, and
`flush()`, commits what is pending first. Layout under the state dir:

  omnid.db              jobs(id, owner_uid, pipeline, state, created_at, doc)
                        events(job, seq, doc)
  jobs/<id>/            the job's output files and manifest.json

A job's full record is the JSON document `doc` (`JobRecord.to_doc()`, the API's
JSON); the columns beside it exist for filtering. Jobs that were queued or running when the daemon stopped are
marked failed on the next start (`recover`), never silently forgotten.
"""

from __future__ import annotations

import asyncio
import builtins
import fcntl
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from omnid.vocabulary import ErrorCode, JobRecord, JobState


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id         TEXT PRIMARY KEY,
    owner_uid  INTEGER NOT NULL,
    pipeline   TEXT NOT NULL,
    state      TEXT NOT NULL,
    created_at REAL NOT NULL,
    doc        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_owner_created ON jobs(owner_uid, created_at);
CREATE TABLE IF NOT EXISTS events (
    job  TEXT NOT NULL,
    seq  INTEGER NOT NULL,
    doc  TEXT NOT NULL,
    PRIMARY KEY (job, seq)
);
PRAGMA user_version = 1;
"""


class StateDirBusy(Exception):
    """Another daemon uses this state dir."""


class JobStore:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.jobs_dir = self.state_dir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        # One daemon per state dir: a second one would mark the first one's live jobs failed.
        self._lock_fd = os.open(self.state_dir / "omnid.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            raise StateDirBusy(f"the state dir {self.state_dir} is in use by another omnid (pid {holder})") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        self.db = sqlite3.connect(self.state_dir / "omnid.db", isolation_level=None,
                                  check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty: dict[str, JobRecord] = {}                        # jobs to write (latest state)
        self._events: builtins.list[tuple[str, int, dict[str, Any]]] = []   # events to write
        self._flush_due = False

    def write_behind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Gather writes and commit them once per turn of `loop` (else each write commits at once)."""
        self._loop = loop

    def _written(self) -> None:
        if self._loop is None:
            self.flush()
        elif not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Commit the pending writes in one transaction."""
        self._flush_due = False
        if not self._dirty and not self._events:
            return
        jobs = [(j.id, j.owner_uid, j.pipeline, str(j.state), j.created_at, json.dumps(j.to_doc()))
                for j in self._dirty.values()]
        events = [(job, seq, json.dumps(ev)) for job, seq, ev in self._events]
        self._dirty = {}
        self._events = []
        self.db.execute("BEGIN")
        try:
            self.db.executemany(
                "INSERT INTO jobs(id, owner_uid, pipeline, state, created_at, doc) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc", jobs)
            self.db.executemany("INSERT OR REPLACE INTO events(job, seq, doc) VALUES (?,?,?)", events)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def close(self) -> None:
        self.flush()
        self.db.close()
        os.close(self._lock_fd)            # releases the state dir's lock

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def save(self, job: JobRecord) -> None:
        """Write the job's record (as it is when the writes are committed: the latest state)."""
        self._dirty[job.id] = job
        self._written()

    def get(self, job_id: str) -> JobRecord | None:
        self.flush()
        row = self.db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobRecord.from_doc(json.loads(row[0])) if row else None

    def resolve(self, ref: str) -> str | None | builtins.list[str]:
        """A job id from an id or a unique prefix of at least 4 characters.

        Returns the id, None when nothing matches, or the matches when ambiguous.
        """
        self.flush()
        if self.db.execute("SELECT 1 FROM jobs WHERE id = ?", (ref,)).fetchone():
            return ref
        if len(ref) < 4 or not ref.isalnum():
            return None
        rows = [r[0] for r in self.db.execute(
            "SELECT id FROM jobs WHERE id >= ? AND id < ? LIMIT 5", (ref, ref + "\x7f"))]
        if not rows:
            return None
        return rows[0] if len(rows) == 1 else rows

    def list(self, owner_uid: int | None = None, state: JobState | None = None,
             pipeline: str | None = None, limit: int = 50) -> list[JobRecord]:
        self.flush()
        sql = "SELECT doc FROM jobs WHERE 1=1"
        args: builtins.list[Any] = []
        if owner_uid is not None:
            sql += " AND owner_uid = ?"
            args.append(owner_uid)
        if state is not None:
            sql += " AND state = ?"
            args.append(str(state))
        if pipeline is not None:
            sql += " AND pipeline = ?"
            args.append(pipeline)
        sql += " ORDER BY created_at DESC LIMIT ?"
        args.append(limit)
        return [JobRecord.from_doc(json.loads(r[0])) for r in self.db.execute(sql, args)]

    def append_event(self, job_id: str, seq: int, event: dict[str, Any]) -> None:
        self._events.append((job_id, seq, event))
        self._written()

    def events(self, job_id: str, after: int = 0) -> builtins.list[dict[str, Any]]:
        """The job's events in order; `after`: only those after the first `after` of them."""
        self.flush()
        return [json.loads(r[0]) for r in self.db.execute(
            "SELECT doc FROM events WHERE job = ? AND seq > ? ORDER BY seq", (job_id, after))]

    def delete(self, job_id: str) -> None:
        self.flush()
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM events WHERE job = ?", (job_id,))
        self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        self.db.execute("COMMIT")
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def recover(self) -> builtins.list[str]:
        """Mark jobs left queued or running by a previous daemon as failed."""
        now = time.time()
        ids: builtins.list[str] = []
        live = tuple(str(s) for s in (JobState.QUEUED, JobState.RUNNING))
        for (doc,) in self.db.execute("SELECT doc FROM jobs WHERE state IN (?, ?)", live).fetchall():
            job = JobRecord.from_doc(json.loads(doc))
            job.set_state(JobState.FAILED, now, {
                "code": str(ErrorCode.DAEMON_RESTARTED),
                "message": "the daemon stopped before this job finished; submit it again"})
            self.save(job)
            ids.append(job.id)
        self.flush()
        return ids
