"""Jobs: admission, their way through a pipeline's stages, and their end.

Runs in the supervisor's event-loop thread; nothing here blocks (store writes are short sqlite
transactions; control messages to workers are non-blocking sends; the jobs' inputs go to the
`Feeder` threads, which block on the first stages' watermarks instead of the loop).

The scheduler never touches payloads between stages: workers hand them to each other over the
data plane. It follows each job through the workers' messages, one handler per message type
(`_HANDLERS`: `on_admitted`, `on_started`, ...), and owns the decisions: a job's admission and its
state. A job's end (its deadline, a cancel with a grace period after which a worker that ignores it
is killed and restarted, the terminal state, and cleaning every worker's per-job state with
`Forget`) is `Ending`'s (ending.py). What happens when a worker dies is `Recovery`'s (recovery.py);
which replica serves a job, and the feeding of its own inputs, `Dispatch`'s (dispatch.py); idle
stages' sleep and wake, `SleepTender`'s (stage_sleep.py); the jobs a previous daemon left,
`take_back`'s (restore.py). Those parts know the scheduler only by what they declare of it
(control.py). The config in force is `Live`'s (live.py).

To add a worker message: define it in `omnid.protocol`, write `on_<message>` here, and list it in
`_HANDLERS`. To add a job state: `omnid.vocabulary.JobState`.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from typing_extensions import TypedDict

from omnid import protocol as P
from omnid.config import Config
from omnid.fair_queue import FairShare, positions
from omnid.store import JobStore, StoreWriteFailed, Unfinished
from omnid.supervisor.errors import STORAGE_RETRY_AFTER_S, Refused
from omnid.supervisor.jobs.dispatch import Dispatch
from omnid.supervisor.jobs.ending import Ending, exemplar
from omnid.supervisor.jobs.live_job import EventQueue, LiveJob
from omnid.supervisor.jobs.recovery import Recovery
from omnid.supervisor.jobs.restore import take_back
from omnid.supervisor.jobs.stage_sleep import SleepTender
from omnid.supervisor.jobs.streams import Gate, StreamPlace
from omnid.supervisor.jobs.submission import Submission
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics
from omnid.supervisor.workers.stage import StageHandle
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import (
    ErrorCode,
    Event,
    EventFields,
    EventType,
    JobError,
    JobOutput,
    JobRecord,
    JobState,
    StageRun,
    StageRunState,
    WorkerState,
)

if TYPE_CHECKING:
    from omnid.tracing import Tracing

log = structlog.get_logger("omnid.scheduler")


TICK_S = 1.0            # how often the real-time pipelines are tended (streams.py)
PLACES_TTL_S = 0.2      # how old the snapshot of a stage's order that `queue_places` reads may be


class QueuePlace(TypedDict):
    """a queued job's place in one stage's queue that holds it (or whose feeder does): `position` 1 is
    next; `ahead` of it, and by priority; `running` there now; its own `priority`"""

    position: int
    ahead: int
    ahead_by_priority: dict[str, int]
    running: int
    priority: int


@dataclass
class _Order:
    """A stage's waiting jobs in the order it takes them, at `at` (monotonic)."""

    at: float
    index: dict[str, int]                   # job -> its index (0: next)
    by_priority: dict[int, list[int]]       # priority -> the indices of the jobs of it, ascending
    running: int


def new_job_id() -> str:
    return secrets.token_hex(6)


class Scheduler:
    """Owns the live jobs; the `StageListener` of every stage handle. Its parts: `dispatch` (each
    job's replicas, and its inputs to the first stages: dispatch.py), `sleeper` (idle stages to sleep,
    and woken for their jobs: stage_sleep.py), `recovery` (dead workers: recovery.py), `ending`
    (deadlines, cancels, a job's end: ending.py)."""

    def __init__(self, live: Live, store: JobStore, stages: Mapping[str, StageGroup],
                 data_socket: Callable[[str], Path], metrics: Metrics | None = None,
                 tracing: Tracing | None = None) -> None:
        self.in_force = live                # the config in force (a reload switches it)
        self.tracing = tracing              # `[daemon] tracing`: each new job's spans (jobs/tracing.py)
        self.store = store
        self.stages = stages
        self.metrics = metrics
        self.live_jobs: dict[str, LiveJob] = {}
        self._unarmed: list[LiveJob] = []       # restored jobs whose timers wait for the stages
        self.fair = FairShare()             # each job's place in the queues (omnid/fair_queue.py)
        self._orders: dict[str, _Order] = {}    # per stage: its waiting jobs' order, a short-lived snapshot
        self.dispatch = Dispatch(self.in_force, self.live_jobs, stages, data_socket)
        self.recovery = Recovery(self, self.dispatch)
        self.loop = asyncio.get_running_loop()
        self.ending = Ending(self, self._forget)
        self.sleeper = SleepTender(self, self.recovery.worker_slept)
        # real-time pipelines: admission by their measured capacity, and their warm-up (streams.py)
        self.gate = Gate(stages, self._start, self._warm_up, self._plays_until)
        self._gated: Config | None = None       # the config the gate was last given
        self._configure_gate()
        self._tick: asyncio.TimerHandle | None = self.loop.call_later(TICK_S, self._tend_streams)
        for group in stages.values():
            group.attach(self)

    @property
    def config(self) -> Config:
        """The config in force: new jobs use its pipelines; live jobs keep the definition they started with."""
        return self.in_force.config

    def is_live(self, job_id: str) -> bool:
        return job_id in self.live_jobs

    def job(self, job_id: str) -> JobRecord | None:
        """A job's record: the live one, else the stored one."""
        live = self.live_jobs.get(job_id)
        return live.record if live is not None else self.store.get(job_id)

    # ------------------------------------------------------------------ admission

    def submit(self, sub: Submission, warm_up: bool = False) -> JobRecord:
        """Make a job of an admitted request, on the pipeline admission resolved (`Submission`);
        refused while a stage of it has failed for good, or its pipeline's queue is full."""
        pipeline, pipeline_name = sub.pipeline, sub.pipeline.name
        for name in pipeline.stages:
            h = self.stages[name]
            if h.state is WorkerState.FAILED:
                raise Refused(503, ErrorCode.STAGE_FAILED, f"stage {name!r} of pipeline {pipeline_name!r} has "
                              f"failed and is not restarted: {h.last_error}. Fix the cause, then restart it "
                              f"(omnictl stage restart {name}, or systemctl restart omnid)", stage=name)
        queued = sum(1 for j in self.live_jobs.values()
                     if j.pipeline.name == pipeline_name and j.record.state is JobState.QUEUED)
        limit = self.config.daemon.max_queued_jobs
        if queued >= limit:
            raise Refused(429, ErrorCode.QUEUE_FULL, f"pipeline {pipeline_name!r} already has {queued} queued "
                          f"jobs (max_queued_jobs = {limit}); try again later", queued=queued)
        if sub.max_queued is not None:
            mine = sum(1 for j in self.live_jobs.values() if j.record.state is JobState.QUEUED
                       and j.record.owner_uid == sub.owner_uid and j.record.key == sub.key)
            if mine >= sub.max_queued:
                raise Refused(429, ErrorCode.OWNER_QUEUE_FULL, f"{sub.owner.replace(':', ' ', 1)} has {mine} queued "
                              f"jobs already (daemon.owners max_queued = {sub.max_queued}); try again once some "
                              f"have started", queued=mine)
        if not warm_up:
            self._configure_gate()
            self.gate.check(pipeline)          # a stream that cannot start now and may not wait: 503
        timeout = sub.timeout_s or pipeline.timeout_s or self.config.daemon.default_timeout_s
        record = JobRecord(id=new_job_id(), pipeline=pipeline_name, owner_uid=sub.owner_uid, created_at=time.time(),
                           timeout_s=timeout, inputs=sub.summary, params=sub.params,
                           stages={s: StageRun() for s in pipeline.stages}, priority=sub.priority, key=sub.key)
        job = LiveJob(record, pipeline, sub.inputs, self.store)     # (its key: the pipeline's own)
        job.rank = self.fair.rank(sub.priority, sub.owner, sub.weight, self.config.daemon.fair_share)
        self.dispatch.route(job)
        self.live_jobs[job.id] = job
        self.store.save(record)
        self.store.keep_inputs(job.id, sub.inputs)
        if self.tracing is not None:
            from omnid.supervisor.jobs.tracing import JobTrace
            job.trace = JobTrace(self.tracing, record, sub.trace, sub.received_at)
            job.events.observer = job.trace.on_event
            job.events.emit(EventType.STATE, state=JobState.QUEUED, trace_id=job.trace.trace_id)
        else:
            job.events.emit(EventType.STATE, state=JobState.QUEUED)
        try:
            self.store.commit()         # accepted once it is on disk: a 201 promises it (a full disk: not)
        except StoreWriteFailed as e:
            del self.live_jobs[job.id]  # withdrawn before anything ran it: nobody saw it
            self.store.discard(job.id)
            raise Refused(507, ErrorCode.INSUFFICIENT_STORAGE, f"the job could not be written to disk, so it was "
                          f"not accepted: {e}", retry_after_s=STORAGE_RETRY_AFTER_S) from None
        self.ending.arm(job)
        if self.metrics:
            self.metrics.job_submitted(pipeline_name)
        if self.gate.admit(job, warm_up):      # (else it waits for a real-time pipeline's capacity)
            self._start(job)
        return record

    def _start(self, job: LiveJob) -> None:
        """A job's first stages get its inputs (and the sleeping stages it needs wake)."""
        self.sleeper.wake_for(job)
        for src in job.pipeline.sources:
            self.dispatch.feed([job], src)

    # ------------------------------------------------------------------ real-time pipelines (streams.py)

    def _configure_gate(self) -> None:
        config = self.config
        if config is not self._gated:
            self._gated = config
            self.gate.configure(config.pipelines, frozenset(n for n, st in config.stages.items() if not st.devices))

    def _tend_streams(self) -> None:
        """Once a second: the real-time pipelines' capacity sampled, waiting streams started, warm-ups run."""
        self._tick = self.loop.call_later(TICK_S, self._tend_streams)
        self._configure_gate()
        try:
            self.gate.tick()
        except Exception:                       # (a bug here must not stop the timer)
            log.exception("tending the real-time pipelines failed")

    def _warm_up(self, name: str) -> None:
        """A real-time pipeline's warm-up job: its `realtime.warmup` inputs, through every stage."""
        pipeline = self.config.pipelines[name]
        rt = pipeline.realtime
        assert rt is not None and rt.warmup is not None
        inputs = dict(rt.warmup)
        record = self.submit(Submission(pipeline=pipeline, inputs=inputs, summary=dict(inputs),
                                        params={k: dict(v) for k, v in rt.warmup_params.items()},
                                        owner_uid=os.getuid()), warm_up=True)
        log.info("warming up a real-time pipeline", pipeline=name, job=record.id)

    def _forget(self, job_id: str) -> None:
        """A job ended: the workers' and the gate's accounts of it go."""
        self.recovery.forget(job_id)
        self.gate.ended(job_id)

    def _plays_until(self, job_id: str) -> float | None:
        """When a live job's listener runs out of the audio sent so far (wall clock); None before its first."""
        job = self.live_jobs.get(job_id)
        return job.audio_plays_until if job is not None and job.first_audio is not None else None

    def streams(self, job_id: str) -> StreamPlace | None:
        """A live job's stream: its place and estimated start while it waits for capacity, or its
        listener's clock once it plays (audio sent, slack: seconds of audio its listener holds)."""
        wait = self.gate.waiting(job_id)
        if wait is not None:
            return wait
        job = self.live_jobs.get(job_id)
        if job is None or job.first_audio is None:
            return None
        return {"audio_s": round(job.audio_s, 3), "slack_s": round(job.audio_plays_until - time.time(), 3),
                "late_packets": job.underruns}

    def rank(self, job: LiveJob) -> None:
        """A restored job's place in the queues: its priority, and a fair-share tag by its owner's
        weight in the config in force (restore gives them oldest first)."""
        record = job.record
        weight, _top, _queued = self.config.daemon.owner_policy(record.owner_uid, record.key, record.key is None)
        owner = f"key:{record.key}" if record.key else f"uid:{record.owner_uid}"
        job.rank = self.fair.rank(record.priority, owner, weight, self.config.daemon.fair_share)

    def queue_places(self, job_id: str) -> dict[str, QueuePlace]:
        """Where a live job waits: per stage whose queue holds it (or whose feeder does), its place
        (1: next), how many wait ahead of it (by priority) and how many that stage is running now.
        The order is the queues' own (omnid/fair_queue.py: rank, then the bound on waiting), as
        of a snapshot at most PLACES_TTL_S old (a stage's order is sorted once per snapshot, not per
        request: GET /v1/jobs/{id} stays cheap with thousands queued)."""
        job = self.live_jobs.get(job_id)
        if job is None or all(r.state not in (StageRunState.PENDING, StageRunState.QUEUED)
                              for r in job.record.stages.values()):
            return {}
        places: dict[str, QueuePlace] = {}
        for stage in job.pipeline.stages:
            if not self._waits_at(job, stage):
                continue
            snap = self._stage_order(stage)
            index = snap.index.get(job_id)
            if index is None:                   # came after the snapshot: behind everything in it
                index = len(snap.index)
            by_priority = {str(p): n for p, at in snap.by_priority.items() if (n := bisect.bisect_left(at, index))}
            places[stage] = {"position": index + 1, "ahead": index, "ahead_by_priority": by_priority,
                             "running": snap.running, "priority": job.record.priority}
        return places

    def _stage_order(self, stage: str) -> _Order:
        now = time.monotonic()
        snap = self._orders.get(stage)
        if snap is not None and now - snap.at < PLACES_TTL_S:
            return snap
        wall, max_wait = time.time(), self.config.daemon.max_wait_s
        waiting = [j for j in self.live_jobs.values() if stage in j.record.stages and self._waits_at(j, stage)]
        order = positions([(j.id, j.rank, j.since.get(stage, j.record.created_at)) for j in waiting], wall, max_wait)
        by_priority: dict[int, list[int]] = {}
        for i, jid in enumerate(order):
            by_priority.setdefault(self.live_jobs[jid].record.priority, []).append(i)
        running = sum(1 for j in self.live_jobs.values() if stage in j.record.stages
                      and j.stage(stage).state is StageRunState.RUNNING)
        snap = self._orders[stage] = _Order(now, {jid: i for i, jid in enumerate(order)}, by_priority, running)
        return snap

    @staticmethod
    def _waits_at(job: LiveJob, stage: str) -> bool:
        """The job waits in the stage's queue (admitted there), or in its feeder (a first stage)."""
        state = job.stage(stage).state
        return state is StageRunState.QUEUED or (state is StageRunState.PENDING and stage in job.pipeline.sources)

    # ------------------------------------------------------------------ sleeping stages (stage_sleep.py)

    def has_work(self, stage: str) -> bool:
        return self.sleeper.has_work(stage)

    def tend_sleep(self) -> None:
        self.sleeper.tend()

    def put_to_sleep(self, group: StageGroup) -> None:
        self.sleeper.put_to_sleep(group)

    # ------------------------------------------------------------------ a restart

    def restore(self, unfinished: list[Unfinished]) -> None:
        """Take back the jobs a previous daemon accepted and did not finish (restore.py)."""
        self._unarmed.extend(take_back(self, self.dispatch, self.config.pipelines, unfinished))   # their timers start once the stages are up

    def arm_restored(self) -> None:
        """The stages are up: restored jobs' timeouts start now (loading models is not their time)."""
        for job in self._unarmed:
            if job.id in self.live_jobs and job.timer is None:
                self.ending.arm(job)
        self._unarmed = []

    # ------------------------------------------------------------------ events to clients

    def subscribe(self, job_id: str, after: int = 0) -> tuple[list[Event], EventQueue | None]:
        """Past events (those after the first `after`), and a queue of the events to come (None if
        the job is over).

        The past is read and the queue registered in one step of the loop: nothing is missed or sent twice.
        """
        past = self.store.events(job_id, after)
        job = self.live_jobs.get(job_id)
        return past, (job.events.subscribe() if job is not None else None)

    def unsubscribe(self, job_id: str, q: EventQueue) -> None:
        job = self.live_jobs.get(job_id)
        if job is not None:
            job.events.unsubscribe(q)

    # ------------------------------------------------------------------ the stage handles' listener

    def on_message(self, handle: StageHandle, msg: object) -> None:
        """A stage worker said something: dispatch it to its handler."""
        if isinstance(msg, P.Ready):        # (re)started: ask for what its predecessor lost
            self.recovery.worker_back(handle)
            self.gate.stage_restarted(handle.name)     # (a real-time pipeline warms up again)
            return
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            return                          # Heartbeat, LoadFailed: the handle's own business
        job_id: str = getattr(msg, "job")
        address = P.address(handle.name, handle.replica)
        if isinstance(msg, (P.Stopped, P.Failed, P.Finished)):
            self.ending.stopped(address, job_id)
        job = self.live_jobs.get(job_id)
        if job is None or handle.name not in job.record.stages or job.route(handle.name) != handle.replica:
            return                          # a late word about a job that is over (or moved): nothing to do
        handler(self, job, handle.name, msg)

    def on_exit(self, handle: StageHandle, reason: str) -> None:
        """A stage worker died (it will be restarted)."""
        # (first: the streams waiting for its real-time pipelines wait for the warm-up of the next
        # worker, not start into this one's restart as its streams fail and free their slots)
        self.gate.stage_restarted(handle.name)
        self.ending.worker_gone(P.address(handle.name, handle.replica))
        self.recovery.worker_died(handle, reason)

    def on_failed(self, handle: StageHandle, error: str) -> None:
        """A replica was given up for good (the stage, when it was the last one serving)."""
        self.recovery.stage_failed(handle, error)

    # ------------------------------------------------------------------ one handler per job message

    def on_admitted(self, job: LiveJob, stage: str, msg: P.Admitted) -> None:
        streamed = any(e.src == msg.src and e.window > 0 for e in job.pipeline.incoming(stage))
        if streamed:
            job.streamed = True             # its first window is there: it cannot be re-sent
        now = time.time()
        job.admitted_at.setdefault(stage, now)
        if msg.src is not None and self.metrics:
            # The hand-off: from the upstream's output being there (its first segment on a streaming
            # edge, its end otherwise) to this stage admitting it (watermark waits included).
            src_run = job.record.stages.get(msg.src)
            ready = job.first_segment_at.get(msg.src) if streamed else (src_run.finished_at if src_run else None)
            if ready is not None:
                self.metrics.handoff(msg.src, stage, max(0.0, now - ready), exemplar(job))
        run = job.stage(stage)
        if run.state in (StageRunState.PENDING, StageRunState.QUEUED):
            run.set_state(StageRunState.QUEUED, time.time())
            job.since.setdefault(stage, time.time())

    def on_started(self, job: LiveJob, stage: str, msg: P.Started) -> None:
        now = time.time()
        self.fair.started(job.rank)
        job.stage(stage).set_state(StageRunState.RUNNING, now)
        admitted = job.admitted_at.get(stage)
        if admitted is not None and self.metrics:
            self.metrics.stage_queue_wait(stage, max(0.0, now - admitted), exemplar(job))
        self.sleeper.started(job, stage)
        job.events.emit(EventType.STAGE_STARTED, stage=stage)
        if job.record.state is JobState.QUEUED:
            if self.metrics:
                self.metrics.job_started(job.pipeline.name, now - job.record.created_at, exemplar(job))
            job.record.set_state(JobState.RUNNING, now)
            job.events.emit(EventType.STATE, state=JobState.RUNNING)
            self.store.save(job.record)
            # committed before anyone hears it: a job a client saw running is running on disk, so a
            # daemon killed now fails it as interrupted on its next start (not a silent re-run)
            self.store.flush()

    def on_progress(self, job: LiveJob, stage: str, msg: P.Progress) -> None:
        job.stage(stage).progress = {"done": msg.done, "total": msg.total}
        job.events.emit(EventType.PROGRESS, stage=stage, done=msg.done, total=msg.total)

    def on_segment(self, job: LiveJob, stage: str, msg: P.Segment) -> None:
        job.first_segment_at.setdefault(stage, time.time())
        job.stage(stage).segments += msg.count
        if self.metrics:
            self.metrics.segments_streamed(stage, msg.count)
        if job.first_output_segment is None and stage in job.pipeline.sinks:
            job.first_output_segment = time.time()
            if self.metrics:
                self.metrics.first_segment(job.pipeline.name, job.first_output_segment - job.record.created_at,
                                           exemplar(job))
        fields: EventFields = {"stage": stage, "index": msg.index, "is_last": msg.is_last}
        if msg.text is not None:
            fields["text"] = msg.text
        if msg.finish_reason is not None:
            fields["finish_reason"] = msg.finish_reason
        if msg.audio_s and stage in job.pipeline.sinks:
            fields["audio_s"] = round(msg.audio_s, 4)
            self._heard(job, msg.audio_s)
        job.events.emit(EventType.SEGMENT, **fields)

    def _heard(self, job: LiveJob, seconds: float) -> None:
        """A packet of the job's audio reached the supervisor (on its way to a client, who plays it
        from the first packet on): time to first audio, and an underrun if the audio before it has
        finished playing already."""
        now = time.time()
        if job.first_audio is None:
            job.first_audio = now
            job.audio_plays_until = now
            if self.metrics:
                self.metrics.first_audio(job.pipeline.name, now - job.record.created_at)
        elif now > job.audio_plays_until:
            job.underruns += 1
            if self.metrics:
                self.metrics.audio_underrun(job.pipeline.name)
        else:
            if self.metrics:
                self.metrics.stream_slack(job.pipeline.name, job.audio_plays_until - now)
        job.audio_plays_until = max(job.audio_plays_until, now) + seconds
        job.audio_s += seconds
        self.gate.heard(job.pipeline.stages, seconds)
        # the listener's clock, to every stage of the job: who runs dry first is stepped first
        deadline = P.Deadline(job.id, job.audio_plays_until)
        for name in job.pipeline.stages:
            group = self.stages.get(name)
            if group is not None and job.route(name) < len(group.replicas):
                group.replicas[job.route(name)].send(deadline)

    def on_output(self, job: LiveJob, stage: str, msg: P.Output) -> None:
        out: JobOutput = {"name": msg.name, "file": msg.file, "kind": msg.kind, "content_type": msg.content_type,
                          "size": msg.size, "stage": stage}
        job.record.outputs.append(out)
        job.events.emit(EventType.OUTPUT, **out)

    def on_finished(self, job: LiveJob, stage: str, msg: P.Finished) -> None:
        run = job.stage(stage)
        run.set_state(StageRunState.SUCCEEDED, time.time())
        run.elapsed_s = round(msg.elapsed_s, 4)
        if self.metrics:
            self.metrics.stage_finished(stage, msg.elapsed_s)
        said: EventFields = {"stage": stage, "elapsed_s": run.elapsed_s}
        if msg.usage:
            said["usage"] = dict(msg.usage)
        if msg.finish_reason:
            said["finish_reason"] = msg.finish_reason
        job.events.emit(EventType.STAGE_FINISHED, **said)
        self.store.save(job.record)
        # Every stage, not only the sinks: workers report on separate pipes, so a sink's
        # Finished may be read before an upstream's (fan-in), which must not be left "running".
        if all(run.state is StageRunState.SUCCEEDED for run in job.record.stages.values()):
            self.finish(job, JobState.SUCCEEDED)

    def on_delivered(self, job: LiveJob, stage: str, msg: P.Delivered) -> None:
        job.delivered.add((stage, msg.dst))

    def on_resend_missing(self, job: LiveJob, stage: str, msg: P.ResendMissing) -> None:
        self.recovery.rerun(job, stage)

    def on_failed_job(self, job: LiveJob, stage: str, msg: P.Failed) -> None:
        job.stage(stage).set_state(StageRunState.FAILED, time.time())
        code = ErrorCode(msg.code)
        job.events.emit(EventType.ERROR, stage=stage, code=code, message=msg.error)
        self.finish(job, JobState.FAILED, JobError(code, f"stage {stage!r}: {msg.error}", stage))

    def on_stopped(self, job: LiveJob, stage: str, msg: P.Stopped) -> None:
        # Only a job that already ended gets here when it was cancelled (it is not live any more).
        # A live one was stopped by its stage on its own (a function that raised Cancelled): it
        # cannot go on without that stage's outputs.
        job.stage(stage).set_state(StageRunState.CANCELLED, time.time())
        self.finish(job, JobState.FAILED, JobError(ErrorCode.STAGE_FAILED, f"stage {stage!r} stopped the job "
                                                   "without a cancel", stage))

    # ------------------------------------------------------------------ ending jobs (ending.py)

    def finish(self, job: LiveJob, state: JobState, error: JobError | None = None) -> None:
        """Move a live job to a terminal state (once), stop its work, clean every worker."""
        self.ending.finish(job, state, error)

    def cancel(self, job_id: str, reason: JobState = JobState.CANCELLED) -> JobRecord | None:
        """Cancel a live job (idempotent); None when it is not live. `reason`: CANCELLED or TIMED_OUT."""
        return self.ending.cancel(job_id, reason)

    @property
    def stopping(self) -> Mapping[tuple[str, str], asyncio.TimerHandle]:
        """(worker address, job) of each cancelled job whose stage has not stopped it yet: its grace kill."""
        return self.ending.stopping

    # ------------------------------------------------------------------ shutdown

    def drain(self) -> int:
        """SIGTERM: set the queued jobs aside for the next start; the running ones go on.

        A queued job's stages are told to drop it (as for a cancel), but its record stays `queued`
        and its inputs stay stored: the next daemon runs it, in its place in line. Returns how many
        jobs were set aside.
        """
        parked = [job for job in self.live_jobs.values() if job.record.state is JobState.QUEUED]
        for job in parked:
            del self.live_jobs[job.id]
            if job.timer is not None:
                job.timer.cancel()
            for name in job.pipeline.stages:
                if (h := self.stages.get(name)) is not None:
                    h.send(P.Cancel(job.id, reason="drain"))
                    h.send(P.Forget(job.id))
            self.recovery.forget(job.id)
            job.events.close()
        self.store.flush()
        return len(parked)

    def running(self) -> int:
        return sum(1 for job in self.live_jobs.values() if job.record.state is JobState.RUNNING)

    def shutdown(self) -> None:
        """The daemon stops: what is still live stays in the store as it is (queued or running),
        for the next start (`restore`); nothing accepted is failed for the stop."""
        for job in self.live_jobs.values():
            if job.timer is not None:
                job.timer.cancel()
            if job.trace is not None:
                job.trace.abandon()
            job.events.close()
        if self._tick is not None:
            self._tick.cancel()
        self.store.flush()
        self.dispatch.stop()
        self.sleeper.stop()


# A worker's per-job message -> its handler, called with the live job and the stage's name.
# Ready names no job (`on_message` handles it); Heartbeat and LoadFailed are the stage handle's.
_HANDLERS: dict[type, Callable[[Scheduler, LiveJob, str, Any], None]] = {
    P.Admitted: Scheduler.on_admitted,
    P.Started: Scheduler.on_started,
    P.Progress: Scheduler.on_progress,
    P.Segment: Scheduler.on_segment,
    P.Output: Scheduler.on_output,
    P.Finished: Scheduler.on_finished,
    P.Delivered: Scheduler.on_delivered,
    P.ResendMissing: Scheduler.on_resend_missing,
    P.Failed: Scheduler.on_failed_job,
    P.Stopped: Scheduler.on_stopped,
}
