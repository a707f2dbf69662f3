"""A start's restore (omnid/supervisor/jobs/restore.py), in-process: the jobs a previous daemon left
come back queued, run again, or fail.

`take_back` knows its owner only as a `JobControl` (control.py): here a stand-in that keeps the live
jobs and records each `finish`, with a stand-in dispatch that records each route and feed, and a
store that records what is saved. No loop, no scheduler, no worker.
"""

from __future__ import annotations

from typing import Any

from omnid.config import PipelineConfig
from omnid.store import Unfinished
from omnid.supervisor.jobs.live_job import LiveJob
from omnid.supervisor.jobs.restore import take_back
from omnid.vocabulary import ErrorCode, JobError, JobRecord, JobState, StageRun, StageRunState


class Store:
    """What a restore writes to the job store."""

    def __init__(self) -> None:
        self.saved: list[str] = []
        self.kept: list[tuple[str, int]] = []
        self.events: list[dict[str, Any]] = []

    def append_event(self, job: str, seq: int, event: dict[str, Any]) -> None:
        self.events.append(event)

    def save(self, record: JobRecord) -> None:
        self.saved.append(record.id)

    def keep_inputs(self, job: str, inputs: dict[str, Any], attempts: int = 0) -> None:
        self.kept.append((job, attempts))


class Jobs:
    """The scheduler as `JobControl`: its live jobs, and `finish` recorded."""

    def __init__(self) -> None:
        self.live_jobs: dict[str, LiveJob] = {}
        self.stages: dict[str, Any] = {}
        self.store: Any = Store()
        self.finished: list[tuple[str, JobState, dict[str, Any] | None]] = []

    def finish(self, job: LiveJob, state: JobState, error: JobError | None = None) -> None:
        self.live_jobs.pop(job.id, None)
        self.finished.append((job.id, state, error))

    def rank(self, job: LiveJob) -> None:
        job.rank = (job.record.priority, 0.0, len(self.live_jobs))


class Dispatch:
    def __init__(self) -> None:
        self.routed: list[str] = []
        self.fed: list[tuple[list[str], str]] = []

    def route(self, job: LiveJob) -> None:
        self.routed.append(job.id)

    def feed(self, jobs: list[LiveJob], src: str) -> None:
        self.fed.append(([j.id for j in jobs], src))


PIPELINES = {"p": PipelineConfig("p", ("a",), ()), "retry": PipelineConfig("retry", ("a",), (), retries=1)}


def unfinished(job: str, pipeline: str = "p", state: JobState = JobState.QUEUED, attempts: int = 0,
               inputs: dict[str, Any] | None = None) -> Unfinished:
    run = StageRun()
    run.state = StageRunState.RUNNING if state is JobState.RUNNING else StageRunState.QUEUED
    record = JobRecord(id=job, pipeline=pipeline, owner_uid=1000, created_at=1.0, timeout_s=60.0, inputs={},
                       params={}, stages={"a": run}, state=state)
    return Unfinished(record, {"text": "hi"} if inputs is None else inputs, attempts, events=2)


def restore(*old: Unfinished) -> tuple[Jobs, Dispatch, list[LiveJob]]:
    jobs, dispatch = Jobs(), Dispatch()
    back = take_back(jobs, dispatch, PIPELINES, list(old))    # type: ignore[arg-type]
    return jobs, dispatch, back


def test_queued_jobs_come_back_queued_in_their_order_and_are_fed_again() -> None:
    jobs, dispatch, back = restore(unfinished("j1"), unfinished("j2"))
    assert [j.id for j in back] == ["j1", "j2"] and list(jobs.live_jobs) == ["j1", "j2"]
    assert dispatch.routed == ["j1", "j2"] and dispatch.fed == [(["j1", "j2"], "a")]
    assert all(j.record.state is JobState.QUEUED and j.record.stages["a"].state is StageRunState.PENDING
               for j in back)                      # the stages start afresh
    assert jobs.finished == [] and jobs.store.saved == ["j1", "j2"]


def test_a_running_job_with_a_retry_left_runs_again_and_hears_why() -> None:
    jobs, dispatch, back = restore(unfinished("r", "retry", JobState.RUNNING))
    (job,) = back
    assert job.attempts == 1 and job.record.state is JobState.RUNNING and jobs.store.kept == [("r", 1)]
    (event,) = jobs.store.events
    assert event["code"] == str(ErrorCode.DAEMON_RESTARTED) and "attempt 2" in event["message"]


def test_a_running_job_without_a_retry_left_fails_as_interrupted() -> None:
    jobs, dispatch, back = restore(unfinished("r", "retry", JobState.RUNNING, attempts=1),
                                   unfinished("s", "p", JobState.RUNNING))
    assert back == [] and dispatch.fed == [] and jobs.live_jobs == {}
    (r, r_state, r_error), (s, s_state, s_error) = jobs.finished
    assert (r, r_state, s, s_state) == ("r", JobState.FAILED, "s", JobState.FAILED)
    assert r_error is not None and "(retries = 1, all used)" in r_error.message
    assert s_error is not None and s_error.code is ErrorCode.DAEMON_RESTARTED


def test_a_job_whose_pipeline_is_gone_or_whose_inputs_were_not_kept_fails() -> None:
    gone = unfinished("g", "removed")
    lost = unfinished("l")
    lost = Unfinished(lost.record, None, 0, 0)
    jobs, dispatch, back = restore(gone, lost)
    assert back == [] and dispatch.routed == []
    messages = {job: error.message for job, _, error in jobs.finished if error is not None}
    assert "without its pipeline 'removed'" in messages["g"] and "submit it again" in messages["l"]
