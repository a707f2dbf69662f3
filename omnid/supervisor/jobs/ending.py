"""A job's end: its deadline, a cancel, its terminal state written once, and its workers cleaned.

Runs in the supervisor's event-loop thread, as the scheduler's part (scheduler.py; what it needs of
it: `control.EndControl`). Nothing here blocks: the record and the manifest are short writes, the
workers are told by non-blocking sends (`Cancel`, `Forget`), the deadline and the grace kill are
timers on the loop.

A job ends once (`finish`): its record takes the terminal state, its open stage runs are cancelled
(unless it succeeded), a succeeded job's folder gets its `manifest.json`, every stage of its
pipeline is told to drop it, and each stage that may still be running it gets `cancel_grace_s` to
say it stopped (`stopped`), after which the worker is killed (without counting toward its
`max_restarts`) and restarted. A deadline (`arm`) or a client's cancel (`cancel`) ends it the same
way, with the message saying where the job was.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import structlog

from omnid import protocol as P
from omnid.supervisor.jobs.control import EndControl
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.vocabulary import ErrorCode, EventFields, EventType, JobError, JobRecord, JobState, StageRunState

log = structlog.get_logger("omnid.scheduler")


def exemplar(job: LiveJob) -> str | None:
    """The job's trace id for a histogram's exemplar (a sampled trace only: one a receiver has)."""
    return job.trace.trace_id if job.trace is not None and job.trace.sampled else None


class Ending:
    """Ends the scheduler's jobs. `jobs`: the scheduler (control.py says what of it); `forget`:
    hears of each job that ended, for the parts that keep some of it (`Recovery.forget`)."""

    def __init__(self, jobs: EndControl, forget: Callable[[str], None]) -> None:
        self._jobs = jobs
        self._forget = forget
        self.stopping: dict[tuple[str, str], asyncio.TimerHandle] = {}   # (worker address, job) -> grace kill

    def arm(self, job: LiveJob) -> None:
        """Start the job's deadline: its `timeout_s` from now."""
        job.timer = self._jobs.loop.call_later(job.record.timeout_s, self._timed_out, job.id)

    def finish(self, job: LiveJob, state: JobState, error: JobError | None = None) -> None:
        """Move a live job to a terminal state (once), stop its work, clean every worker."""
        jobs = self._jobs
        if job.id not in jobs.live_jobs:
            return
        del jobs.live_jobs[job.id]
        if job.timer is not None:
            job.timer.cancel()
        now = time.time()
        record = job.record
        record.set_state(state, now, error)
        busy_stages = []
        for name, run in record.stages.items():
            if run.state.busy:              # queued: its Started may be on the way
                busy_stages.append(name)
            if run.state.open and state is not JobState.SUCCEEDED:
                run.set_state(StageRunState.CANCELLED, now)
        if state is JobState.SUCCEEDED:
            self._write_manifest(record)
        jobs.store.save(record)
        said: EventFields = {"state": state}
        if error:
            said["error"] = error.to_doc()
        job.events.emit(EventType.STATE, **said)
        job.events.close()
        for name in job.pipeline.stages:
            h = jobs.stages.get(name)
            if h is None:                   # a stage the config no longer has (a job restored after a change)
                continue
            if state is not JobState.SUCCEEDED:
                h.send(P.Cancel(job.id, reason=str(state)))
            h.send(P.Forget(job.id))
        grace = jobs.config.daemon.cancel_grace_s
        for name in busy_stages:
            address = P.address(name, job.route(name))
            self.stopping[(address, job.id)] = jobs.loop.call_later(grace, self._grace_expired, address, job.id)
        self._forget(job.id)
        jobs.store.drop_inputs(job.id)
        # Committed now, before the readers this end woke run: a client told that the job ended
        # finds it so in the store (and after a crash), with all its events
        jobs.store.flush()
        metrics = jobs.metrics
        if metrics:
            metrics.job_finished(job.pipeline.name, state, now - record.created_at, exemplar(job))
            if state is JobState.SUCCEEDED and job.audio_s > 0:
                metrics.real_time_factor(job.pipeline.name, (now - record.created_at) / job.audio_s)
        log.info("job finished", job=job.id, pipeline=job.pipeline.name, state=str(state),
                 error=error.message if error else None)

    def _write_manifest(self, record: JobRecord) -> None:
        folder = self._jobs.store.job_dir(record.id)
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {"id": record.id, "pipeline": record.pipeline, "created_at": record.created_at,
                    "finished_at": record.finished_at, "inputs": record.inputs, "params": record.params,
                    "outputs": record.outputs}
        tmp = folder / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(folder / "manifest.json")

    def stopped(self, address: str, job_id: str) -> None:
        """The worker at `address` is done with the job (it stopped, failed or finished it): no grace kill."""
        timer = self.stopping.pop((address, job_id), None)
        if timer is not None:
            timer.cancel()

    def worker_gone(self, address: str) -> None:
        """The worker at `address` died: nothing of it is left to kill."""
        for key in [k for k in self.stopping if k[0] == address]:
            self.stopping.pop(key).cancel()

    def _grace_expired(self, address: str, job_id: str) -> None:
        self.stopping.pop((address, job_id), None)
        stage, replica = P.parse_address(address)
        group = self._jobs.stages.get(stage)
        h = group.replica(replica) if group is not None else None
        if h is not None and job_id in h.running:
            h.kill(f"job {job_id} did not stop within {self._jobs.config.daemon.cancel_grace_s:g} s of its cancel",
                   counts=False)

    def cancel(self, job_id: str, reason: JobState = JobState.CANCELLED) -> JobRecord | None:
        """Cancel a live job (idempotent); None when it is not live. `reason`: CANCELLED or TIMED_OUT."""
        job = self._jobs.live_jobs.get(job_id)
        if job is None:
            return None
        where = self._where(job)
        if reason is JobState.CANCELLED:
            message = "cancelled by request"
        else:
            message = f"timed out after {job.record.timeout_s:g} s" + \
                (f" while {where[1]} stage {where[0]!r}" if where else "")
        self.finish(job, reason, JobError(ErrorCode(str(reason)), message, where[0] if where else None))
        return job.record

    @staticmethod
    def _where(job: LiveJob) -> tuple[str, str] | None:
        """Where the job is, for a timeout's message: (stage, 'running in' / 'queued for' / 'waiting for')."""
        for wanted, verb in ((StageRunState.RUNNING, "running in"), (StageRunState.QUEUED, "queued for")):
            for s in job.pipeline.stages:
                if job.stage(s).state is wanted:
                    return s, verb
        if job.pipeline.sources:
            return job.pipeline.sources[0], "waiting for"
        return None

    def _timed_out(self, job_id: str) -> None:
        self.cancel(job_id, reason=JobState.TIMED_OUT)
