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

import ast
import copy
import functools
import inspect
import textwrap
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import typing_extensions
from pydantic import ConfigDict, TypeAdapter, with_config
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema

from omnid.config import Config, StageConfig
from omnid.config_types import EdgeDoc
from omnid.engines.capabilities import CAPABILITIES, capabilities, stage_params_schema
from omnid.keys import ApiKeyDoc
from omnid.lora import LoraView, pipeline_adapters
from omnid.media import MEDIA_KINDS
from omnid.params import PLAIN_VALUE_SCHEMA
from omnid.supervisor.http.api.adapters import AdapterRequest
from omnid.supervisor.http.api.documents import HealthDoc, PipelineDescription, PipelineListed, ReadyDoc
from omnid.supervisor.http.api.keys import KeyRequest
from omnid.supervisor.http.openai.chat import ChatCompletionRequest
from omnid.supervisor.http.openai.common import PRIORITY_SCHEMA, RequestBody
from omnid.supervisor.http.openai.completions import CompletionRequest
from omnid.supervisor.http.openai.images import ImageRequest
from omnid.supervisor.http.openai.speech import SpeechRequest
from omnid.supervisor.jobs.scheduler import QueuePlace
from omnid.supervisor.jobs.streams import RealtimeState, StreamPlace
from omnid.supervisor.workers.documents import StageDoc
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
)

# ------------------------------------------------------------------ the builders


def enum(values: Iterable[str]) -> dict[str, Any]:
    return {"type": "string", "enum": [str(v) for v in values]}


def nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
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


def _placed(node: Any, defs: Mapping[str, Any]) -> Any:
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
    typed: dict[str, Any] = {}
    _typed_dicts(kind, typed)
    for name, cls in typed.items():     # (pydantic reads a TypedDict's own docstrings, not its bases')
        _describe(schema if cls is kind else schema.get("$defs", {}).get(name, {}), _attribute_docs(cls))
    return {k: v for k, v in _placed(schema, schema.get("$defs", {})).items() if k not in ("$defs", "title")}


def _typed_dicts(kind: Any, found: dict[str, Any]) -> None:
    """Every TypedDict class in `kind`'s fields, by name (as the schema's $defs name them)."""
    if typing_extensions.is_typeddict(kind) and kind.__name__ not in found:
        found[kind.__name__] = kind
        for hint in typing.get_type_hints(kind).values():
            _typed_dicts(hint, found)
    for arg in typing.get_args(kind):
        _typed_dicts(arg, found)


def _attribute_docs(cls: Any) -> dict[str, str]:
    """A TypedDict's field docstrings (a string after the field), its bases' too."""
    docs: dict[str, str] = {}
    for base in getattr(cls, "__orig_bases__", ()):
        if typing_extensions.is_typeddict(base):
            docs |= _attribute_docs(base)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError):
        return docs                     # (one made by the functional form has no class body)
    if not isinstance(body, ast.ClassDef):
        return docs
    for field, after in zip(body.body, body.body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _describe(schema: Mapping[str, Any], docs: dict[str, str]) -> None:
    for name, prop in schema.get("properties", {}).items():
        if name in docs and "description" not in prop:
            prop["description"] = docs[name]


# A stage's LoRA (GET /v1/stages, /v1/pipelines, the adapter endpoints), and a stage's document, from
# their classes (omnid/lora.py, omnid/supervisor/workers/documents.py).
LORA = nullable(generated(LoraView))
STAGE = generated(StageDoc)
for _doc in (STAGE, STAGE["properties"]["replicas"]["items"]):
    _doc["properties"]["engine"] |= enum(CAPABILITIES)      # (a config's engine is a str: these are the known)


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
_PARAM_DOC = {"type": "object", "properties": {"default": PLAIN_VALUE_SCHEMA}}
_PIPELINE_DESCRIBED = {
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
}


def _described(schema: dict[str, Any]) -> dict[str, Any]:
    """A pipeline's description with its inputs, params and outputs as the engines' capabilities
    describe them (their schemas' detail, which the TypedDict leaves open), descriptions kept."""
    props = schema["properties"]
    for key, detail in _PIPELINE_DESCRIBED.items():
        props[key] = props[key] | detail
    return schema


PIPELINE_SCHEMAS = {
    "Edge": generated(EdgeDoc),
    "Pipeline": generated(PipelineListed),
    "PipelineList": obj({"pipelines": {"type": "array", "items": ref("Pipeline")}}, ["pipelines"]),
    "PipelineDescription": _described(generated(PipelineDescription)),
}


STAGE_SCHEMAS = {
    "Stage": STAGE,
    "StageList": obj({"stages": {"type": "array", "items": ref("Stage")},
                      "realtime": {"type": "object", "additionalProperties": REALTIME,
                                   "description": "each real-time pipeline's capacity and streams"}},
                     ["stages"]),
    "Restarting": obj({"restarting": STR, "stage": ref("Stage")}, ["restarting", "stage"]),
    "Sleeping": obj({"sleeping": STR, "already": BOOL, "stage": ref("Stage")}, ["sleeping", "stage"]),
    "Waking": obj({"waking": STR, "already": BOOL, "stage": ref("Stage")}, ["waking", "stage"]),
    "StageAdapters": obj({"stage": STR, "lora": LORA}, ["stage", "lora"]),
    "AdapterRequest": AdapterRequest.model_json_schema(mode="validation"),
}


SERVICE_SCHEMAS = {"Health": generated(HealthDoc), "Ready": generated(ReadyDoc)}


def schemas(config: Config) -> dict[str, Any]:
    """`components.schemas`: every document the API answers, and the job request."""
    # one refusal: its code and words, and the input (or field) it is about
    problem = {"code": enum(ErrorCode), "message": STR, "input": {**STR, "description": "the input or field the "
                                                                   "problem is about"}}
    return {
        "Error": obj({"error": obj({**problem, "problems": {
                         "type": "array", "description": "a job wrong in several places: each problem (the "
                         "error's code and input are the first one's)", "items": obj(problem, ["code", "message"])}},
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
        "ApiKey": generated(ApiKeyDoc),
        "NewApiKey": {"allOf": [ref("ApiKey"), obj({"key": {**STR, "description": "the key, shown this once"}},
                                                   ["key"])]},
        "ApiKeyList": obj({"keys": {"type": "array", "items": ref("ApiKey")}, "file": STR}, ["keys", "file"]),
        "KeyRequest": KeyRequest.model_json_schema(mode="validation"),
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
