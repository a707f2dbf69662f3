"""Retention: finished jobs past the configured bounds are removed, so the state dir stays bounded.

Runs in the supervisor's event-loop thread: the daemon's main loop calls `Retention.maybe_run()`
once per tick (every second). It does work once at start and then every `retention_interval_s`,
and blocks the loop for one batch at most (`BATCH` jobs: a few sqlite `DELETE ... WHERE job IN
(...)` in one transaction, then `rmtree` of their folders; about 20 ms for 200 no-op jobs). When
more jobs are due than one batch holds, the next tick takes the next batch, so a backlog (a
lowered `keep_jobs`, a first start on an old state dir) is worked off without a long stall.

The bounds (`[daemon]`): `keep_jobs_days` (finished jobs created longer ago go) and `keep_jobs`
(finished jobs past that many go, oldest first); 0 turns each off. A job goes with its record,
its events, its kept inputs and its output folder, as `omnictl rm` removes it. Queued and
running jobs are never removed, nor any job the scheduler still holds (live, or a stage still
stopping it).

A batch removes its jobs' output folders first, then their rows (`JobStore.delete_many`): on a
full disk the folders give back the space sqlite's journal needs to delete the rows (and the
store gives back the daemon's ballast if that is not enough).

The database file does not shrink: sqlite puts the freed pages on its free list and the next
jobs' rows reuse them, so the file stays at its high-water mark instead of growing without end.
(`auto_vacuum = INCREMENTAL` would let it give pages back, but it cannot be turned on for an
existing database without a full VACUUM, which rewrites the whole file under the loop.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import structlog

from omnid.config import DaemonConfig
from omnid.store import JobStore, StoreWriteFailed

log = structlog.get_logger("omnid.retention")

BATCH = 200                # jobs removed per call at most (bounds the time the loop is blocked)


class Retention:
    """When and what to remove; the store does the removing (`JobStore.expired`, `delete_many`)."""

    def __init__(self, config: DaemonConfig, store: JobStore,
                 busy: Callable[[], Collection[str]] = frozenset,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`busy`: the ids of the jobs the scheduler still holds (never removed)."""
        self.store = store
        self.keep_days = config.keep_jobs_days
        self.keep_jobs = config.keep_jobs
        self.interval_s = config.retention_interval_s
        self.busy = busy
        self.clock = clock
        self._next = 0.0           # when it is due (0: at the first call)
        self.removed = 0           # jobs removed since start

    @property
    def enabled(self) -> bool:
        return self.keep_days > 0 or self.keep_jobs > 0

    def maybe_run(self) -> int:
        """Remove one batch if due; returns how many jobs were removed. Never raises: a failure is
        logged and tried again at the next interval."""
        if not self.enabled or self.clock() < self._next:
            return 0
        try:
            n, more = self.run_once()
        except StoreWriteFailed as e:
            log.warning("retention could not delete; tried again at the next interval", error=str(e))
            n, more = 0, False
        except Exception:
            log.exception("retention failed")
            n, more = 0, False
        # a full batch: more may be due, take it at the next tick; else wait the interval
        self._next = self.clock() + (0.0 if more else self.interval_s)
        return n

    def run_once(self, now: float | None = None) -> tuple[int, bool]:
        """Remove up to BATCH due jobs. Returns (removed, whether more may be due)."""
        now = time.time() if now is None else now
        older_than = now - self.keep_days * 86400 if self.keep_days > 0 else None
        keep = self.keep_jobs if self.keep_jobs > 0 else None
        busy = self.busy()
        due = [j for j in self.store.expired(older_than, keep, BATCH + len(busy)) if j not in busy][:BATCH]
        if not due:
            return 0, False
        t0 = time.monotonic()
        removed = self.store.delete_many(due)
        self.removed += removed
        log.info("retention removed jobs", jobs=removed, took_ms=round((time.monotonic() - t0) * 1000, 1),
                 keep_jobs=self.keep_jobs, keep_jobs_days=self.keep_days)
        return removed, len(due) == BATCH
