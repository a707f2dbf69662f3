"""A start's first business: the jobs the previous daemon accepted and did not finish, taken back.

Runs in the supervisor's event-loop thread, once, while the daemon builds its parts (before the
stage workers start): the store's unfinished jobs become live jobs of the scheduler again, or fail.

Queued jobs are queued again, in their order: each keeps its priority, and is given its fair-share
tag again, oldest first (omnid/fair_queue.py). A job that was running runs again from the start if
its pipeline's `retries` allow another attempt (its state stays `running`), else it fails saying the
daemon was interrupted. Their timeouts start again (`Scheduler.arm_restored`, once the stages are
up): the time the daemon was down is not theirs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import structlog

from omnid.config import PipelineConfig
from omnid.store import Unfinished
from omnid.supervisor.jobs.control import JobControl
from omnid.supervisor.jobs.dispatch import Dispatch
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.vocabulary import ErrorCode, EventType, JobError, JobState, StageRun

log = structlog.get_logger("omnid.scheduler")


def take_back(jobs: JobControl, dispatch: Dispatch, pipelines: Mapping[str, PipelineConfig],
              unfinished: list[Unfinished]) -> list[LiveJob]:
    """The unfinished jobs, oldest first, live again in `jobs` (or failed), on the `pipelines` in force;
    `dispatch` routes and feeds them. Returns those taken back, whose timers wait for the stages."""
    now = time.time()
    restored: list[LiveJob] = []
    for old in unfinished:
        record = old.record
        pipeline = pipelines.get(record.pipeline)
        was_running = record.state is JobState.RUNNING
        job = LiveJob(record, pipeline or PipelineConfig(record.pipeline, tuple(record.stages), ()),
                      old.inputs or {}, jobs.store, old.events)
        job.attempts = old.attempts
        jobs.live_jobs[job.id] = job
        problem = None
        if pipeline is None:
            problem = f"the daemon restarted without its pipeline {record.pipeline!r} (the configuration changed)"
        elif old.inputs is None:
            problem = "the daemon stopped before this job finished; submit it again"
        elif was_running and job.attempts >= pipeline.retries:
            problem = ("the daemon was interrupted while this job was running"
                       + (f" (retries = {pipeline.retries}, all used)" if pipeline.retries else ""))
        if problem is not None or pipeline is None:
            jobs.finish(job, JobState.FAILED, JobError(ErrorCode.DAEMON_RESTARTED, str(problem)))
            continue
        record.stages = {s: StageRun() for s in pipeline.stages}
        jobs.rank(job)                  # its priority kept, its fair-share tag given again, oldest first
        dispatch.route(job)
        if was_running:
            job.attempts += 1
            jobs.store.keep_inputs(job.id, job.inputs, job.attempts)
            job.events.emit(EventType.ERROR, code=ErrorCode.DAEMON_RESTARTED,
                            message=f"the daemon was interrupted; running the job again "
                                    f"(attempt {job.attempts + 1})")
        jobs.store.save(record)
        restored.append(job)
    for src in sorted({s for job in restored for s in job.pipeline.sources}):
        dispatch.feed([job for job in restored if src in job.pipeline.sources], src)
    if restored:
        log.info("jobs taken back after a restart", queued=sum(j.record.state is JobState.QUEUED for j in restored),
                 rerun=sum(j.record.state is JobState.RUNNING for j in restored), took_s=round(time.time() - now, 3))
    return restored
