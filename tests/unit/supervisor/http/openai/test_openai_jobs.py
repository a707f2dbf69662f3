"""What the OpenAI paths read of a job, in process (`omnid.supervisor.http.openai.jobs`, `common.Generation`): a text
job's events counted into its answer (segments, tokens, the prompt's tokens, the finish reason), the
output picked, a stream's opening chunk held for its first, and a job that did not succeed said in
OpenAI's words."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omnid.supervisor.http.openai.common import Generation, OpenAiError, take, usage
from omnid.supervisor.http.openai.jobs import Opening, pick, succeeded
from omnid.vocabulary import ErrorCode, EventType, JobError, JobState


def test_a_text_jobs_events_make_its_answer() -> None:
    gen = Generation("talk", "gen")
    events: list[dict[str, Any]] = [
        {"type": EventType.SEGMENT, "stage": "gen", "text": "not the answer's"},
        {"type": EventType.SEGMENT, "stage": "talk", "text": "Hello"},
        {"type": EventType.SEGMENT, "stage": "talk", "text": ""},
        {"type": EventType.PROGRESS, "stage": "gen", "done": 3, "total": 4},
        {"type": EventType.STAGE_FINISHED, "stage": "gen", "usage": {"prompt_tokens": 11}},
    ]
    assert [take(ev, gen) for ev in events] == [None, "Hello", None, None, None]
    assert (gen.segments, gen.completion_tokens, gen.finish_reason) == (2, 3, "stop")
    assert usage(gen) == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    take({"type": EventType.PROGRESS, "stage": "gen", "done": 4, "total": 4}, gen)
    assert gen.finish_reason == "length"
    plain = Generation("talk", None)                # no vLLM stage: the segments are counted
    take({"type": EventType.SEGMENT, "stage": "talk", "text": "hi"}, plain)
    assert usage(plain) == {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}


def test_the_output_picked_and_the_opening_chunk() -> None:
    outs = [{"kind": "text", "name": "prompt", "stage": "a"}, {"kind": "text", "name": "other", "stage": "b"},
            {"kind": "text", "name": "text", "stage": "b"}]
    assert pick(outs, "text", "text", "b") is outs[2]
    assert pick(outs, "text", "missing", "b") is outs[1]           # of a stage: its first of that kind
    assert pick(outs, "text", "prompt", None) is outs[0]
    assert pick(outs, "text", "missing", None) is None
    opening = Opening({"role": "assistant"})
    assert opening.take() == [{"role": "assistant"}] and opening.take() == []
    assert Opening(None).take() == []


def job(state: JobState, error: JobError | None = None) -> Any:
    return SimpleNamespace(job=lambda _id: SimpleNamespace(id="j1", state=state, error=error))


def test_a_job_that_did_not_succeed_is_an_openai_error() -> None:
    assert succeeded(job(JobState.SUCCEEDED), "j1").state is JobState.SUCCEEDED
    cases = [(SimpleNamespace(job=lambda _id: None), 500, "unknown_job"),
             (job(JobState.FAILED, JobError(ErrorCode.INPUT_REJECTED, "too long")), 400,
              str(ErrorCode.INPUT_REJECTED)),
             (job(JobState.TIMED_OUT), 504, str(JobState.TIMED_OUT)),
             (job(JobState.FAILED, JobError(ErrorCode.WORKER_DIED, "boom")), 500, "worker_died")]
    for scheduler, status, code in cases:
        with pytest.raises(OpenAiError) as e:
            succeeded(scheduler, "j1")
        assert (e.value.status, e.value.code, e.value.retry) == (status, code, False)
    with pytest.raises(OpenAiError) as e:
        succeeded(job(JobState.FAILED, JobError(ErrorCode.WORKER_DIED, "boom")), "j1")
    assert e.value.message == "job j1 failed: boom"
