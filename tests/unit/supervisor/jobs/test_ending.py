"""A job's end as the scheduler's `Ending` makes it (omnid/supervisor/jobs/ending.py), in-process.

`Ending` knows its owner only as an `EndControl` (control.py): here a stand-in with live jobs,
stand-in stages that record what they are sent and killed with, a store that records, and a real
loop (the deadline and the grace kill are its timers). No scheduler, no worker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from omnid import protocol as P
from omnid.config import PipelineConfig
from omnid.supervisor.jobs.ending import Ending
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.vocabulary import ErrorCode, JobError, JobRecord, JobState, StageRun, StageRunState


class Stage:
    """What ending reads of a StageGroup: `send`, its replicas' `running`, and their `kill`."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.running: tuple[str, ...] = ()
        self.kills: list[tuple[str, bool]] = []

    def send(self, msg: object) -> bool:
        self.sent.append(msg)
        return True

    def replica(self, index: int) -> Stage:
        return self

    def kill(self, reason: str, counts: bool = True) -> None:
        self.kills.append((reason, counts))


class Store:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.events: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.dropped: list[str] = []
        self.flushed_at: list[int] = []         # how many events were there at each flush

    def flush(self) -> bool:
        self.flushed_at.append(len(self.events))
        return True

    def append_event(self, job: str, seq: int, event: dict[str, Any]) -> None:
        self.events.append(event)

    def save(self, record: JobRecord) -> None:
        self.saved.append(record.state.value)

    def drop_inputs(self, job_id: str) -> None:
        self.dropped.append(job_id)

    def job_dir(self, job_id: str) -> Path:
        return self.folder / job_id


class Jobs:
    """The scheduler as `EndControl`."""

    def __init__(self, folder: Path, grace: float = 0.05) -> None:
        self.live_jobs: dict[str, LiveJob] = {}
        self.stages: dict[str, Any] = {"a": Stage(), "b": Stage()}
        self.store: Any = Store(folder)
        self.metrics = None
        self.loop = asyncio.get_running_loop()
        self.config: Any = type("C", (), {"daemon": type("D", (), {"cancel_grace_s": grace})()})()


def live_job(jobs: Jobs, job_id: str, timeout_s: float = 60.0) -> LiveJob:
    record = JobRecord(id=job_id, pipeline="p", owner_uid=0, created_at=0.0, timeout_s=timeout_s, inputs={},
                       params={}, stages={s: StageRun() for s in ("a", "b")})
    job = LiveJob(record, PipelineConfig("p", ("a", "b"), ()), {}, jobs.store)
    jobs.live_jobs[job_id] = job
    return job


def test_a_job_ends_once_and_every_stage_is_told_to_drop_it(tmp_path: Path) -> None:
    async def main() -> None:
        jobs, forgotten = Jobs(tmp_path), []
        ending = Ending(jobs, forgotten.append)     # type: ignore[arg-type]
        job = live_job(jobs, "j")
        job.record.stages["a"].set_state(StageRunState.RUNNING, 1.0)
        ending.finish(job, JobState.FAILED, JobError(ErrorCode.STAGE_FAILED, "boom"))
        ending.finish(job, JobState.SUCCEEDED)      # once only
        assert job.record.state is JobState.FAILED and "j" not in jobs.live_jobs
        assert {n: r.state for n, r in job.record.stages.items()} == {"a": StageRunState.CANCELLED,
                                                                      "b": StageRunState.CANCELLED}
        for stage in jobs.stages.values():
            assert [type(m) for m in stage.sent] == [P.Cancel, P.Forget]
        assert forgotten == ["j"] and jobs.store.dropped == ["j"]
        assert jobs.store.flushed_at == [len(jobs.store.events)]   # committed with its end, before a reader hears it
        assert jobs.store.events[-1] == {**jobs.store.events[-1], "type": "state", "state": "failed",
                                         "error": {"code": "stage_failed", "message": "boom", "stage": None}}
        assert set(ending.stopping) == {(P.address("a", 0), "j")}      # it was running in a
        ending.stopped(P.address("a", 0), "j")
        assert ending.stopping == {}
    asyncio.run(main())


def test_a_succeeded_job_gets_its_manifest_and_no_cancel(tmp_path: Path) -> None:
    async def main() -> None:
        jobs = Jobs(tmp_path)
        ending = Ending(jobs, lambda job_id: None)  # type: ignore[arg-type]
        job = live_job(jobs, "ok")
        ending.finish(job, JobState.SUCCEEDED)
        assert (tmp_path / "ok" / "manifest.json").exists()
        assert [type(m) for m in jobs.stages["a"].sent] == [P.Forget] and ending.stopping == {}
    asyncio.run(main())


def test_a_worker_that_ignores_its_cancel_is_killed_after_the_grace(tmp_path: Path) -> None:
    async def main() -> None:
        jobs = Jobs(tmp_path, grace=0.05)
        ending = Ending(jobs, lambda job_id: None)  # type: ignore[arg-type]
        job = live_job(jobs, "j")
        job.record.stages["a"].set_state(StageRunState.QUEUED, 1.0)     # its Started may be on the way
        jobs.stages["a"].running = ("j",)
        assert ending.cancel("j") is job.record
        assert ending.cancel("j") is None            # not live any more
        assert job.record.error.to_doc() == {"code": "cancelled", "stage": "a", "message": "cancelled by request"}
        await asyncio.sleep(0.15)
        assert jobs.stages["a"].kills == [("job j did not stop within 0.05 s of its cancel", False)]
        assert ending.stopping == {}
    asyncio.run(main())


def test_a_dead_worker_is_not_killed_for_its_cancel(tmp_path: Path) -> None:
    async def main() -> None:
        jobs = Jobs(tmp_path, grace=0.05)
        ending = Ending(jobs, lambda job_id: None)  # type: ignore[arg-type]
        job = live_job(jobs, "j")
        job.record.stages["a"].set_state(StageRunState.RUNNING, 1.0)
        jobs.stages["a"].running = ("j",)
        ending.cancel("j")
        ending.worker_gone(P.address("a", 0))
        await asyncio.sleep(0.15)
        assert jobs.stages["a"].kills == [] and ending.stopping == {}
    asyncio.run(main())


def test_a_deadline_times_the_job_out_saying_where_it_was(tmp_path: Path) -> None:
    async def main() -> None:
        jobs = Jobs(tmp_path)
        ending = Ending(jobs, lambda job_id: None)  # type: ignore[arg-type]
        job = live_job(jobs, "slow", timeout_s=0.05)
        job.record.stages["b"].set_state(StageRunState.RUNNING, 1.0)
        ending.arm(job)
        await asyncio.sleep(0.15)
        assert job.record.state is JobState.TIMED_OUT
        assert job.record.error.to_doc() == {"code": "timed_out", "stage": "b",
                                    "message": "timed out after 0.05 s while running in stage 'b'"}
    asyncio.run(main())
