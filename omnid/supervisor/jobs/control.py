"""What the scheduler's parts need of it: the live jobs, the stages, the store, and ending a job.

The scheduler (scheduler.py) owns the live jobs and composes the parts that act on them: `Recovery`
(recovery.py), `take_back` (restore.py), `SleepTender` (stage_sleep.py) and `Ending` (ending.py).
Each part declares here what it uses of its owner, and the scheduler provides it: the parts import
this module, never the scheduler, so no import runs back up. Type declarations only; runs wherever its users run (the
supervisor's event-loop thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from omnid.store import JobStore
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.vocabulary import JobError, JobState

if TYPE_CHECKING:
    from omnid.config import Config
    from omnid.supervisor.metrics import Metrics
    from omnid.supervisor.workers.stage_group import StageGroup


class JobControl(Protocol):
    """What recovery and a restart's restore need of the scheduler."""

    live_jobs: dict[str, LiveJob]    # the live jobs by id (the parts add and read; `finish` removes)
    stages: Mapping[str, StageGroup]
    store: JobStore

    def finish(self, job: LiveJob, state: JobState, error: JobError | None = None) -> None:
        """Move a live job to a terminal state (once), stop its work, clean every worker."""

    def rank(self, job: LiveJob) -> None:
        """Give the job its place in the queues (priority, fair share between owners: omnid/fair_queue.py)."""


class SleepControl(JobControl, Protocol):
    """What the sleep tender needs of the scheduler besides: the jobs still stopping in a worker,
    the event loop its sleeps run on, and the config in force (the grace a stopping worker gets)."""

    @property
    def stopping(self) -> Mapping[tuple[str, str], object]:
        """(worker address, job) of each cancelled job whose stage has not stopped it yet."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def config(self) -> Config: ...


class EndControl(Protocol):
    """What ending a job needs of the scheduler: the live jobs (it removes the one that ends), the
    stages (told to drop it), the store, the metrics, the event loop its timers run on, and the
    config in force (the grace a cancelled job's worker gets)."""

    live_jobs: dict[str, LiveJob]
    stages: Mapping[str, StageGroup]
    store: JobStore

    @property
    def metrics(self) -> Metrics | None: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def config(self) -> Config: ...
