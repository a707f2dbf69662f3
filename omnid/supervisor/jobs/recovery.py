"""Recovery from dead workers: which jobs fail, which are retried, which inputs are asked for again.

Runs in the supervisor's event-loop thread, called by the scheduler when a stage worker dies, comes
back (READY after a restart), or is given up for good. Nothing here blocks: resends are control
messages (non-blocking sends) or items pushed to a feeder thread.

The rules:
- the job a dead worker was running fails, unless its pipeline's `retries` allows another attempt;
- jobs queued in the dead worker, and outputs it had produced but not yet handed downstream, are
  asked for again once the worker is back: from the feeder (the job's own inputs) or from the
  upstream worker's kept copy (`Resend`); if that copy is gone too, the upstream computes it again;
- a replica given up for good hands its jobs to the stage's other replicas (`reroute`); the stage
  given up for good (no replica left) fails every live job that needs it.

Everything is per replica: a job is only the business of the replica that serves it (`LiveJob.route`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from omnid import protocol as P
from omnid.supervisor.jobs.control import JobControl
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.vocabulary import ErrorCode, EventType, JobError, JobState, StageRunState, WorkerState

if TYPE_CHECKING:
    from omnid.supervisor.jobs.dispatch import Dispatch
    from omnid.supervisor.workers.stage import StageHandle


class Recovery:
    def __init__(self, jobs: JobControl, dispatch: Dispatch) -> None:
        self._jobs = jobs
        self._dispatch = dispatch           # the jobs' replicas (`reroute`) and their feeders (`feed`)
        # worker address -> jobs whose input for that worker must be asked for again once it is back
        self.resend_after_restart: dict[str, set[str]] = {}

    def _worker(self, job: LiveJob, stage: str) -> StageHandle | None:
        """The replica of `stage` that serves `job`."""
        group = self._jobs.stages.get(stage)
        return group.replica(job.route(stage)) if group is not None else None

    def forget(self, job_id: str) -> None:
        """The job ended: nothing is to be resent for it."""
        for pending in self.resend_after_restart.values():
            pending.discard(job_id)

    def pending(self) -> int:
        """Jobs waiting for a resend (per-job state this class holds)."""
        return sum(len(p) for p in self.resend_after_restart.values())

    def _later(self, job: LiveJob, stage: str) -> None:
        """Ask for `stage`'s inputs of `job` again once the replica serving it there is READY."""
        self.resend_after_restart.setdefault(P.address(stage, job.route(stage)), set()).add(job.id)

    def _ask(self, job: LiveJob, stage: str) -> None:
        """Ask for them now if that replica is warm, else once it is back."""
        worker = self._worker(job, stage)
        if worker is not None and worker.state.warm:
            self.inputs_for(job, stage)
        else:
            self._later(job, stage)

    @staticmethod
    def _undelivered(job: LiveJob, stage: str) -> bool:
        """`stage` finished the job, but a downstream stage has not admitted its outputs yet."""
        return job.stage(stage).state is StageRunState.SUCCEEDED and any(
            (stage, e.dst) not in job.delivered for e in job.pipeline.outgoing(stage))

    def worker_died(self, handle: StageHandle, reason: str) -> None:
        """Fail (or retry) the jobs the worker ran; remember what it held, to ask for it again."""
        name = handle.name
        if len(self._jobs.stages[name].replicas) > 1:
            reason = f"(replica {handle.replica}) {reason}"
        now = time.time()
        for job in list(self._jobs.live_jobs.values()):
            if name not in job.record.stages or job.route(name) != handle.replica:
                continue
            run = job.stage(name)
            undelivered = self._undelivered(job, name)
            streams_out = any(e.window > 0 for e in job.pipeline.outgoing(name))
            mid_stream = job.streamed or (streams_out and run.state is StageRunState.RUNNING)
            if mid_stream and (run.state.busy or undelivered):
                # Its windows are gone with the worker, and the other stage may have used some of
                # them: it cannot be resent, nor retried without a cross-stage reset.
                run.set_state(StageRunState.FAILED, now)
                msg = f"stage {name!r} {reason} while streaming this job (a streamed job is not retried)"
                job.events.emit(EventType.ERROR, stage=name, code=ErrorCode.WORKER_DIED, message=msg)
                self._jobs.finish(job, JobState.FAILED, JobError(ErrorCode.WORKER_DIED, msg, name))
            elif run.state is StageRunState.RUNNING:
                if job.attempts < job.pipeline.retries:
                    job.attempts += 1
                    self._jobs.store.keep_inputs(job.id, job.inputs, job.attempts)
                    job.events.emit(EventType.ERROR, stage=name, code=ErrorCode.WORKER_DIED,
                                    message=f"stage {name!r} {reason}; retrying (attempt {job.attempts + 1})")
                    run.set_state(StageRunState.QUEUED, now)
                    self._later(job, name)
                else:
                    run.set_state(StageRunState.FAILED, now)
                    msg = f"stage {name!r} {reason} while running this job"
                    job.events.emit(EventType.ERROR, stage=name, code=ErrorCode.WORKER_DIED, message=msg)
                    self._jobs.finish(job, JobState.FAILED, JobError(ErrorCode.WORKER_DIED, msg, name))
            elif run.state is StageRunState.QUEUED or undelivered:
                run.set_state(StageRunState.QUEUED, now)
                self._later(job, name)

    def worker_slept(self, handle: StageHandle) -> None:
        """The worker was stopped for its stage to sleep, with no work as far as we knew: a job
        that reached it meanwhile is asked for again when it wakes (nothing fails)."""
        name = handle.name
        now = time.time()
        for job in self._jobs.live_jobs.values():
            run = job.record.stages.get(name)
            if run is None or job.route(name) != handle.replica:
                continue
            if run.state.busy or self._undelivered(job, name):
                run.set_state(StageRunState.QUEUED, now)
                self._later(job, name)

    def worker_back(self, handle: StageHandle) -> None:
        """The worker is READY again: ask for the inputs its predecessor lost, oldest job first."""
        pending = self.resend_after_restart.pop(P.address(handle.name, handle.replica), set())
        live = self._jobs.live_jobs
        jobs = sorted((live[j] for j in pending if j in live), key=lambda j: j.record.created_at)
        fed_by_the_feeder = [job for job in jobs if not job.pipeline.incoming(handle.name)]
        if fed_by_the_feeder:               # ahead of newer jobs, in their own order
            self._dispatch.feed(fed_by_the_feeder, handle.name, front=True)
        for job in jobs:
            if job.pipeline.incoming(handle.name):
                self.inputs_for(job, handle.name)

    def inputs_for(self, job: LiveJob, stage: str) -> None:
        """Ask again for `stage`'s inputs of `job`: from the feeder, or from its upstreams."""
        incoming = job.pipeline.incoming(stage)
        if not incoming:
            self._dispatch.feed([job], stage, front=True)
        for edge in incoming:
            if job.stage(edge.src).state is not StageRunState.SUCCEEDED:
                continue                    # not produced yet: it will be delivered when it is
            upstream = self._worker(job, edge.src)
            if upstream is None or not upstream.send(P.Resend(job.id, stage, job.route(stage))):
                self.rerun(job, edge.src)   # that worker is down: its copy is gone with it

    def rerun(self, job: LiveJob, stage: str) -> None:
        """`stage`'s outputs of `job` were lost with a dead worker: compute them again."""
        job.stage(stage).set_state(StageRunState.QUEUED, time.time())
        job.delivered = {d for d in job.delivered if d[0] != stage}
        self._ask(job, stage)

    def stage_failed(self, handle: StageHandle, error: str) -> None:
        """A replica is given up for good. Its jobs move to the stage's other replicas while one
        still serves (or may: restarting, loading); when none is left, every live job that needs
        the stage fails."""
        name = handle.name
        group = self._jobs.stages[name]
        others = [h for h in group.replicas[:group.active]
                  if h is not handle and h.state is not WorkerState.FAILED]
        if others:
            lost = self.resend_after_restart.pop(P.address(name, handle.replica), set())
            for job in list(self._jobs.live_jobs.values()):
                run = job.record.stages.get(name)
                if run is None or job.route(name) != handle.replica or not run.state.open:
                    continue
                self._dispatch.reroute(job, name)
                if job.id in lost:
                    self._ask(job, name)
            return
        for job in list(self._jobs.live_jobs.values()):
            if name in job.record.stages:
                msg = f"stage {name!r} has failed: {error}"
                self._jobs.finish(job, JobState.FAILED, JobError(ErrorCode.STAGE_FAILED, msg, name))
