"""One stage worker's memory, as its handle (stage.py, known here as `Watched`) watches it: its RSS once a second, held
against the stage's `max_rss_mb` (a worker over it is restarted between jobs), and, when the worker
is SIGKILLed by someone other than the supervisor, what its death may mean (the OOM killer).

Runs in the supervisor's event-loop thread, with the handle's heartbeat check; nothing blocks
(a /proc read, the cgroup's OOM count).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from omnid import protocol as P
from omnid.config import StageConfig
from omnid.process_stats import rss_bytes
from omnid.supervisor import resources
from omnid.supervisor.workers.documents import Where
from omnid.vocabulary import WorkerState

log = structlog.get_logger("omnid.stage")


class Watched(Protocol):
    """What the watch reads of its handle (`StageHandle`, stage.py), and the one thing it asks of it:
    a restart between jobs."""

    @property
    def label(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def state(self) -> WorkerState: ...

    @property
    def running(self) -> tuple[str, ...]: ...

    @property
    def stats(self) -> P.QueueStats: ...

    @property
    def stage(self) -> StageConfig: ...

    def where(self) -> Where: ...

    async def restart(self, reason: str, idle_timeout: float) -> None: ...


class MemoryWatch:
    """A handle's watch of its worker's memory (one per handle, across the worker's incarnations)."""

    def __init__(self, handle: Watched) -> None:
        self._handle = handle
        self._oom: resources.OomWatch | None = None     # the cgroup's OOM count when the worker started
        self.we_killed = False                          # the supervisor SIGKILLed it (not the kernel)
        self.last_rss: int | None = None                # its RSS at the last look (once a second)
        self.rss_restarts = 0                           # restarts for being over max_rss_mb
        self._rss_restart: asyncio.Task[None] | None = None

    def spawned(self, pid: int | None) -> None:
        """A new worker: its OOM count starts now; nothing is known of its RSS yet."""
        self._oom = resources.OomWatch.now(pid or "self")
        self.we_killed = False
        self.last_rss = None

    def heard(self, rss_bytes: int | None) -> None:
        """The worker's own look, in its heartbeat: in the pipe even when our loop lagged."""
        if rss_bytes:
            self.last_rss = rss_bytes

    def oom_note(self, pid: int) -> str:
        """What a SIGKILL nobody here sent may mean: its last RSS, and "likely out of memory" when
        the cgroup's OOM count or the kernel log says so."""
        note = f" (last RSS {self.last_rss >> 20} MiB)" if self.last_rss else ""
        evidence = self._oom.evidence(pid) if self._oom is not None else None
        if evidence:
            note += f": likely out of memory ({evidence})"
        return note

    def tend(self) -> None:
        """Once a second (with the heartbeat check): the worker's RSS, kept for the report of an OOM
        kill, and held against `max_rss_mb`: a worker over it is restarted between jobs (nothing
        running or queued in it), like gunicorn's max_requests, counted in `rss_restarts`."""
        h = self._handle
        pid = h.pid
        local = h.where()["placement"] == "local"      # (a Ray actor's pid may be another node's)
        rss = rss_bytes(pid) if pid is not None and local and h.alive else None
        if not rss:                     # gone, or going: a dying process's statm reads 0 (kept: the last real one)
            return
        self.last_rss = rss
        limit = h.stage.max_rss_mb
        if (not limit or rss <= limit << 20 or self._rss_restart is not None or h.state is not WorkerState.READY
                or h.running or h.stats.depth):
            return
        self.rss_restarts += 1
        reason = f"its RSS {rss >> 20} MiB is over max_rss_mb = {limit}"
        log.warning("stage worker over max_rss_mb: restarting it between jobs", stage=h.label, pid=pid,
                    rss_mb=rss >> 20, max_rss_mb=limit, rss_restarts=self.rss_restarts)
        self._rss_restart = asyncio.get_running_loop().create_task(self._restart_for_rss(reason))

    async def _restart_for_rss(self, reason: str) -> None:
        try:
            await self._handle.restart(reason, 0.0)
        finally:
            self._rss_restart = None
