"""What a stage worker knows of each job: one `WorkerJob` per job, in one `JobTable`.

Threads: the data plane's connection threads admit a job's parts (`StageWorker.admit`), the
control thread applies the supervisor's Cancel, Forget, Resend and Reroute, and the main thread
runs the job in the engine and hands its outputs on. Each field of `WorkerJob` says which of them
touch it, and under which lock:

- "table lock": read and written under `JobTable.lock` (a lone read of one value may skip it);
- "main": the main thread's only, no lock.

A job's entry lives from its first part's admission (or first Reroute) to its `Forget`, which
removes it in one step (`JobTable.forget`); `len(table)` is how many jobs the worker keeps state
for. The main thread keeps its own references to the jobs it is running (`StageWorker.running`)
and offering windows of (`Handoff`), so a job forgotten meanwhile still ends there; nothing it
does puts a forgotten job back in the table. Ended jobs (cancelled or forgotten) are remembered
apart, in a bounded record (`JobTable.ended`), so that late parts of them are dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from omnid.config_types import PipelineConfig
from omnid.dataplane.wire import WorkItem
from omnid.engines.base import RequestContext
from omnid.worker.outputs import StreamWriter
from omnid.worker.windows import EdgeStream, WindowBuilder

ENDED_JOBS_KEPT = 4096


@dataclass(eq=False)
class WorkerJob:
    """One job, as this worker knows it (see the module docstring for the thread rules)."""

    id: str
    # ---- table lock (data-conn threads, control thread, main thread)
    # Its pipeline, resolved once by the key its items carry, when its first part is admitted (a
    # streamed window) or assembled; never changed after (a lone read may skip the lock).
    pipeline: PipelineConfig | None = None
    parts: list[WorkItem] = field(default_factory=list)         # fan-in parts waiting for the rest
    received: set[str | None] = field(default_factory=set)      # the sources whose part was taken
    outbox: dict[str, WorkItem] = field(default_factory=dict)   # dst -> what we handed it (for a Resend)
    reroutes: dict[str, int] = field(default_factory=dict)      # stage -> the replica the job moved to there
    streams: dict[str | None, EdgeStream] = field(default_factory=dict)   # src -> its streamed windows
    # ---- main (from `_assemble` until the request has been reported; then released, so that
    # nothing keeps the job's inputs, and the shared memory they may sit on, alive)
    item: WorkItem | None = None            # the item that started the request here
    ctx: RequestContext | None = None       # the request, in the engine
    live_outputs: StreamWriter | None = None    # a last stage's stream files, while it runs
    # ---- main (streaming edges: until the job's last window is offered, or the job ended)
    builders: dict[str, WindowBuilder] = field(default_factory=dict)    # dst -> the window being built
    unsent: dict[str, deque[WorkItem]] = field(default_factory=dict)    # dst -> windows not admitted there yet

    @property
    def request(self) -> RequestContext:
        """The request in the engine (main: only while the job is in `StageWorker.running`)."""
        if self.ctx is None:
            raise RuntimeError(f"job {self.id} has no request here")
        return self.ctx


class JobTable:
    """The worker's jobs by id, and the record of the jobs that ended.

    `lock` guards the table, `ended` and the "table lock" fields of every entry; `entry` and `forget`
    are called with it held. `is_dead` is a lone read, safe from any thread without it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._jobs: dict[str, WorkerJob] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()     # job -> why; bounded, oldest first out

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job: str) -> WorkerJob | None:
        return self._jobs.get(job)

    def entry(self, job: str) -> WorkerJob:
        """The job's entry, made if it has none (lock held)."""
        found = self._jobs.get(job)
        if found is None:
            found = self._jobs[job] = WorkerJob(job)
        return found

    def is_dead(self, job: str) -> bool:
        return job in self.ended

    def end(self, job: str, reason: str) -> WorkerJob | None:
        """Record that the job ended (a Cancel; lock held); its entry, if it has one."""
        self.ended[job] = reason
        self._trim()
        return self._jobs.get(job)

    def forget(self, job: str) -> WorkerJob | None:
        """Drop everything of the job (a Forget; lock held): its entry goes, it stays ended."""
        self.ended.setdefault(job, "forgotten")
        self._trim()
        return self._jobs.pop(job, None)

    def _trim(self) -> None:
        while len(self.ended) > ENDED_JOBS_KEPT:
            self.ended.popitem(last=False)
