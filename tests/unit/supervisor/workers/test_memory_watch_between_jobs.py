"""`max_rss_mb` restarts a worker only between jobs (omnid/supervisor/workers/memory_watch.py): a
worker over the bound with a job running in it, or queued in it, is left alone until it is idle.

In-process, on the real `MemoryWatch` in a running event loop; the handle is a stand-in with the
fields the watch reads (its state, its running jobs, its queue depth) and a `restart` that records
its calls, and the RSS is the test's (`rss_bytes`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from omnid.config import StageConfig
from omnid.protocol import QueueStats
from omnid.supervisor.workers import memory_watch
from omnid.supervisor.workers.memory_watch import MemoryWatch
from omnid.vocabulary import WorkerState

MIB = 1 << 20


@dataclass
class Handle:
    """What MemoryWatch reads of a StageHandle (`memory_watch.Watched`)."""

    stage: StageConfig = field(default_factory=lambda: StageConfig(name="leaky", engine="python", max_rss_mb=100))
    pid: int | None = 4242
    alive: bool = True
    label: str = "leaky"
    state: WorkerState = WorkerState.READY
    running: tuple[str, ...] = ()
    stats: QueueStats = field(default_factory=QueueStats)
    restarts: list[tuple[str, float]] = field(default_factory=list)

    def where(self) -> dict[str, Any]:
        return {"placement": "local", "node": None}

    async def restart(self, reason: str, idle_timeout: float) -> None:
        """As StageHandle's: a new worker (another pid) in place of this one."""
        self.restarts.append((reason, idle_timeout))
        assert self.pid is not None
        self.pid += 1

    def job_started(self, job: str) -> None:
        """As StageHandle takes a worker's Started: the job in `running`, the state busy."""
        self.running = (*self.running, job)
        self.state = WorkerState.BUSY

    def job_finished(self, job: str) -> None:
        self.running = tuple(j for j in self.running if j != job)
        self.state = WorkerState.BUSY if self.running else WorkerState.READY


@pytest.fixture
def rss(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first worker's RSS, as the test sets it (rss[0]); a new worker's is 50 MiB."""
    now = [50 * MIB]
    monkeypatch.setattr(memory_watch, "rss_bytes", lambda pid: now[0] if pid == 4242 else 50 * MIB)
    return now


async def looks(watch: MemoryWatch, n: int = 3) -> None:
    """`n` of the watch's once-a-second looks, each followed by a turn of the loop (where a restart
    it decided on runs)."""
    for _ in range(n):
        watch.tend()
        await asyncio.sleep(0)
        await asyncio.sleep(0)


def test_a_worker_over_the_bound_is_restarted_after_its_job_not_during_it(rss: list[int]) -> None:
    async def run() -> None:
        h = Handle()
        watch = MemoryWatch(h)
        await looks(watch)
        assert h.restarts == []                         # under the bound
        h.job_started("j1")
        rss[0] = 300 * MIB                              # the job makes it grow past max_rss_mb = 100
        await looks(watch)
        assert h.restarts == [] and watch.rss_restarts == 0, "restarted while its job ran"
        h.stats = QueueStats(depth=1)                   # the job ends, and the next one waits in its queue
        h.job_finished("j1")
        await looks(watch)
        assert h.restarts == [], "restarted with a job queued in it"
        h.stats = QueueStats(depth=0)                   # idle: between jobs
        await looks(watch)
        assert watch.rss_restarts == 1 and len(h.restarts) == 1, h.restarts
        reason, _ = h.restarts[0]
        assert "over max_rss_mb = 100" in reason and "300 MiB" in reason
        assert h.pid == 4243 and watch.last_rss == 50 * MIB      # the new worker, under the bound: kept

    asyncio.run(run())


@pytest.mark.parametrize(("state", "running", "depth"), [
    (WorkerState.READY, ("j1",), 0),        # a job in the handle's running list (whatever its state says)
    (WorkerState.BUSY, (), 0),              # the worker busy
    (WorkerState.READY, (), 2),             # jobs queued in the worker
], ids=["running-job", "busy", "queued-jobs"])
def test_each_sign_of_a_job_in_the_worker_holds_the_restart(rss: list[int], state: WorkerState,
                                                            running: tuple[str, ...], depth: int) -> None:
    async def run() -> None:
        h = Handle(state=state, running=running, stats=QueueStats(depth=depth))
        watch = MemoryWatch(h)
        rss[0] = 500 * MIB
        await looks(watch)
        assert h.restarts == [] and watch.rss_restarts == 0
        h.state, h.running, h.stats = WorkerState.READY, (), QueueStats()
        await looks(watch)
        assert len(h.restarts) == 1 and watch.rss_restarts == 1

    asyncio.run(run())


def test_a_worker_placed_elsewhere_is_never_read_nor_restarted(rss: list[int]) -> None:
    """A Ray actor's pid may be another node's: its /proc here is not its RSS."""
    class Remote(Handle):
        def where(self) -> dict[str, Any]:
            return {"placement": "ray", "node": "n2"}

    async def run() -> None:
        h = Remote()
        watch = MemoryWatch(h)
        rss[0] = 500 * MIB
        await looks(watch)
        assert h.restarts == [] and watch.last_rss is None

    asyncio.run(run())


def test_the_last_rss_is_kept_for_the_report_of_a_kill(rss: list[int]) -> None:
    """What a SIGKILL nobody here sent may mean names the worker's last RSS (its own look, in a
    heartbeat, when the watch could not read it); a new worker starts with none."""
    async def run() -> None:
        h = Handle()
        watch = MemoryWatch(h)
        watch.spawned(h.pid)
        rss[0] = 80 * MIB
        await looks(watch, 1)
        assert watch.oom_note(4242).startswith(" (last RSS 80 MiB)")
        watch.heard(90 * MIB)
        assert watch.oom_note(4242).startswith(" (last RSS 90 MiB)")
        watch.spawned(4243)
        assert watch.last_rss is None and not watch.we_killed

    asyncio.run(run())
