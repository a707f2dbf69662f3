"""The job store: a sqlite database of jobs and their events, plus output folders.

Runs in the supervisor's event-loop thread; every call is a short local
sqlite transaction (WAL, synchronous=NORMAL), so it blocks for well under a
millisecond. With `write_behind(loop)` (the daemon), writes are gathered and
committed together once per turn of the event loop (one transaction for all the
events of a batch of token streams, not one per token), after the stream readers those events
woke have written their answers; every read, and
`flush()`, commits what is pending first. Layout under the state dir:

  omnid.db              jobs(id, owner_uid, pipeline, state, created_at, doc)
                        events(job, seq, doc)
                        job_inputs(job, inputs, attempts)   (live jobs only)
  jobs/<id>/            the job's output files and manifest.json

A job's full record is the JSON document `doc` (`JobRecord.to_doc()`, the API's
JSON); the columns beside it exist for filtering. A live job's whole inputs are kept in
`job_inputs` until it ends, so that jobs a stopped (or killed) daemon had accepted run on
its next start (`unfinished`): nothing accepted is silently forgotten.

When the disk is full, a write is never an exception in a callback: `flush()` keeps the
writes pending, says why in `write_error`, and is tried again (at most every WRITE_RETRY_S, and
by the daemon's tick); `commit()` raises StoreWriteFailed for the one caller that must know (a
submit is not answered 201 unless its job is on disk). A write that finds the disk full calls
`on_full` (the daemon gives back its ballast file) and is tried once more. Opening an existing
database writes nothing, and deletes remove the output folders before the rows, so status,
results, rm and retention work on a full disk.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import errno
import fcntl
import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from omnid.paths import PRIVATE_DIR, PRIVATE_FILE
from omnid.vocabulary import Event, JobRecord, JobState

log = structlog.get_logger("omnid.store")
_T = TypeVar("_T")


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
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
CREATE TABLE IF NOT EXISTS events (
    job  TEXT NOT NULL,
    seq  INTEGER NOT NULL,
    doc  TEXT NOT NULL,
    PRIMARY KEY (job, seq)
);
CREATE TABLE IF NOT EXISTS job_inputs (
    job       TEXT PRIMARY KEY,
    inputs    TEXT NOT NULL,
    attempts  INTEGER NOT NULL DEFAULT 0
);
PRAGMA user_version = 3;
"""
SCHEMA_VERSION = 3
WRITE_RETRY_S = 1.0     # while writes fail (a full disk), how often a write tries again (the daemon's tick too)


def _encode_inputs(inputs: Mapping[str, Any]) -> str:
    """A job's inputs as JSON; file inputs (bytes, alone or in a list) as {"__b64__": ...}."""
    def enc(v: Any) -> Any:
        if isinstance(v, list):
            return [enc(x) for x in v]
        return {"__b64__": base64.b64encode(v).decode("ascii")} if isinstance(v, (bytes, bytearray)) else v
    return json.dumps({k: enc(v) for k, v in inputs.items()})


def _decode_inputs(text: str) -> dict[str, Any]:
    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        return base64.b64decode(v["__b64__"]) if isinstance(v, dict) and set(v) == {"__b64__"} else v
    return {k: dec(v) for k, v in json.loads(text).items()}


@dataclass
class Unfinished:
    """A job a previous daemon accepted and did not finish, with what it needs to run again."""

    record: JobRecord
    inputs: dict[str, Any] | None       # None: stored by a version that kept no inputs
    attempts: int
    events: int                         # how many events it has (the next one is events + 1)



class StateDirBusy(Exception):
    """Another daemon uses this state dir."""


class StoreWriteFailed(Exception):
    """A write of the store did not reach the disk (the message says why: usually a full disk)."""

    def __init__(self, message: str, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full


def disk_full_error(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, or sqlite's SQLITE_FULL ("database or disk is full") or SQLITE_IOERR
    ("disk I/O error": what sqlite says when the WAL's -shm file cannot grow on a full tmpfs)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    code = getattr(e, "sqlite_errorcode", None)
    return (isinstance(code, int) and (code & 0xFF) in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)) \
        or "disk is full" in str(e)


def _make_private(folder: Path) -> None:
    """Take group and other access away from a folder of ours that an older omnid made 0755.

    Only the folder itself: the job folders and files inside an old state dir keep their modes,
    out of other users' reach behind it. A folder someone else owns is left as it is.
    """
    st = folder.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(folder, PRIVATE_DIR)


class JobStore:
    def __init__(self, state_dir: Path, on_full: Callable[[], bool] | None = None) -> None:
        """`on_full`: called when a write finds the disk full; True when it freed space (the
        daemon's ballast), and then the write is tried once more."""
        self.state_dir = Path(state_dir)
        self.jobs_dir = self.state_dir / "jobs"
        # Private by default (omnid.paths): 0700 folders, 0600 files, whatever the caller's umask.
        self.state_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self.jobs_dir.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        _make_private(self.state_dir)
        _make_private(self.jobs_dir)
        # One daemon per state dir: a second one would mark the first one's live jobs failed.
        self._lock_fd = os.open(self.state_dir / "omnid.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            raise StateDirBusy(f"the state dir {self.state_dir} is in use by another omnid (pid {holder})") from None
        try:
            # (written over the old pid first, then cut: on a full disk the block it has is reused)
            pid = f"{os.getpid()}\n".encode()
            os.pwrite(self._lock_fd, pid, 0)
            os.ftruncate(self._lock_fd, len(pid))
        except OSError:
            pass                        # the pid is only for the message of a second daemon
        self.on_full = on_full
        self.write_error: str | None = None     # why the last write failed, while writes fail
        self._failed_at = 0.0
        self.db = self._with_room(self._open_db)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty: dict[str, JobRecord] = {}                        # jobs to write (latest state)
        self._events: builtins.list[tuple[str, int, Event]] = []   # events to write
        self._inputs: dict[str, tuple[str, int] | None] = {}          # job inputs to keep (None: drop)
        self._flush_due = False

    def _open_db(self) -> sqlite3.Connection:
        # sqlite would create the database with the umask's mode; it gives -wal and -shm the database's.
        os.close(os.open(self.state_dir / "omnid.db", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE))
        db = sqlite3.connect(self.state_dir / "omnid.db", isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            # The schema only when it is not there: a database at this version needs no write to open
            # (so the daemon starts on a full disk).
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def _with_room(self, write: Callable[[], _T]) -> _T:
        """`write()`; when it finds the disk full and `on_full` frees space, once more."""
        try:
            return write()
        except (sqlite3.Error, OSError) as e:
            self._rollback()
            if not disk_full_error(e) or self.on_full is None or not self.on_full():
                raise
        return write()

    def _rollback(self) -> None:
        db = getattr(self, "db", None)
        if db is not None and db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass                    # (sqlite rolled back by itself)

    def write_behind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Gather writes and commit them once per turn of `loop` (else each write commits at once)."""
        self._loop = loop

    def _written(self) -> None:
        if self._loop is None:
            self.flush()
        elif not self._flush_due and (self.write_error is None
                                      or time.monotonic() - self._failed_at >= WRITE_RETRY_S):
            self._flush_due = True
            # Two hops: after the callbacks this turn schedules, so that the readers woken by the
            # same events (a chat's next token) write to their sockets before the commit runs.
            self._loop.call_soon(self._loop.call_soon, self.flush)

    @property
    def pending(self) -> bool:
        return bool(self._dirty or self._events or self._inputs)

    def flush(self) -> bool:
        """Commit the pending writes in one transaction. Never raises: when the write fails (a full
        disk), the writes stay pending, `write_error` says why, and the next flush tries again (the
        daemon's main loop calls it every second). Returns whether everything pending is on disk."""
        self._flush_due = False
        if not self.pending:
            return True
        jobs = [(j.id, j.owner_uid, j.pipeline, str(j.state), j.created_at, json.dumps(j.to_doc()))
                for j in self._dirty.values()]
        events = [(job, seq, json.dumps(ev)) for job, seq, ev in self._events]
        keep = [(job, *row) for job, row in self._inputs.items() if row is not None]
        drop = [(job,) for job, row in self._inputs.items() if row is None]

        def write() -> None:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT INTO jobs(id, owner_uid, pipeline, state, created_at, doc) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc", jobs)
            self.db.executemany("INSERT OR REPLACE INTO events(job, seq, doc) VALUES (?,?,?)", events)
            self.db.executemany("INSERT OR REPLACE INTO job_inputs(job, inputs, attempts) VALUES (?,?,?)", keep)
            self.db.executemany("DELETE FROM job_inputs WHERE job = ?", drop)
            self.db.execute("COMMIT")

        try:
            self._with_room(write)
        except (sqlite3.Error, OSError) as e:
            self._rollback()
            why = f"{type(e).__name__}: {e}"
            if self.write_error is None:
                log.error("the job store cannot write; its writes are kept and tried again", error=why,
                          pending_jobs=len(self._dirty), pending_events=len(self._events))
            self.write_error = why
            self._failed_at = time.monotonic()
            return False
        if self.write_error is not None:
            log.info("the job store writes again", error_was=self.write_error)
        self.write_error = None
        # What was written goes; what came meanwhile (nothing: this runs in the loop's thread) stays.
        self._dirty, self._events, self._inputs = {}, [], {}
        return True

    def commit(self) -> None:
        """Flush, or raise StoreWriteFailed: for an answer that promises the write (a 201)."""
        if not self.flush():
            raise StoreWriteFailed(self.write_error or "the write failed",
                                   disk_full=bool(self.write_error and "full" in self.write_error))

    def discard(self, job_id: str) -> None:
        """Forget the pending (unwritten) writes of a job that is withdrawn (its submit failed)."""
        self._dirty.pop(job_id, None)
        self._inputs.pop(job_id, None)
        self._events = [e for e in self._events if e[0] != job_id]

    def close(self) -> None:
        if not self.flush():
            log.error("the job store's last writes could not be made; the next start takes the jobs as "
                      "they were last written", error=self.write_error)
        self.db.close()
        os.close(self._lock_fd)            # releases the state dir's lock

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def save(self, job: JobRecord) -> None:
        """Write the job's record (as it is when the writes are committed: the latest state)."""
        self._dirty[job.id] = job
        self._written()

    def keep_inputs(self, job_id: str, inputs: Mapping[str, Any], attempts: int = 0) -> None:
        """Keep a live job's whole inputs (and retries used), so it can run again after a restart."""
        self._inputs[job_id] = (_encode_inputs(inputs), attempts)
        self._written()

    def drop_inputs(self, job_id: str) -> None:
        """The job is over: its inputs are not needed any more (its record keeps their summary)."""
        self._inputs[job_id] = None
        self._written()

    def get(self, job_id: str) -> JobRecord | None:
        """(Reads see the pending writes too: while the disk is full, they are the latest word.)"""
        self.flush()
        if job_id in self._dirty:
            return self._dirty[job_id]
        row = self.db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobRecord.from_doc(json.loads(row[0])) if row else None

    def resolve(self, ref: str) -> str | None | builtins.list[str]:
        """A job id from an id or a unique prefix of at least 4 characters.

        Returns the id, None when nothing matches, or the matches when ambiguous.
        """
        self.flush()
        if ref in self._dirty or self.db.execute("SELECT 1 FROM jobs WHERE id = ?", (ref,)).fetchone():
            return ref
        if len(ref) < 4 or not ref.isalnum():
            return None
        rows = [r[0] for r in self.db.execute(
            "SELECT id FROM jobs WHERE id >= ? AND id < ? LIMIT 5", (ref, ref + "\x7f"))]
        rows = sorted(set(rows) | {j for j in self._dirty if j.startswith(ref)})[:5]
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
        found = [JobRecord.from_doc(json.loads(r[0])) for r in self.db.execute(sql, args)]
        if not self._dirty:
            return found
        # writes not on disk yet (a full disk): their records are the latest
        pending = {j.id: j for j in self._dirty.values()
                   if (owner_uid is None or j.owner_uid == owner_uid) and (state is None or j.state is state)
                   and (pipeline is None or j.pipeline == pipeline)}
        merged = [pending.pop(j.id, j) for j in found if j.id not in self._dirty or j.id in pending]
        merged += pending.values()
        merged.sort(key=lambda j: j.created_at, reverse=True)
        return merged[:limit]

    def append_event(self, job_id: str, seq: int, event: Event) -> None:
        self._events.append((job_id, seq, event))
        self._written()

    def events(self, job_id: str, after: int = 0) -> builtins.list[Event]:
        """The job's events in order; `after`: only those after the first `after` of them."""
        self.flush()
        rows = self.db.execute("SELECT seq, doc FROM events WHERE job = ? AND seq > ? ORDER BY seq", (job_id, after))
        stored: dict[int, Event] = {seq: json.loads(doc) for seq, doc in rows}
        for job, seq, ev in self._events:       # not on disk yet (a full disk)
            if job == job_id and seq > after:
                stored[seq] = ev
        return [stored[seq] for seq in sorted(stored)]

    def delete(self, job_id: str) -> None:
        """Forget a job: its output folder first (on a full disk that is the space the rows'
        delete needs), then its rows. StoreWriteFailed if the rows could not be deleted."""
        self.delete_many([job_id])

    def unfinished(self) -> builtins.list[Unfinished]:
        """Jobs a previous daemon accepted and did not finish (queued or running), oldest first."""
        self.flush()
        live = tuple(str(s) for s in (JobState.QUEUED, JobState.RUNNING))
        rows = self.db.execute(
            "SELECT j.doc, i.inputs, i.attempts, (SELECT COUNT(*) FROM events e WHERE e.job = j.id) "
            "FROM jobs j LEFT JOIN job_inputs i ON i.job = j.id WHERE j.state IN (?, ?) ORDER BY j.created_at",
            live).fetchall()
        return [Unfinished(JobRecord.from_doc(json.loads(doc)), _decode_inputs(inputs) if inputs else None,
                           attempts or 0, events) for doc, inputs, attempts, events in rows]

    # ------------------------------------------------------------------ retention (omnid.retention)

    def expired(self, older_than: float | None, keep: int | None, limit: int) -> builtins.list[str]:
        """Up to `limit` finished jobs past the retention bounds, oldest first: those created before
        `older_than` (a time.time(); None: no age bound) and those past the `keep` newest finished
        ones (None: no count bound). Queued and running jobs are never among them."""
        self.flush()
        live = tuple(str(s) for s in (JobState.QUEUED, JobState.RUNNING))
        found: dict[str, float] = {}
        if older_than is not None:
            found.update(self.db.execute(
                "SELECT id, created_at FROM jobs WHERE state NOT IN (?, ?) AND created_at < ? "
                "ORDER BY created_at LIMIT ?", (*live, older_than, limit)).fetchall())
        if keep is not None:
            found.update(self.db.execute(
                "SELECT id, created_at FROM (SELECT id, created_at FROM jobs WHERE state NOT IN (?, ?) "
                "ORDER BY created_at DESC LIMIT -1 OFFSET ?) ORDER BY created_at LIMIT ?",
                (*live, keep, limit)).fetchall())
        return sorted(found, key=lambda j: found[j])[:limit]

    def delete_many(self, job_ids: builtins.list[str], batch: int = 500) -> int:
        """Remove these jobs, their output folders, events, inputs: per `batch` jobs, the folders
        first (space back on a full disk), then one transaction (`DELETE ... WHERE job IN (...)`,
        tried once more after `on_full` freed space). Returns how many rows of `jobs` went;
        StoreWriteFailed when a transaction could not be written."""
        self.flush()
        removed = 0
        for i in range(0, len(job_ids), batch):
            part = job_ids[i:i + batch]
            for job_id in part:
                if job_id in self._dirty:       # never written (a full disk): it goes from memory too
                    removed += 1
                self.discard(job_id)
            for job_id in part:
                shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
            marks = ",".join("?" * len(part))

            def write() -> int:
                self.db.execute("BEGIN")
                self.db.execute(f"DELETE FROM events WHERE job IN ({marks})", part)
                self.db.execute(f"DELETE FROM job_inputs WHERE job IN ({marks})", part)
                n = self.db.execute(f"DELETE FROM jobs WHERE id IN ({marks})", part).rowcount
                self.db.execute("COMMIT")
                return int(n)
            try:
                removed += self._with_room(write)
            except (sqlite3.Error, OSError) as e:
                self._rollback()
                raise StoreWriteFailed(f"deleting {len(part)} job(s) from the database failed: "
                                       f"{type(e).__name__}: {e}", disk_full_error(e)) from None
        return removed

    def counts(self) -> dict[str, int]:
        """Rows in `jobs` and `events`, and the database's free pages (what retention measures)."""
        self.flush()
        return {"jobs": self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0],
                "events": self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0],
                "free_pages": self.db.execute("PRAGMA freelist_count").fetchone()[0]}
