"""The job document and its events, defined once (issue 44): the classes in omnid.vocabulary make the
API's JSON (`to_doc`, `EventStream.emit`) and, through pydantic, the OpenAPI document's `Job`,
`StageRun`, `JobError`, `Output` and `Event` schemas. Here: the documents they make validate against
the schemas generated from them, pydantic's own serialization of the classes gives the very
document `to_doc` makes (so the quick path and the description cannot part), every field is
described where the class says so, and no runtime function outside omnid/tinymodels passes 60 lines.

Pure functions in the test process; about a second.
"""

from __future__ import annotations

import ast
import copy
import json
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import TypeAdapter

import omnid
from omnid.supervisor.http.openapi_schemas import job_schemas
from omnid.supervisor.jobs.live_job import EventStream
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
)

IMAGE: JobOutput = {"name": "image", "file": "image.png", "kind": "image", "content_type": "image/png", "size": 10,
                    "stage": "draw"}


def _record(ended: bool) -> JobRecord:
    rec = JobRecord(id="0123456789ab", pipeline="t2i", owner_uid=1000, created_at=1_760_000_000.5, timeout_s=600.0,
                    inputs={"prompt": "a cat", "image": {"filename": "a.png", "size": 3, "format": "png"}},
                    params={"draw": {"seed": 3}}, stages={"expand": StageRun(), "draw": StageRun(replica=1)},
                    priority=-2, key="alice")
    if ended:
        rec.set_state(JobState.RUNNING, 10.0)
        rec.stages["expand"].progress = {"done": 3, "total": None}
        rec.stages["expand"].set_state(StageRunState.SUCCEEDED, 11.0)
        rec.outputs.append(IMAGE)
        rec.set_state(JobState.FAILED, 12.0, error=JobError(ErrorCode.STAGE_FAILED, "boom", "draw"))
    return rec


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": {"schemas": job_schemas()}})


@pytest.mark.parametrize("ended", [False, True], ids=["new", "ended"])
def test_a_jobs_document_is_what_its_schema_and_its_class_say(ended: bool) -> None:
    rec = _record(ended)
    doc = rec.to_doc()
    _validator("Job").validate(json.loads(json.dumps(doc)))
    # pydantic's serialization of the class is the document to_doc makes, key for key and in order
    dumped = TypeAdapter(JobRecord).dump_python(rec, mode="json")
    assert json.dumps(dumped) == json.dumps(doc)
    assert JobRecord.from_doc(copy.deepcopy(doc)) == rec


def test_the_schemas_hold_a_document_to_its_fields() -> None:
    doc = _record(True).to_doc()
    job = _validator("Job")
    assert not job.is_valid({**doc, "extra": 1})
    assert not job.is_valid({k: v for k, v in doc.items() if k != "key"})     # (null, but always there)
    assert not job.is_valid({**doc, "state": "sleeping"})
    assert not job.is_valid({**doc, "stages": {"draw": {**doc["stages"]["draw"], "state": "done"}}})
    assert not _validator("JobError").is_valid({"code": "no_such_code", "message": "x", "stage": None})
    schema = job_schemas()["Job"]
    assert schema["properties"]["priority"]["description"] == "lower runs earlier"
    assert set(schema["required"]) == set(doc) == {f for f in JobRecord.__dataclass_fields__}
    assert set(schema["properties"]) - set(doc) == {"queue", "stream"}     # (what GET /v1/jobs/{id} adds)


def test_a_record_read_back_tolerates_old_and_unknown_keys() -> None:
    doc = _record(True).to_doc()
    old = {**doc, "gone_field": 1}
    del old["key"], old["priority"]
    back = JobRecord.from_doc(old)
    assert back.key is None and back.priority == 0 and back.to_doc()["error"] == doc["error"]


class _Store:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append_event(self, job: str, seq: int, event: dict[str, Any]) -> None:
        self.events.append(event)


def test_each_kind_of_event_validates_against_the_event_schema() -> None:
    store = _Store()
    events = EventStream("j1", store)  # (a store that keeps the events it is given)
    events.emit(EventType.STATE, state=JobState.QUEUED, trace_id="ab" * 16)
    events.emit(EventType.STAGE_STARTED, stage="draw")
    events.emit(EventType.PROGRESS, stage="draw", done=1, total=None)
    events.emit(EventType.SEGMENT, stage="draw", index=0, is_last=False, text="hi", audio_s=0.25)
    events.emit(EventType.OUTPUT, **IMAGE)
    events.emit(EventType.STAGE_FINISHED, stage="draw", elapsed_s=1.5, usage={"prompt_tokens": 3}, finish_reason="stop")
    events.emit(EventType.ERROR, stage="draw", code=ErrorCode.WORKER_DIED, message="died")
    events.emit(EventType.STAGE_WAKING, stage="draw")
    events.emit(EventType.STAGE_AWAKE, stage="draw", wake_s=2.0)
    events.emit(EventType.STATE, state=JobState.FAILED, error=JobError(ErrorCode.STAGE_FAILED, "boom", "draw").to_doc())
    validator = _validator("Event")
    for event in store.events:
        sent = json.loads(json.dumps(event))           # as the API sends it
        validator.validate(sent)
        assert sent == event
    assert not validator.is_valid({"type": "state", "job": "j1", "ts": 1.0, "state": "sleeping"})
    assert not validator.is_valid({"type": "nap", "job": "j1", "ts": 1.0})


def test_the_event_schema_is_its_classes() -> None:
    schema = job_schemas()["Event"]
    assert set(schema["properties"]) == set(typing.get_type_hints(Event)) == {*EventFields.__annotations__,
                                                                                "type", "job", "ts"}
    assert schema["required"] == ["type", "job", "ts"]
    assert "stop" in schema["properties"]["finish_reason"]["description"]


MAX_LINES = 60


def test_no_runtime_function_is_over_60_lines() -> None:
    """The issue's bound: a function a reader takes in at once (omnid/tinymodels/, the test models'
    builders, excepted)."""
    root = Path(omnid.__file__).parent.parent
    long = []
    for path in sorted([*(root / "omnid").rglob("*.py"), *(root / "omnictl").rglob("*.py")]):
        if "tinymodels" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long
