"""The OpenAPI document's component schemas: every document the API answers (a job and its events,
generated from the classes in omnid.vocabulary that make them; a pipeline and its description, a
stage, health and readiness, the keys, the OpenAI paths' models and errors), the job request with
each pipeline's inputs and each stage's params, the OpenAI paths' request bodies (generated from the
models that check them, each beside its endpoint in openai/), and the small JSON Schema builders
the others are written with.

Pure functions of the config, called by openapi.py as it builds `GET /v1/openapi.json` (in the
supervisor's event-loop thread); no I/O. Each schema is built from what the server checks with (the
parameter rules of `omnid.params`, the engines' declarations, the words of `omnid.vocabulary`), so
the description cannot drift from the behaviour.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ConfigDict, TypeAdapter, with_config
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema

from omnid.config import Config, StageConfig
from omnid.engines.capabilities import CAPABILITIES, capabilities, stage_params_schema
from omnid.lora import pipeline_adapters
from omnid.media import MEDIA_KINDS
from omnid.params import PLAIN_VALUE_SCHEMA
from omnid.supervisor.http.openai.chat import ChatCompletionRequest
from omnid.supervisor.http.openai.common import PRIORITY_SCHEMA, RequestBody
from omnid.supervisor.http.openai.completions import CompletionRequest
from omnid.supervisor.http.openai.images import ImageRequest
from omnid.supervisor.http.openai.speech import SpeechRequest
from omnid.supervisor.jobs.scheduler import QueuePlace
from omnid.supervisor.jobs.streams import RealtimeState, StreamPlace
from omnid.vocabulary import (
    JOB_LINKS,
    ErrorCode,
    Event,
    EventFields,
    JobError,
    JobOutput,
    JobRecord,
    JobState,
    StageRun,
    WorkerState,
)

# ------------------------------------------------------------------ the builders


def enum(values: Iterable[str]) -> dict[str, Any]:
    return {"type": "string", "enum": [str(v) for v in values]}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: Mapping[str, Any], required: Iterable[str] = (), extra: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": dict(properties), "required": list(required)}
    if not extra:
        schema["additionalProperties"] = False
    return schema


NUM = {"type": "number"}
INT = {"type": "integer"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
_INPUT_NAME = {"type": "string", "minLength": 1, "maxLength": 128}
# base64 as `base64.b64decode(validate=True)` takes it: the standard alphabet, padded
_B64 = {"type": "string", "contentEncoding": "base64",
        "pattern": "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"}
_FILE_INPUT = obj({"b64": _B64, "filename": nullable(STR)},
                  ["b64"], extra=False)
_SAMPLES_INPUT = obj({"samples": {"type": "array", "items": NUM, "minItems": 1},
                      "rate": {"type": "integer", "minimum": 1, "maximum": 768000}}, ["samples", "rate"], extra=False)
_INPUT_VALUE = {"anyOf": [PLAIN_VALUE_SCHEMA, _FILE_INPUT, _SAMPLES_INPUT,
                          {"type": "array", "items": {"anyOf": [_FILE_INPUT, _SAMPLES_INPUT]}, "minItems": 1}]}


# A job's priority (omnid/fair_queue.py): lower runs earlier; 0 by default; past the owner's max_priority: 403
PRIORITY = PRIORITY_SCHEMA
# The OpenAI paths' request bodies, each by the model beside its endpoint that checks it.
REQUESTS: dict[str, type[RequestBody]] = {"ChatCompletionRequest": ChatCompletionRequest,
                                          "CompletionRequest": CompletionRequest, "ImageRequest": ImageRequest,
                                          "SpeechRequest": SpeechRequest}
def _job_request(config: Config) -> dict[str, Any]:
    """`POST /v1/jobs`'s body: one alternative per pipeline, with each stage's params schema."""
    timeout = nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 7 * 24 * 3600})
    variants = []
    for pipeline in config.pipelines.values():
        sources = [config.stages[s] for s in pipeline.sources]
        # (a vllm stage that takes media may get media alone; `messages` is the other alternative)
        needs_prompt = any(capabilities(s.engine).text_prompt and not (capabilities(s.engine).media and s.media.kinds)
                           for s in sources)
        inputs = {"type": "object", "additionalProperties": _INPUT_VALUE, "propertyNames": _INPUT_NAME,
                  "properties": {"prompt": STR} if needs_prompt else {},
                  "required": ["prompt"] if needs_prompt else []}
        params = obj({name: _adapter_schema(stage_params_schema(config.stages[name].engine,
                                                                config.stages[name].defaults), config.stages[name])
                      for name in pipeline.stages}, extra=False)
        variants.append(obj({"pipeline": {"const": pipeline.name}, "inputs": inputs, "params": params,
                             "timeout_s": timeout, "priority": nullable(PRIORITY)}, ["pipeline", *(["inputs"] if needs_prompt else [])],
                            extra=False) | {"title": pipeline.name})
    return {"oneOf": variants} if variants else obj({"pipeline": STR}, ["pipeline"])


def name_adapters(params: dict[str, Any], stage: StageConfig) -> dict[str, Any]:
    """A stage's `adapter` and `adapters` parameters (in a description or a schema's properties) with
    the names of its adapters in force."""
    if stage.lora is None:
        return params
    names = sorted(stage.adapters)
    if isinstance(params.get("adapter"), dict):
        params["adapter"] = {**params["adapter"], "enum": names}
    if isinstance(params.get("adapters"), dict):
        params["adapters"] = {**params["adapters"], "propertyNames": {"enum": names}}
    return params


def _adapter_schema(schema: dict[str, Any], stage: StageConfig) -> dict[str, Any]:
    if isinstance(schema.get("properties"), dict):
        schema["properties"] = name_adapters(dict(schema["properties"]), stage)
    return schema


LORA = nullable(obj({"base": nullable(STR), "max_loras": INT, "max_lora_rank": INT,
                     "adapters": {"type": "array", "items": obj({"name": STR, "path": STR}, ["name", "path"])}},
                    ["base", "adapters", "max_loras", "max_lora_rank"]))


# ------------------------------------------------------------------ the job document and its events


class _Described(GenerateJsonSchema):
    """pydantic's JSON Schema of a type, without the title it gives every field nor the defaults (a
    document always carries every field)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def default_schema(self, schema: Any) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])


# The job document and its events are defined once, by the vocabulary's classes that make them: their
# component schemas are generated from those (a field's docstring is its description); a class of
# these is named by a $ref, any other part (an enum, the progress) is written in place.
_DOCUMENTS: dict[str, Any] = {"Job": JobRecord, "StageRun": StageRun, "JobError": JobError, "Output": JobOutput,
                              "Event": Event, "EventFields": EventFields}
_COMPONENT = {kind.__name__: name for name, kind in _DOCUMENTS.items()}
# What a job's inputs and params hold: the JSON values the request's checks let in (admission.py); an
# input's file or audio, as its summary.
_FILE_SUMMARY = obj({"filename": nullable(STR), "size": INT, "format": STR, "width": INT, "height": INT,
                     "seconds": NUM, "rate": INT, "channels": INT, "samples": INT}, ["size"])
_JOB_VALUES = {
    "inputs": {"type": "object", "additionalProperties": {
        "anyOf": [PLAIN_VALUE_SCHEMA, _FILE_SUMMARY, {"type": "array", "items": _FILE_SUMMARY}]}},
    "params": {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": PLAIN_VALUE_SCHEMA}},
}


def _placed(node: Any, defs: dict[str, Any]) -> Any:
    """A generated schema with its $refs to the documents' classes named as components, the rest in place."""
    if isinstance(node, list):
        return [_placed(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        if name in _COMPONENT:
            return ref(_COMPONENT[name])
        node = {**{k: v for k, v in defs[name].items() if k != "title"}, **{k: v for k, v in node.items() if k != "$ref"}}
    return {key: _placed(value, defs) for key, value in node.items()}


def generated(kind: Any) -> dict[str, Any]:
    """The JSON Schema of a class that makes a document (a dataclass, a TypedDict), from its fields."""
    if isinstance(kind, type):
        with_config(ConfigDict(use_attribute_docstrings=True))(kind)
    schema = TypeAdapter(kind).json_schema(mode="serialization", schema_generator=_Described)
    return {k: v for k, v in _placed(schema, schema.get("$defs", {})).items() if k not in ("$defs", "title")}


@functools.cache
def job_schemas() -> dict[str, Any]:
    """`Job` (the record's document: every field, nothing else; and what its GET adds: its place in
    the queues, per stage, and its stream's), `NewJob` (and its links), `StageRun`, `JobError`,
    `Output` and `Event`, from their classes; `JobList`, `Deleted`."""
    found = {name: generated(kind) for name, kind in _DOCUMENTS.items()}
    for name in ("Job", "StageRun", "JobError"):            # a record's to_doc: all its fields, no other
        found[name] |= {"required": list(found[name]["properties"]), "additionalProperties": False}
    job = found["Job"]["properties"]
    job |= {key: job[key] | schema for key, schema in _JOB_VALUES.items()}     # (their descriptions kept)
    # (pydantic reads a class's own attribute docstrings: an event's fields are described by EventFields')
    found["Event"]["properties"] |= found.pop("EventFields")["properties"] | {"error": nullable(ref("JobError"))}
    stream = generated(StreamPlace)
    found["NewJob"] = {**found["Job"], "required": [*found["Job"]["required"], "links"], "properties": {
        **job, "links": obj({k: STR for k in JOB_LINKS}, list(JOB_LINKS), extra=False), "stream": stream,
        "trace_id": {**STR, "description": "the job's trace ([daemon] tracing on): the caller's traceparent's, "
                     "else a new one"}}}
    job |= {"stream": stream, "queue": {"type": "object", "additionalProperties": generated(QueuePlace)}}
    return found | {"JobList": obj({"jobs": {"type": "array", "items": ref("Job")}}, ["jobs"], extra=False),
                    "Deleted": obj({"deleted": STR}, ["deleted"], extra=False)}


# ------------------------------------------------------------------ the pipelines, the stages, the service

# A real-time pipeline's capacity and streams (GET /v1/pipelines, /v1/stages), as the gate makes it
REALTIME = generated(RealtimeState)
# window: -1 (full trigger), N (segments per window) or a schedule [N1, N2, ...] (the last repeats)
_WINDOW = {"oneOf": [INT, {"type": "array", "items": INT, "minItems": 1}]}
PIPELINE_KEYS = {"name": STR, "stages": {"type": "array", "items": STR}, "edges": {"type": "array", "items": ref("Edge")},
                 "sources": {"type": "array", "items": STR}, "sinks": {"type": "array", "items": STR},
                 "timeout_s": nullable(NUM), "retries": INT,
                 "kept_outputs": {"type": "object", "additionalProperties": {"type": "array", "items": STR},
                                  "description": "the config's `outputs`: outputs of stages that are not last kept "
                                                 "as the job's too"},
                 "realtime": REALTIME}
_PIPELINE_REQUIRED = [k for k in PIPELINE_KEYS if k != "realtime"]
_PARAM_DOC = {"type": "object", "properties": {"default": PLAIN_VALUE_SCHEMA}}
_PIPELINE_DESCRIBED = {
    **PIPELINE_KEYS,
    "inputs": {"type": "object", "additionalProperties": obj(
        {"known": BOOL, "engine": STR, "note": STR,
         "media": obj({**{k: INT for k in MEDIA_KINDS}, "max_bytes": INT, "max_pixels": INT,
                       "max_audio_s": NUM, "max_video_frames": INT}, [*MEDIA_KINDS]),
         "inputs": {"type": "object", "additionalProperties": obj(
             {"type": STR, "required": BOOL, "description": STR}, ["type", "required"])}},
        ["known", "engine", "inputs"])},
    "params": {"type": "object", "additionalProperties": obj(
        {"engine": STR, "accepts": STR, "params": {"type": "object", "additionalProperties": _PARAM_DOC}},
        ["engine", "accepts", "params"])},
    "outputs": {"type": "object", "additionalProperties": obj(
        {"known": BOOL, "engine": STR, "note": STR,
         "outputs": {"type": "array", "items": obj({"name": STR, "kind": STR, "file": STR,
                                                    "content_type": STR, "description": STR},
                                                   ["name", "kind", "content_type"])}},
        ["known", "engine", "outputs"])},
    "adapters": {"type": "object", "additionalProperties": LORA,
                 "description": "the LoRA adapters of its stages that have a lora table, and their base model"},
}
PIPELINE_SCHEMAS = {
    "Edge": obj({"from": STR, "to": STR, "window": _WINDOW, "map": nullable({"type": "object"}),
                 "transform": nullable(STR)}, ["from", "to", "window"]),
    "Pipeline": obj(PIPELINE_KEYS, _PIPELINE_REQUIRED),
    "PipelineList": obj({"pipelines": {"type": "array", "items": ref("Pipeline")}}, ["pipelines"]),
    "PipelineDescription": obj(_PIPELINE_DESCRIBED, [*_PIPELINE_REQUIRED, "inputs", "params", "outputs"]),
}


_STAGE_KEYS = {
    "name": STR, "engine": enum(CAPABILITIES), "state": enum(WorkerState),
    "pid": nullable(INT), "devices": {"type": "array", "items": INT}, "queue_depth": INT,
    "queue_capacity": INT, "max_inflight": INT, "running": {"type": "array", "items": STR},
    "jobs_done": INT, "restarts": INT, "rss_bytes": nullable(INT), "cpu_percent": nullable(NUM),
    "gpu_memory_bytes": nullable(INT), "uptime_s": nullable(NUM), "load_s": nullable(NUM),
    "last_error": nullable(STR),
    "last_restart": nullable(obj({"reason": STR, "at": NUM}, ["reason", "at"], extra=False)),
    "model": nullable(STR), "function": nullable(STR), "lazy": BOOL,
    "placement": enum(("local", "ray", "mixed")), "node": nullable(STR),
    "ray": {"type": ["object", "null"]},     # a Ray-placed worker: node_id, node_ip, node_name, host, actor_id
    "info": {"type": "object", "description": "what the loaded engine reports: for a vLLM stage its model, "
             "dtype, max_model_len, compiled (torch.compile'd or eager), vllm (the vLLM version its worker "
             "runs), engine_core, threads; tensors and media where configured"},
}
_REPLICA_KEYS = {**_STAGE_KEYS, "replica": INT, "label": STR, "retiring": BOOL}
STAGE_SCHEMAS = {
    "Stage": obj({**_STAGE_KEYS, "replica_count": INT, "down": {"type": "array", "items": STR},
                  "idle_unload_s": nullable(NUM), "idle_s": nullable(NUM), "slept_at": nullable(NUM),
                  "wake_s": nullable(NUM), "lora": LORA,
                  "replicas": {"type": "array", "items": obj(_REPLICA_KEYS, ["name", "replica", "state", "pid"])}},
                 ["name", "engine", "state", "pid"]),
    "StageList": obj({"stages": {"type": "array", "items": ref("Stage")},
                      "realtime": {"type": "object", "additionalProperties": REALTIME,
                                   "description": "each real-time pipeline's capacity and streams"}},
                     ["stages"]),
    "Restarting": obj({"restarting": STR, "stage": ref("Stage")}, ["restarting", "stage"]),
    "Sleeping": obj({"sleeping": STR, "already": BOOL, "stage": ref("Stage")}, ["sleeping", "stage"]),
    "Waking": obj({"waking": STR, "already": BOOL, "stage": ref("Stage")}, ["waking", "stage"]),
    "StageAdapters": obj({"stage": STR, "lora": LORA}, ["stage", "lora"]),
    "AdapterRequest": obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
                           "path": {**STR, "minLength": 1, "description": "the adapter's folder (relative: "
                                    "to the config file's folder)"}}, ["name", "path"], extra=False),
}


SERVICE_SCHEMAS = {
    "Health": obj({"status": {"const": "ok"}, "pid": INT, "uptime_s": NUM, "version": STR,
                   "live_jobs": INT, "stopping_jobs": INT},
                  ["status", "pid", "uptime_s", "version", "live_jobs"]),
    "Ready": obj({"ready": BOOL, "stages": {"type": "object", "additionalProperties": enum(WorkerState)},
                  "not_ready": {"type": "array", "items": STR}, "draining": BOOL,
                  "warming": {"type": "array", "items": STR,
                              "description": "real-time pipelines whose warm-up job has not run yet"},
                  "lazy": {"type": "array", "items": STR,
                           "description": "python stages with `lazy = true`: ready before their function "
                                           "has loaded what it needs (it does so on its first job)"},
                  "reasons": {"type": "array", "items": {"enum": [ErrorCode.DISK_FULL]},
                              "description": "why not ready besides the stages: disk_full"},
                  "disk": obj({"full": BOOL, "reason": {"type": ["string", "null"]}, "free_mb": INT,
                               "min_free_mb": INT, "free_inodes": {"type": ["integer", "null"]},
                               "min_free_inodes": INT, "ballast_mb": INT}, ["full", "free_mb"]),
                  "replicas_down": {"type": "object", "additionalProperties": {
                       "type": "object", "additionalProperties": enum(WorkerState)}}},
                 ["ready", "stages", "not_ready"]),
}


def schemas(config: Config) -> dict[str, Any]:
    """`components.schemas`: every document the API answers, and the job request."""
    return {
        "Error": obj({"error": obj({"code": enum(ErrorCode), "message": STR,
                                    "input": {**STR, "description": "the input a 400 invalid_media or "
                                                                       "media_not_accepted is about"}},
                                   ["code", "message"])},
                     ["error"], extra=False),
        "JobRequest": _job_request(config),
        **job_schemas(), **PIPELINE_SCHEMAS, **STAGE_SCHEMAS, **SERVICE_SCHEMAS,
    }


_OPENAI_CODES = sorted({*map(str, ErrorCode), *map(str, JobState)})


def openai_schemas() -> dict[str, Any]:
    """The OpenAI paths' errors and models, and the keys' documents (`/v1/keys`)."""
    return {
        "OpenAIError": obj({"error": obj({
            "message": STR, "type": enum(("invalid_request_error", "authentication_error", "permission_error",
                                          "rate_limit_error", "server_error")),
            "param": nullable(STR), "code": {"anyOf": [enum(_OPENAI_CODES), {"type": "null"}]}},
            ["message", "type", "param", "code"])}, ["error"]),
        "Model": obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR,
                      "parent": {**STR, "description": "a LoRA adapter's model (PIPELINE:ADAPTER): its pipeline"},
                      "root": {**STR, "description": "a LoRA adapter's model: the adapter's folder"},
                      "omnid": {"type": "object"}}, ["id", "object", "created", "owned_by"]),
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
                         ["object", "data"]),
        "ApiKey": obj({"name": STR, "uid": INT, "created": NUM, "hint": STR, "max_jobs": nullable(INT),
                       "rps": nullable(NUM), "admin": BOOL},
                      ["name", "uid", "created", "hint", "max_jobs", "rps", "admin"]),
        "NewApiKey": {"allOf": [ref("ApiKey"), obj({"key": {**STR, "description": "the key, shown this once"}},
                                                   ["key"])]},
        "ApiKeyList": obj({"keys": {"type": "array", "items": ref("ApiKey")}, "file": STR}, ["keys", "file"]),
        "KeyRequest": obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
                           "uid": {"type": "integer", "minimum": 0, "maximum": 2**32 - 2},
                           "max_jobs": nullable({"type": "integer", "minimum": 1, "maximum": 1_000_000}),
                           "rps": nullable({"type": "number", "minimum": 0.001, "maximum": 1_000_000}),
                           "admin": {**BOOL, "description": "the key may do the admin actions over TCP"}},
                          ["name"], extra=False) | {"description": "root must give uid (no key is root by "
                                                                    "default)"},
        "Reloaded": obj({"status": STR, "reloaded": BOOL}, ["status", "reloaded"]),
    }


def answer_models(config: Config, kind: str) -> dict[str, Any]:
    """`model`: the pipelines whose last stages' engines may give this kind of answer (and their adapters)."""
    names = [name for p in config.pipelines.values()
             if any(capabilities(config.stages[s].engine).may_answer(kind) for s in p.sinks)
             for name in (p.name, *(f"{p.name}:{a}" for a in pipeline_adapters(config, p)))]
    return {"type": "string", "enum": names} if names else {"type": "string",
                                                              "description": "no pipeline here gives this answer"}


@functools.cache
def _request_schemas() -> dict[str, Any]:
    _, found = models_json_schema([(model, "validation") for model in REQUESTS.values()],
                                  ref_template="#/components/schemas/{model}")
    return dict(found["$defs"])


def openai_request_schemas(config: Config) -> dict[str, Any]:
    """The OpenAI paths' request bodies (and the parts they are made of), as their models describe
    them (beside their endpoints in openai/); `model` names the config's pipelines that give the answer."""
    found = copy.deepcopy(_request_schemas())
    for name, model in REQUESTS.items():
        found[name]["properties"]["model"] = answer_models(config, model.ANSWER)
    sides = "|".join(str(n) for n in range(8, 4097, 8))     # the diffusers rule: 8 to 4096, multiples of 8
    drawn = any(capabilities(st.engine).image_size for st in config.stages.values())
    size = {"anyOf": [{"const": "auto"}, {"type": "string", "pattern": f"^(?:{sides})x(?:{sides})$"}]} if drawn \
        else {"const": "auto"}
    found["ImageRequest"]["properties"]["size"] = nullable(size)
    return found
