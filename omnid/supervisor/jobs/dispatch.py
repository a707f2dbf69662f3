"""Where a job's work goes: its replica of each stage, and its own inputs to its first stages.

Runs in the supervisor's event-loop thread, as the scheduler's part (scheduler.py). Nothing here
blocks: the inputs go to the `Feeder` threads (feeder.py), one per replica of a first stage, which
block on the stages' watermarks instead of the loop.

A job is given one replica of each of its stages when it is admitted (`route`: the least loaded,
`StageGroup.pick`), and keeps it; only a replica given up for good moves its jobs (`reroute`),
and upstream workers and the feeder send there from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from omnid import protocol as P
from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem
from omnid.supervisor.jobs.feeder import Feeder
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.supervisor.live import Live
from omnid.supervisor.workers.stage_group import StageGroup

log = structlog.get_logger("omnid.scheduler")


class Dispatch:
    """The live jobs' routes (replica per stage) and the feeders of their inputs."""

    def __init__(self, live: Live, jobs: dict[str, LiveJob], stages: Mapping[str, StageGroup],
                 data_socket: Callable[[str], Path]) -> None:
        self._live = live
        self._jobs = jobs                   # the scheduler's live jobs (its own dict)
        self._stages = stages
        self._data_socket = data_socket
        self.feeders: dict[str, Feeder] = {}    # worker address -> its feeder (first stages only)

    # ------------------------------------------------------------------ replicas

    def assigned(self, stage: str) -> list[int]:
        """Per replica of `stage`: the live jobs given to it and not done there (queued in it,
        running in it, or on their way to it from upstream)."""
        group = self._stages[stage]
        counts = [0] * len(group.replicas)
        for job in self._jobs.values():
            run = job.record.stages.get(stage)
            if run is not None and run.state.open and (run.replica or 0) < len(counts):
                counts[run.replica or 0] += 1
        return counts

    def route(self, job: LiveJob) -> None:
        """Give the job one replica of each of its stages, the least loaded (`StageGroup.pick`)."""
        for name, run in job.record.stages.items():
            group = self._stages.get(name)
            if group is not None:
                run.replica = group.pick(self.assigned(name)) if len(group.replicas) > 1 else 0

    def reroute(self, job: LiveJob, stage: str) -> int:
        """The job's replica of `stage` is down for good: give it another; upstream workers and the
        feeder send there from now on. Returns the new replica."""
        group = self._stages[stage]
        run = job.stage(stage)
        run.replica = None                  # not counted where it was
        new = group.pick(self.assigned(stage))
        run.replica = new
        for edge in job.pipeline.incoming(stage):
            if (up := self._stages.get(edge.src)) is not None:
                up.send(P.Reroute(job.id, stage, new))
        log.info("job moved to another replica", job=job.id, stage=stage, replica=new)
        return new

    # ------------------------------------------------------------------ the jobs' own inputs

    def feed(self, jobs: list[LiveJob], stage: str, front: bool = False) -> None:
        """Send jobs' own inputs to one of their pipelines' first stages (each to its replica there);
        each feeder sends them in their rank's order (omnid/fair_queue.py)."""
        by_replica: dict[int, list[WorkItem]] = {}
        for job in jobs:
            since = job.since.setdefault(stage, time.time())     # a resend keeps its place (and its wait)
            by_replica.setdefault(job.route(stage), []).append(
                WorkItem(job=job.id, pipeline=job.key, src=None, inputs=job.inputs, params=job.record.params,
                         routes=job.routes, rank=job.rank, since=since,
                         trace=job.trace.headers if job.trace is not None else None))
        for replica, items in by_replica.items():
            self._feeder(stage, replica).push(items, front=front)

    def _feeder(self, stage: str, replica: int) -> Feeder:
        address = P.address(stage, replica)
        feeder = self.feeders.get(address)
        if feeder is None:
            feeder = self.feeders[address] = Feeder(
                address, Sender(self._data_socket, self._live.config.daemon.shm_min_bytes), self.is_live,
                lambda job: self._address(job, stage), lambda: self._live.config.daemon.max_wait_s)
        return feeder

    def is_live(self, job_id: str) -> bool:
        return job_id in self._jobs

    def _address(self, job_id: str, stage: str) -> str:
        """Where a job's input for `stage` goes now (its replica may change while a feeder waits)."""
        job = self._jobs.get(job_id)
        return P.address(stage, job.route(stage) if job is not None else 0)

    def stop(self) -> None:
        for f in self.feeders.values():
            f.stop()
