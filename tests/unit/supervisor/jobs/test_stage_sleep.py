"""Sleeping stages as the scheduler tends them (omnid/supervisor/jobs/stage_sleep.py), in-process.

`SleepTender` knows its owner only as a `SleepControl` (control.py): here a stand-in with live jobs,
stand-in stage groups (what the tender reads of a `StageGroup`: its idle time, its state, its sleep
and wake) and a `finish` that records; the loop is a real one. No scheduler, no worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from omnid.config import PipelineConfig, StageConfig
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.supervisor.jobs.stage_sleep import SleepTender
from omnid.vocabulary import ErrorCode, JobError, JobRecord, JobState, StageRun, StageRunState, WorkerState


@dataclass
class Group:
    """What the tender reads of a StageGroup, and its sleep and wake recorded."""

    name: str
    idle_unload_s: float | None = 10.0
    idle: float = 0.0
    running: tuple[str, ...] = ()
    state: WorkerState = WorkerState.READY
    resting: bool = False
    sleeping: bool = False
    wakes_ok: bool = True
    replicas: list[Any] = field(default_factory=lambda: ["replica-0"])
    wake_s: float | None = None
    sleep_error: str | None = None
    last_error: str | None = None
    touched: int = 0
    slept: int = 0
    woken: int = 0

    @property
    def stage(self) -> StageConfig:
        return StageConfig(name=self.name, engine="python", idle_unload_s=self.idle_unload_s)

    def touch(self) -> None:
        self.touched += 1
        self.idle = 0.0

    def idle_for(self) -> float:
        return self.idle

    def doze(self) -> None:
        self.resting = True

    def dozed(self) -> None:
        pass

    async def sleep(self, grace: float) -> bool:
        self.slept += 1
        self.sleeping, self.state = True, WorkerState.STOPPED
        return True

    def wake_soon(self) -> asyncio.Task[bool]:
        async def wake() -> bool:
            self.woken += 1
            self.sleeping = self.resting = False
            if not self.wakes_ok:
                self.sleep_error = "no GPU"
            return self.wakes_ok
        return asyncio.get_running_loop().create_task(wake())


class Jobs:
    """The scheduler as `SleepControl`."""

    def __init__(self, groups: list[Group]) -> None:
        self.live_jobs: dict[str, LiveJob] = {}
        self.stages: dict[str, Any] = {g.name: g for g in groups}
        self.store: Any = Events()
        self.stopping: dict[tuple[str, str], object] = {}
        self.loop = asyncio.get_running_loop()
        self.config: Any = type("C", (), {"daemon": type("D", (), {"stop_grace_s": 1.0})()})()
        self.finished: list[tuple[str, JobState, dict[str, Any] | None]] = []

    def finish(self, job: LiveJob, state: JobState, error: JobError | None = None) -> None:
        self.live_jobs.pop(job.id, None)
        self.finished.append((job.id, state, error))


class Events:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append_event(self, job: str, seq: int, event: dict[str, Any]) -> None:
        self.events.append(event)


def live_job(jobs: Jobs, job_id: str, stages: tuple[str, ...]) -> LiveJob:
    record = JobRecord(id=job_id, pipeline="p", owner_uid=0, created_at=0.0, timeout_s=60.0, inputs={}, params={},
                       stages={s: StageRun() for s in stages})
    job = LiveJob(record, PipelineConfig("p", stages, ()), {}, jobs.store)
    jobs.live_jobs[job_id] = job
    return job


def run(test: Any) -> None:
    asyncio.run(test())


def test_a_stage_has_work_while_a_live_job_needs_it_or_a_stopped_job_still_runs_in_it() -> None:
    async def main() -> None:
        a, b, c, d = Group("a"), Group("b"), Group("c", running=("old",)), Group("d")
        jobs = Jobs([a, b, c, d])
        tender = SleepTender(jobs, lambda handle: None)     # type: ignore[arg-type]
        job = live_job(jobs, "j", ("a", "b"))
        job.record.stages["b"].state = StageRunState.SUCCEEDED
        jobs.stopping[("d.0", "gone")] = object()
        assert [tender.has_work(s) for s in "abcd"] == [True, False, True, True]
    run(main)


def test_an_idle_stage_sleeps_and_one_with_work_is_only_touched() -> None:
    async def main() -> None:
        idle, busy, never = Group("idle", idle=11.0), Group("busy", idle=11.0), Group("never", None, idle=99.0)
        jobs = Jobs([idle, busy, never])
        slept: list[Any] = []
        tender = SleepTender(jobs, slept.append)       # type: ignore[arg-type]
        live_job(jobs, "j", ("busy",))
        tender.tend()
        await asyncio.sleep(0.01)
        assert (idle.slept, busy.slept, never.slept) == (1, 0, 0)
        assert busy.touched == 1 and idle.sleeping and slept == ["replica-0"]   # its worker heard of
    run(main)


def test_a_job_wakes_its_sleeping_stage_and_fails_when_it_cannot_wake() -> None:
    async def main() -> None:
        good, bad = Group("good", resting=True, sleeping=True), Group("bad", resting=True, sleeping=True,
                                                                      wakes_ok=False)
        jobs = Jobs([good, bad])
        tender = SleepTender(jobs, lambda handle: None)     # type: ignore[arg-type]
        fine, doomed = live_job(jobs, "fine", ("good",)), live_job(jobs, "doomed", ("good", "bad"))
        tender.wake_for(fine)
        tender.wake_for(doomed)
        await asyncio.sleep(0.01)
        assert good.woken >= 1 and bad.woken == 1
        assert [(j, s) for j, s, _ in jobs.finished] == [("doomed", JobState.FAILED)]
        error = jobs.finished[0][2]
        assert error is not None
        assert error == JobError(ErrorCode.WAKE_FAILED, error.message, "bad") and "no GPU" in error.message
        assert "fine" in jobs.live_jobs
    run(main)


def test_stage_awake_comes_before_stage_started_even_when_the_input_is_taken_before_the_wake_ends() -> None:
    """The woken worker takes the input that waited at its address as soon as it listens, so its
    `Started` can reach the scheduler before the wake's task has ended here: `stage_awake` goes first,
    once."""
    async def main() -> None:
        group = Group("z", resting=True, sleeping=True)
        jobs = Jobs([group])
        tender = SleepTender(jobs, lambda handle: None)     # type: ignore[arg-type]
        early, late = live_job(jobs, "early", ("z",)), live_job(jobs, "late", ("z",))
        tender.wake_for(early)
        tender.wake_for(late)
        tender.started(early, "z")          # (what Scheduler.on_started calls before its stage_started)
        assert [e["type"] for e in jobs.store.events if e["job"] == "early"][-1] == "stage_awake"
        assert group.woken == 0             # (said before the wake's task even ran)
        await asyncio.sleep(0.01)           # the wake's task ends
        tender.started(late, "z")
        kinds = [(e["job"], e["type"]) for e in jobs.store.events if e["type"].startswith("stage_")]
        assert [k for k in kinds if k[0] == "early"] == [("early", "stage_waking"), ("early", "stage_awake")]
        assert [k for k in kinds if k[0] == "late"] == [("late", "stage_waking"), ("late", "stage_awake")]
    run(main)
