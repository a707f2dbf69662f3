"""Sleeping stages, as the scheduler tends them: which stages have work, which have been idle for
their `idle_unload_s` (they go to sleep), and the jobs that need a sleeping stage (they wake it).

Runs in the supervisor's event-loop thread, as the scheduler's part (scheduler.py; what it needs of
it: `control.SleepControl`): `tend` once a second (the daemon's main loop), `wake_for` on every
admitted job. The sleep and the wake themselves are the stage's (`StageGroup.sleep`, `StageGroup.wake`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

from omnid import protocol as P
from omnid.supervisor.jobs.control import SleepControl
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.supervisor.workers.stage import StageHandle
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import ErrorCode, EventType, JobError, JobState


class SleepTender:
    """Puts idle stages to sleep and wakes them for the jobs that need them. `jobs`: the scheduler
    (control.py says what of it); `worker_slept`: hears of each worker that a sleep stopped (the jobs
    that slipped into it go again: `Recovery.worker_slept`)."""

    def __init__(self, jobs: SleepControl, worker_slept: Callable[[StageHandle], None]) -> None:
        self._jobs = jobs
        self._worker_slept = worker_slept
        # (job, stage) -> when the job heard `stage_waking`: its `stage_awake` is still to come
        self._waking: dict[tuple[str, str], float] = {}
        self._sleeps: set[asyncio.Task[None]] = set()

    def has_work(self, stage: str) -> bool:
        """A live job still needs the stage (or a stopped job's work there is not over yet)."""
        return stage in self._stages_with_work()

    def _stages_with_work(self) -> set[str]:
        """Every stage some live job still needs, or that still runs a stopped job (one pass)."""
        jobs = self._jobs
        busy = {P.parse_address(addr)[0] for addr, _ in jobs.stopping}
        busy.update(name for name, group in jobs.stages.items() if group.running)
        for job in jobs.live_jobs.values():
            busy.update(name for name, run in job.record.stages.items() if run.state.open)
        return busy

    def wake_for(self, job: LiveJob) -> None:
        """The job needs its stages: each one asleep (or falling asleep) is woken; the job hears of it."""
        for name in job.pipeline.stages:
            group = self._jobs.stages.get(name)
            if group is None:
                continue
            group.touch()
            if group.resting:
                job.events.emit(EventType.STAGE_WAKING, stage=name)
                self._waking[(job.id, name)] = time.monotonic()
                task = group.wake_soon()
                task.add_done_callback(functools.partial(self._woke, job.id, name))

    def started(self, job: LiveJob, stage: str) -> None:
        """The job's input was taken by a stage it woke (its `Started`): `stage_awake` comes first, if
        the wake's own end has not said it yet. (The worker takes the input that waited at its address
        as soon as it listens, which can be before the wake's task ends here.)"""
        since = self._waking.pop((job.id, stage), None)
        if since is not None:
            job.events.emit(EventType.STAGE_AWAKE, stage=stage, wake_s=round(time.monotonic() - since, 3))

    def _woke(self, job_id: str, stage: str, task: asyncio.Task[bool]) -> None:
        pending = self._waking.pop((job_id, stage), None) is not None
        job = self._jobs.live_jobs.get(job_id)
        if job is None or task.cancelled():     # cancelled: the daemon stops (the job is kept for its next start)
            return
        group = self._jobs.stages[stage]
        ok = task.exception() is None and task.result()
        if ok:
            if pending:
                job.events.emit(EventType.STAGE_AWAKE, stage=stage, wake_s=group.wake_s)
            return
        why = group.sleep_error or group.last_error or "it could not load"
        self._jobs.finish(job, JobState.FAILED, JobError(ErrorCode.WAKE_FAILED, f"stage {stage!r} was asleep and "
                                                         f"could not wake: {why}", stage))

    def tend(self) -> None:
        """Once a second: a stage idle for its `idle_unload_s` goes to sleep; a stage with work is not idle."""
        busy = self._stages_with_work()
        for group in list(self._jobs.stages.values()):
            if group.name in busy:
                group.touch()
                continue
            limit = group.stage.idle_unload_s
            if limit is not None and group.idle_for() >= limit and group.state.warm:
                self.put_to_sleep(group)

    def put_to_sleep(self, group: StageGroup) -> None:
        """Stop the stage's workers now (it has no work: `has_work`, checked by the caller)."""
        if group.resting:
            return
        group.doze()                        # from now on a job for it wakes it again
        task = self._jobs.loop.create_task(self._sleep(group), name=f"sleep-{group.name}")
        self._sleeps.add(task)
        task.add_done_callback(self._sleeps.discard)

    async def _sleep(self, group: StageGroup) -> None:
        try:
            slept = await group.sleep(self._jobs.config.daemon.stop_grace_s)
        finally:
            group.dozed()
        if not slept:                       # a job came first: it stays awake
            return
        for h in group.replicas:            # a job that slipped in while the workers stopped goes again
            self._worker_slept(h)
        if group.sleeping and self.has_work(group.name):
            group.wake_soon()

    def stop(self) -> None:
        """The daemon stops: the sleeps under way are called off."""
        for task in self._sleeps:
            task.cancel()
