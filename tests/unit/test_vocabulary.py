"""`omnid.vocabulary`: the states, event types and error codes the API shows, and the job record."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from omnid.vocabulary import (
    LIVE_JOB_STATES,
    TERMINAL_JOB_STATES,
    WARM_WORKER_STATES,
    ErrorCode,
    EventType,
    JobError,
    JobRecord,
    JobState,
    StageRun,
    StageRunState,
    WorkerState,
)

# The strings the API, the database and omnictl use: changing one breaks clients and stored jobs.
API_STRINGS: dict[type, list[str]] = {
    JobState: ["queued", "running", "succeeded", "failed", "cancelled", "timed_out"],
    StageRunState: ["pending", "queued", "running", "succeeded", "failed", "cancelled"],
    WorkerState: ["starting", "waiting_for_device", "loading", "ready", "busy", "restarting", "failed", "stopped",
                  "degraded", "sleeping"],
    EventType: ["state", "stage_started", "progress", "segment", "output", "stage_finished", "error",
                "stage_waking", "stage_awake"],
    ErrorCode: ["bad_json", "invalid_request", "invalid_input", "missing_input", "invalid_param",
                "invalid_media", "media_not_accepted", "prompt_too_long", "unknown_pipeline", "unknown_job", "ambiguous_job", "unknown_output", "output_gone",
                "job_not_finished", "not_yours", "no_credentials", "too_large", "queue_full", "over_capacity", "shutting_down", "not_admin", "unknown_stage", "stage_busy", "draining",
                "insufficient_storage", "disk_full", "too_many_connections",
                "not_found", "method_not_allowed", "http_error", "internal_error", "stage_failed",
                "input_rejected", "worker_died", "edge_failed", "output_failed", "cancelled", "timed_out", "daemon_stopping",
                "daemon_restarted", "wake_failed",
                "invalid_api_key", "rate_limited", "unknown_key", "key_exists", "socket_only",
                "model_not_found", "model_not_supported", "no_image",
                "priority_not_allowed", "owner_queue_full",
                "unknown_adapter", "adapter_exists", "invalid_adapter"],
}


@pytest.mark.parametrize("enum", list(API_STRINGS), ids=lambda e: e.__name__)
def test_enum_values_are_the_api_strings(enum: type) -> None:
    assert [m.value for m in enum] == API_STRINGS[enum]
    for m in enum:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value
        assert m.name.lower() == m.value
        assert enum(m.value) is m
        assert json.dumps(m) == json.dumps(m.value)


def test_terminal_and_live_job_states_partition_job_state() -> None:
    assert TERMINAL_JOB_STATES | LIVE_JOB_STATES == set(JobState)
    assert not TERMINAL_JOB_STATES & LIVE_JOB_STATES
    assert LIVE_JOB_STATES == {JobState.QUEUED, JobState.RUNNING}
    assert [s for s in JobState if s.terminal] == [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED,
                                                   JobState.TIMED_OUT]


def test_stage_run_state_properties() -> None:
    assert {s for s in StageRunState if s.busy} == {StageRunState.QUEUED, StageRunState.RUNNING}
    assert {s for s in StageRunState if s.open} == {StageRunState.PENDING, StageRunState.QUEUED,
                                                    StageRunState.RUNNING}


def test_warm_worker_states() -> None:
    assert WARM_WORKER_STATES == {WorkerState.READY, WorkerState.BUSY}
    assert {s for s in WorkerState if s.warm} == WARM_WORKER_STATES


# ------------------------------------------------------------------------------ the job record


def a_record() -> JobRecord:
    return JobRecord(id="0123456789ab", pipeline="t2i", owner_uid=1000, created_at=1_760_000_000.5,
                     timeout_s=600.0, inputs={"prompt": "a cat"}, params={"draw": {"seed": 3}},
                     stages={"expand": StageRun(), "draw": StageRun()})


DOC_KEYS = ["id", "pipeline", "state", "owner_uid", "created_at", "started_at", "finished_at", "timeout_s",
            "inputs", "params", "stages", "outputs", "error", "priority", "key"]


def test_to_doc_key_order_is_the_apis() -> None:
    doc = a_record().to_doc()
    assert list(doc) == DOC_KEYS
    assert list(doc["stages"]) == ["expand", "draw"]
    assert list(doc["stages"]["draw"]) == ["state", "progress", "started_at", "finished_at", "elapsed_s", "segments",
                                         "replica"]
    text = json.dumps(doc)
    assert text.index('"id"') < text.index('"pipeline"') < text.index('"state"') < text.index('"owner_uid"')


def test_a_new_record_is_queued_with_pending_stages() -> None:
    doc = a_record().to_doc()
    assert doc["state"] == "queued" and doc["started_at"] is None and doc["finished_at"] is None
    assert doc["outputs"] == [] and doc["error"] is None
    assert doc["stages"]["expand"] == {"state": "pending", "progress": None, "started_at": None,
                                       "finished_at": None, "elapsed_s": None, "segments": 0,
                                       "replica": None}


def finished_record() -> JobRecord:
    rec = a_record()
    rec.set_state(JobState.RUNNING, 10.0)
    rec.stages["expand"].set_state(StageRunState.RUNNING, 10.5)
    rec.stages["expand"].progress = {"done": 3, "total": 3}
    rec.stages["expand"].segments = 4
    rec.stages["expand"].elapsed_s = 1.25
    rec.stages["expand"].set_state(StageRunState.SUCCEEDED, 11.75)
    rec.stages["draw"].set_state(StageRunState.FAILED, 12.0)
    rec.outputs.append({"name": "image", "file": "image.png", "size": 10})
    rec.set_state(JobState.FAILED, 12.0, error=JobError(ErrorCode.STAGE_FAILED, "boom", "draw"))
    return rec


@pytest.mark.parametrize("make", [a_record, finished_record], ids=["new", "finished"])
def test_from_doc_round_trips(make: Any) -> None:
    rec = make()
    doc = rec.to_doc()
    back = JobRecord.from_doc(copy.deepcopy(doc))
    assert back == rec
    assert back.to_doc() == doc
    assert type(back.state) is JobState and all(type(s.state) is StageRunState for s in back.stages.values())
    again = JobRecord.from_doc(json.loads(json.dumps(doc)))      # as the store reads it back
    assert again == rec


def test_from_doc_tolerates_missing_optional_keys() -> None:
    doc = a_record().to_doc()
    for key in ("started_at", "finished_at", "outputs", "error"):
        del doc[key]
    for run in doc["stages"].values():
        for key in ("progress", "started_at", "finished_at", "elapsed_s", "segments"):
            del run[key]
    assert JobRecord.from_doc(doc) == a_record()


def test_job_set_state_stamps_times() -> None:
    rec = a_record()
    rec.set_state(JobState.RUNNING, 5.0)
    assert (rec.state, rec.started_at, rec.finished_at, rec.error) == (JobState.RUNNING, 5.0, None, None)
    assert not rec.terminal
    error = JobError(ErrorCode.TIMED_OUT, "after 600 s")
    rec.set_state(JobState.TIMED_OUT, 9.0, error=error)
    assert (rec.state, rec.started_at, rec.finished_at, rec.error) == (JobState.TIMED_OUT, 5.0, 9.0, error)
    assert rec.terminal


@pytest.mark.parametrize("state", sorted(TERMINAL_JOB_STATES))
def test_job_set_state_terminal_stamps_finished_at_and_error(state: JobState) -> None:
    rec = a_record()
    error = None if state is JobState.SUCCEEDED else JobError(ErrorCode.STAGE_FAILED, str(state))
    rec.set_state(state, 7.0, error=error)
    assert rec.finished_at == 7.0 and rec.started_at is None and rec.terminal
    assert rec.error == error


def test_job_set_state_queued_stamps_nothing() -> None:
    rec = a_record()
    rec.set_state(JobState.RUNNING, 5.0)
    rec.set_state(JobState.QUEUED, 6.0)
    assert (rec.started_at, rec.finished_at) == (5.0, None)


def test_stage_run_set_state_stamps_times() -> None:
    run = StageRun()
    run.set_state(StageRunState.QUEUED, 1.0)
    assert (run.started_at, run.finished_at) == (None, None)
    run.set_state(StageRunState.RUNNING, 2.0)
    assert (run.started_at, run.finished_at) == (2.0, None)
    run.set_state(StageRunState.SUCCEEDED, 3.0)
    assert (run.state, run.started_at, run.finished_at) == (StageRunState.SUCCEEDED, 2.0, 3.0)


@pytest.mark.parametrize("state", [StageRunState.SUCCEEDED, StageRunState.FAILED, StageRunState.CANCELLED])
def test_stage_run_ending_without_running_stamps_only_finished_at(state: StageRunState) -> None:
    run = StageRun()
    run.set_state(state, 4.0)
    assert (run.state, run.started_at, run.finished_at) == (state, None, 4.0)


def test_doc_holds_plain_strings() -> None:
    rec = finished_record()
    doc = rec.to_doc()
    assert type(doc["state"]) is str and type(doc["stages"]["draw"]["state"]) is str
    text = json.dumps(doc)
    assert '"state": "failed"' in text and '"state": "succeeded"' in text
    assert "JobState" not in text and "StageRunState" not in text
    assert json.loads(text) == doc


def test_a_job_error_is_typed_and_its_json_is_as_before() -> None:
    """`JobError` serialises to the `{"code", "message", "stage"}` the API has always shown; a record
    the store kept before (a dict without `stage`, or with a code this version no longer has) reads back."""
    error = JobError(ErrorCode.WORKER_DIED, "stage 'a' died", "a")
    assert error.to_doc() == {"code": "worker_died", "message": "stage 'a' died", "stage": "a"}
    assert json.dumps(error.to_doc()) == '{"code": "worker_died", "message": "stage \'a\' died", "stage": "a"}'
    assert JobError.from_doc(json.loads(json.dumps(error.to_doc()))) == error
    assert type(JobError.from_doc({"code": "timed_out", "message": "m"}).code) is ErrorCode
    assert JobError.from_doc({"code": "daemon_restarted", "message": "m"}) == JobError(ErrorCode.DAEMON_RESTARTED, "m")
    assert JobError.from_doc({"code": "gone_code", "message": "m"}).code is ErrorCode.INTERNAL_ERROR
    doc = finished_record().to_doc()
    assert doc["error"] == {"code": "stage_failed", "message": "boom", "stage": "draw"}
