"""The API describing itself: `GET /v1/pipelines/{name}` (what a pipeline takes and gives) and
`GET /v1/openapi.json` (an OpenAPI 3.1 document of every route the app has).

Runs in the supervisor's event-loop thread, called by the socket API's handlers (api/admin.py); pure functions of
the config and the app's router, no I/O, nothing blocks. Both documents are built from the same
things the server checks with: the parameter rules of `omnid.params` (each rule describes itself),
the engines' declarations (`omnid.engines.capabilities`: their input needs, as admission.py
enforces them, and their outputs) and the words of `omnid.vocabulary`, so
the description cannot drift from the behaviour. The documents the API answers (the component
schemas) are openapi_schemas.py's; here are the operations: each route's summary, parameters, body
and answers. The routes are read from the app's router at request time: an endpoint added anywhere
(another module's routes too) is in the document; one this module has no schema for is still
listed, described by its handler's docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from omnid.config import Config, PipelineConfig, StageConfig
from omnid.engines.capabilities import capabilities, describe_stage_params
from omnid.lora import describe as describe_lora
from omnid.media import IMAGE_FORMATS
from omnid.supervisor.http.api.documents import PipelineDescription
from omnid.supervisor.http.openapi_schemas import (
    INT,
    LORA,
    STR,
    enum,
    name_adapters,
    obj,
    openai_request_schemas,
    openai_schemas,
    ref,
    schemas,
)
from omnid.supervisor.workers.stage_logs import SINCE_PATTERN
from omnid.vocabulary import ErrorCode, JobState

# A first stage whose engine needs a text input "prompt" (`Capabilities.text_prompt`: the API refuses
# a job without it, 400 missing_input) is described; a python stage's function reads whatever inputs it
# wants. What a stage produces (the job's outputs when it is a last stage) is its engine's `outputs`.
UNKNOWN_INPUTS = "unknown: a python stage's function reads whatever inputs it wants"
UNKNOWN_OUTPUTS = ("whatever the function returns: str -> NAME.txt, image -> NAME.png, bytes sniffed, "
                   "tensor/array -> NAME.npy, other values -> NAME.json")


# ------------------------------------------------------------------ GET /v1/pipelines/{name}


_MEDIA_INPUTS = {
    "image": ("file", "an image file ({IMAGE_FORMATS}), or a list of them: at most {n} per job, {max_pixels} "
                      "pixels and {max_bytes} bytes each"),
    "audio": ("file", "a WAV file (PCM or float), or samples {{\"samples\": [...], \"rate\": HZ}}, or a list of "
                      "those: at most {n} per job, {max_audio_s:g} s and {max_bytes} bytes each"),
    "video": ("file", "a video as a list of frame files ({IMAGE_FORMATS}): at most {n} per job, "
                      "{max_video_frames} frames"),
}


def _stage_inputs(stage: StageConfig) -> dict[str, Any]:
    caps = capabilities(stage.engine)
    if caps.text_prompt:
        kinds = stage.media.kinds if caps.media else ()
        what = f"the text prompt of {stage.engine} stage {stage.name!r}"
        inputs: dict[str, Any] = {"prompt": {"type": "string", "required": not kinds,
                                             "description": what + (" (optional with media)" if kinds else "")}}
        for kind in kinds:
            typ, text = _MEDIA_INPUTS[kind]
            inputs[kind] = {"type": typ, "required": False, "description": text.format(
                IMAGE_FORMATS=IMAGE_FORMATS, n=stage.media.count(kind), **stage.media.as_api())}
        doc = {"known": True, "engine": stage.engine, "inputs": inputs}
        if kinds:
            doc["media"] = stage.media.as_api()
        return doc
    return {"known": False, "engine": stage.engine, "inputs": {}, "note": UNKNOWN_INPUTS}


def _stage_outputs(stage: StageConfig) -> dict[str, Any]:
    outputs = capabilities(stage.engine).outputs
    if outputs is not None:
        return {"known": True, "engine": stage.engine, "outputs": [dict(o) for o in outputs]}
    return {"known": False, "engine": stage.engine, "outputs": [], "note": UNKNOWN_OUTPUTS}


def describe_pipeline(config: Config, pipeline: PipelineConfig) -> PipelineDescription:
    """The discovery document: the listing's fields (`as_api`), then what a job gives it
    (`inputs` per first stage), may set (`params` per stage: types, limits, defaults) and gets
    back (`outputs` per last stage, by engine)."""
    stages = [config.stages[name] for name in pipeline.stages]
    params = {s.name: {"engine": s.engine, **describe_stage_params(s.engine, s.defaults)} for s in stages}
    for s in stages:
        name_adapters(params[s.name]["params"], s)
    return {**pipeline.as_api(),
            "inputs": {s.name: _stage_inputs(s) for s in stages if s.name in pipeline.sources},
            "params": params,
            "outputs": {s.name: _stage_outputs(s) for s in stages if s.name in pipeline.sinks},
            "adapters": {s.name: describe_lora(s) for s in stages if s.lora is not None}}


# ------------------------------------------------------------------ operations


def _json(schema: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = {"$ref": "#/components/responses/Error"}
_JOB_ID = {"name": "id", "in": "path", "required": True, "schema": STR,
           "description": "a job id, or a unique prefix of at least 4 characters"}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": STR, "description": description}


def _query(name: str, schema: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _op(summary: str, responses: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, **extra, "responses": {**responses, "default": _ERROR}}


_LOG_QUERY = [
    _query("since", {"type": "string", "pattern": SINCE_PATTERN},
           "only lines since: a duration ago (10m, 1h, 2d), an ISO 8601 time or a Unix time (empty: all)"),
    _query("tail", {"type": "integer", "minimum": 0, "maximum": 100000}, "only the last N lines"),
    _query("follow", enum(("1", "true", "0", "false")), "1 or true: the answer is a stream that does not end: new "
           "lines are sent as they are written until the caller hangs up or the daemon stops"),
]
# A followed log: the 200 answer is chunked text that ends only when the caller hangs up.
_LOG_STREAM = {"x-omnid-stream": "with follow=1 or follow=true: chunked text/plain that the server never ends; "
                                 "read it line by line and hang up when done"}

# W3C Trace Context ([daemon] tracing): the caller's context, joined by every path that makes a job;
# the job's own, in the answer.
_TRACE_PARAMETERS = [
    {"name": "traceparent", "in": "header", "required": False, "schema": STR,
     "description": "W3C Trace Context: with tracing on, the job's span is this span's child (ignored when not valid)"},
    {"name": "tracestate", "in": "header", "required": False, "schema": STR,
     "description": "W3C Trace Context: carried with traceparent"}]
_TRACE_RESPONSE = {"traceresponse": {"schema": STR, "description": "with tracing on: the job's span, "
                                     "00-<trace id>-<span id>-<flags> (W3C Trace Context level 2)"}}

# (method, path) -> operation, for the routes this module knows. Routes it does not know are
# documented from their handler (see `openapi_document`).
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/jobs"): _op(
        "Submit a job", {"201": {**_json(ref("NewJob"), "the job, queued (it is in the database), with its "
                                                           "paths; its inputs as a short summary"),
                                 "headers": {"Location": {"schema": STR, "description": "/v1/jobs/{id}"},
                                             **_TRACE_RESPONSE}}},
        requestBody={"required": True, "content": {"application/json": {"schema": ref("JobRequest")}}}),
    ("GET", "/v1/jobs"): _op(
        "The caller's jobs (root, or an admin key over TCP: everyone's), newest first", {"200": _json(ref("JobList"), "the jobs")},
        parameters=[_query("state", enum(JobState), "only jobs in this state"),
                    _query("pipeline", STR, "only jobs of this pipeline"),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 50},
                           "how many")]),
    ("GET", "/v1/jobs/{id}"): _op("One job; a queued one with `queue`: its place in each stage's queue and what is "
                                  "ahead of it", {"200": _json(ref("Job"), "the job")}, parameters=[_JOB_ID]),
    ("GET", "/v1/jobs/{id}/events"): _op(
        "The job's events from its start, live, ending after its terminal state",
        {"200": {"description": "NDJSON: one Event object per line",
                 "content": {"application/x-ndjson": {"schema": ref("Event")}}}}, parameters=[_JOB_ID]),
    ("POST", "/v1/jobs/{id}/cancel"): _op(
        "Cancel a queued or running job (idempotent)", {"200": _json(ref("Job"), "the job")}, parameters=[_JOB_ID]),
    ("DELETE", "/v1/jobs/{id}"): _op(
        "Forget a finished job and its files (409 while it runs)", {"200": _json(ref("Deleted"), "deleted")},
        parameters=[_JOB_ID]),
    ("GET", "/v1/jobs/{id}/outputs/{name}"): _op(
        "One output's bytes, with its content type; ?stream=1: a live job's output as it is produced",
        {"200": {"description": "the output's bytes, as its content type says (image/png, audio/wav, text/plain, "
                                "application/json, ...)", "content": {"*/*": {"schema": {}}}}},
        parameters=[_JOB_ID, _path_param("name", "the output's name or file name"),
                    _query("stream", enum(("1", "true", "0", "false")), "stream a live job's output")]),
    ("GET", "/v1/pipelines"): _op("Every pipeline", {"200": _json(ref("PipelineList"), "the pipelines")}),
    ("GET", "/v1/pipelines/{name}"): _op(
        "One pipeline: its inputs, each stage's parameters (types, limits, defaults), edges and outputs",
        {"200": _json(ref("PipelineDescription"), "the pipeline")},
        parameters=[_path_param("name", "the pipeline's name")]),
    ("GET", "/v1/stages"): _op("Every stage's worker", {"200": _json(ref("StageList"), "the stages")}),
    ("POST", "/v1/stages/{name}/restart"): _op(
        "Replace a stage's workers, one replica after the other; wake it if it sleeps (root or "
        "daemon.admin_group; over TCP a key made with admin, else 403 not_admin)", {"202": _json(ref("Restarting"), "restarting")},
        parameters=[_path_param("name", "the stage's name")]),
    ("POST", "/v1/stages/{name}/sleep"): _op(
        "Stop a stage's workers until a job needs it, freeing their memory and GPUs (root or "
        "daemon.admin_group; over TCP an admin key); 409 stage_busy while it has jobs",
        {"202": _json(ref("Sleeping"), "going to sleep"), "200": _json(ref("Sleeping"), "asleep already")},
        parameters=[_path_param("name", "the stage's name")]),
    ("POST", "/v1/stages/{name}/wake"): _op(
        "Load a sleeping stage's workers again (root or daemon.admin_group; over TCP an admin key)",
        {"202": _json(ref("Waking"), "waking"), "200": _json(ref("Waking"), "awake already")},
        parameters=[_path_param("name", "the stage's name")]),
    ("GET", "/v1/stages/{name}/logs"): _op(
        "A stage worker's stdout and stderr, one `TIME LINE` per line (root or daemon.admin_group)",
        {"200": {"description": "text lines, each prefixed with the UTC time it was read; with follow, a stream "
                                "that the server never ends (new lines as they come)",
                 "content": {"text/plain": {"schema": STR}}, **_LOG_STREAM}},
        parameters=[_path_param("name", "the stage's name"), *_LOG_QUERY,
                    _query("replica", {"type": "integer", "minimum": 0}, "which replica (0 by default)")]),
    ("GET", "/v1/stages/{name}/adapters"): _op(
        "A stage's LoRA adapters in force and their base model", {"200": _json(ref("StageAdapters"), "the adapters")},
        parameters=[_path_param("name", "the stage's name")]),
    ("POST", "/v1/stages/{name}/adapters"): _op(
        "Add a LoRA adapter to a running stage (root or daemon.admin_group; over TCP a key made with admin, else 403 "
        "not_admin): new jobs may name it at once; "
        "400 invalid_adapter (no LoRA there, a rank above max_lora_rank, made for another model), 409 "
        "adapter_exists, or 409 invalid_adapter for a stage that takes none (no lora table)", {"201": _json(obj({"stage": STR, "added": STR, "rank": INT, "lora": LORA},
                                             ["stage", "added", "lora"]), "added")},
        parameters=[_path_param("name", "the stage's name")], requestBody={"required": True, "content": {
            "application/json": {"schema": ref("AdapterRequest")}}}),
    ("DELETE", "/v1/stages/{name}/adapters/{adapter}"): _op(
        "Remove a LoRA adapter (root or daemon.admin_group; over TCP a key made with admin, else 403 not_admin): new jobs may no longer name it; running ones "
        "finish with it", {"200": _json(obj({"stage": STR, "removed": STR, "lora": LORA},
                                            ["stage", "removed", "lora"]), "removed")},
        parameters=[_path_param("name", "the stage's name"), _path_param("adapter", "the adapter's name")]),
    ("GET", "/v1/logs"): _op(
        "The daemon's own records, one `TIME LINE` per line (root or daemon.admin_group)",
        {"200": {"description": "text lines, each prefixed with the UTC time it was written; with follow, a "
                                "stream that the server never ends (new lines as they come)",
                 "content": {"text/plain": {"schema": STR}}, **_LOG_STREAM}},
        parameters=_LOG_QUERY),
    ("POST", "/v1/reload"): _op(
        "Read the config file again and apply it, as SIGHUP does (root or daemon.admin_group; over TCP an "
        "admin key, else 403 not_admin); reloaded false when it was refused (the previous config still serves)",
        {"200": _json(ref("Reloaded"), "what happened")}),
    ("GET", "/v1/health"): _op("Alive: pid, uptime, version, live jobs", {"200": _json(ref("Health"), "alive")}),
    ("GET", "/v1/ready"): _op("Every stage takes jobs: warm, degraded (some replicas down) or sleeping (200), "
                              "or not (503)",
                              {"200": _json(ref("Ready"), "ready"), "503": _json(ref("Ready"), "not ready")}),
    ("GET", "/metrics"): _op("Prometheus metrics", {"200": {"description": "Prometheus text exposition",
                                                            "content": {"text/plain": {"schema": STR}}}}),
    ("GET", "/v1/openapi.json"): _op("This document", {"200": _json({"type": "object"}, "OpenAPI 3.1")}),
}
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

# When the machine runs short (omnid.supervisor.resources): every submit path (the OpenAI ones too,
# in OpenAI's error shape there) and DELETE may answer 507; any request may answer 503
# too_many_connections past the open-files limit.
_RETRY_AFTER = {"Retry-After": {"schema": INT, "description": "seconds to wait before trying again"}}
RESOURCE_RESPONSES: dict[str, Any] = {
    "InsufficientStorage": {**_json(ref("Error"), f"{ErrorCode.INSUFFICIENT_STORAGE}: the state dir is under "
                                    "daemon.min_free_mb (or min_free_inodes), or the job store cannot write; "
                                    "the job was not accepted"), "headers": _RETRY_AFTER},
    "TooManyConnections": {**_json(ref("Error"), f"{ErrorCode.TOO_MANY_CONNECTIONS}: more client connections "
                                   "than the daemon's open-files limit leaves room for (the connection is closed)"),
                           "headers": _RETRY_AFTER},
}
_SUBMIT_PATHS = {("POST", "/v1/jobs"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                 ("POST", "/v1/images/generations"), ("POST", "/v1/audio/speech"), ("DELETE", "/v1/jobs/{id}")}


def _with_resource_refusals(method: str, path: str, op: dict[str, Any]) -> dict[str, Any]:
    """`op` with the answers of a machine that runs short: 503 (connections) everywhere, 507 on submits."""
    extra: dict[str, Any] = {}
    if (method, path) in _SUBMIT_PATHS:
        extra["507"] = {"$ref": "#/components/responses/InsufficientStorage"}
    if "503" not in op["responses"]:
        extra["503"] = {"$ref": "#/components/responses/TooManyConnections"}
    if (method, path) in _SUBMIT_PATHS and method == "POST":     # a caller's trace context, joined
        op = {**op, "parameters": [*op.get("parameters", []), *_TRACE_PARAMETERS]}
    return {**op, "responses": {**op["responses"], **extra}}


# ------------------------------------------------------------------ the OpenAI-compatible paths and the keys
# Their bodies are described by the models that check them (each beside its endpoint in openai/, on
# common.py's RequestBody: a field refused is described by what it takes; the component schemas are
# openapi_schemas.py's); their errors in OpenAI's shape. What they answer is OpenAI's own schema (tests
# validate it against OpenAI's published document); here it is described by its main fields.

_OPENAI_ERROR = {"$ref": "#/components/responses/OpenAIError"}


def _openai_op(summary: str, responses: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, **extra, "responses": {**responses, "default": _OPENAI_ERROR}}


def _body(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def config_operations(config: Config) -> dict[tuple[str, str], dict[str, Any]]:
    """The operations whose description depends on the config: the OpenAI paths (their models),
    a stage log's replicas, and the key commands."""
    json_or_sse = {"application/json": {"schema": {"type": "object"}},
                   "text/event-stream": {"schema": {**STR, "description": "with stream: true, server-sent events "
                                                                           "ending with data: [DONE]"}}}
    replicas = max((st.replicas for st in config.stages.values()), default=1)
    stage_logs = dict(OPERATIONS[("GET", "/v1/stages/{name}/logs")])
    stage_logs["parameters"] = [*stage_logs["parameters"][:-1], _query(
        "replica", {"type": "integer", "minimum": 0, "maximum": replicas - 1},
        "which replica (0 by default); less than the stage's `replicas`")]
    return {
        ("GET", "/v1/stages/{name}/logs"): stage_logs,
        ("GET", "/v1/models"): _openai_op("The pipelines, as OpenAI models", {"200": _json(ref("ModelList"),
                                                                                          "the models")}),
        ("GET", "/v1/models/{model}"): _openai_op(
            "One pipeline as a model (404 model_not_found)", {"200": _json(ref("Model"), "the model")},
            parameters=[_path_param("model", "a pipeline's name")]),
        ("POST", "/v1/chat/completions"): _openai_op(
            "A chat, answered by a text-ending pipeline (one job)", {"200": {"description": "a chat.completion, "
                                                                             "or its chunks", "content": json_or_sse}},
            requestBody=_body(ref("ChatCompletionRequest"))),
        ("POST", "/v1/completions"): _openai_op(
            "A completion, answered by a text-ending pipeline (one job)",
            {"200": {"description": "a text_completion, or its chunks", "content": json_or_sse}},
            requestBody=_body(ref("CompletionRequest"))),
        ("POST", "/v1/images/generations"): _openai_op(
            "An image, drawn by an image-ending pipeline (one job)",
            {"200": _json(obj({"created": INT, "data": {"type": "array", "items": obj(
                {"b64_json": STR, "revised_prompt": STR}, ["b64_json"])}}, ["created", "data"]), "the image")},
            requestBody=_body(ref("ImageRequest"))),
        ("POST", "/v1/audio/speech"): _openai_op(
            "Speech, by an audio-ending pipeline (one job), streamed as it is produced",
            {"200": {"description": "a WAV file, sent as it is produced",
                     "content": {"audio/wav": {"schema": {"type": "string", "format": "binary"}}}}},
            requestBody=_body(ref("SpeechRequest"))),
        ("GET", "/v1/realtime"): _openai_op(
            "OpenAI's Realtime API: a WebSocket session holding a conversation with a pipeline (each response "
            "one job)",
            {"101": {"description": "switched to a WebSocket: OpenAI's realtime client and server events (JSON "
                                    "text frames); a refusal (unknown model, too many sessions, a wrong key) is "
                                    "an `error` event and a close"}},
            parameters=[{**_query("model", {**STR, "enum": sorted(config.pipelines)}, "the pipeline to talk to"),
                         "required": True}]),
        ("GET", "/v1/keys"): _op("The API keys of the TCP listener (root or daemon.admin_group, on the socket only)",
                                 {"200": _json(ref("ApiKeyList"), "the keys, never their secrets")}),
        ("POST", "/v1/keys"): _op(
            "A new API key (root or daemon.admin_group, on the socket only); the answer shows it this once",
            {"201": _json(ref("NewApiKey"), "the key")}, requestBody=_body(ref("KeyRequest"))),
        ("DELETE", "/v1/keys/{name}"): _op(
            "Remove an API key: its next request gets 401", {"200": _json(obj({"removed": STR}, ["removed"]),
                                                                          "removed")},
            parameters=[_path_param("name", "the key's name")]),
    }


def _fallback(route: web.AbstractRoute) -> dict[str, Any]:
    """A route this module has no schema for: listed, described by its handler's docstring."""
    doc = (getattr(route.handler, "__doc__", None) or "").strip()
    summary = doc.splitlines()[0] if doc else f"{route.method} {route.resource.canonical if route.resource else ''}"
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "success", "content": {"application/json": {"schema": {}}}}, "default": _ERROR}}
    if doc:
        op["description"] = doc
    params = [p.strip("{}").split(":")[0] for p in (route.resource.canonical if route.resource else "").split("/")
              if p.startswith("{")]
    if params:
        op["parameters"] = [_path_param(p, p) for p in params]
    return op


def routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD routes that mirror a GET left out."""
    found: list[tuple[str, str]] = []
    for route in app.router.routes():
        if route.resource is None or route.method.lower() not in _METHODS:
            continue
        found.append((route.method.upper(), route.resource.canonical))
    gets = {path for method, path in found if method == "GET"}
    return [(m, p) for m, p in found if not (m == "HEAD" and p in gets)]


def openapi_document(app: web.Application, config: Config, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route of `app`."""
    paths: dict[str, dict[str, Any]] = {}
    by_key = {(r.method.upper(), r.resource.canonical): r for r in app.router.routes() if r.resource is not None}
    known = {**OPERATIONS, **config_operations(config)}
    for method, path in routes(app):
        op = known.get((method, path)) or _fallback(by_key[(method, path)])
        paths.setdefault(path, {})[method.lower()] = _with_resource_refusals(method, path, op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "omnid", "version": version,
                 "description": "The omnid socket API: HTTP/1.1 + JSON over the daemon's Unix socket."},
        "servers": [{"url": "http://omnid", "description": "the daemon's Unix socket (curl --unix-socket PATH)"}],
        "paths": paths,
        "components": {
            "schemas": {**schemas(config), **openai_schemas(), **openai_request_schemas(config)},
            "responses": {"Error": _json(ref("Error"), "refused: {\"error\": {\"code\", \"message\"}}"),
                          "OpenAIError": _json(ref("OpenAIError"), "refused, in OpenAI's shape: {\"error\": "
                                               "{\"message\", \"type\", \"param\", \"code\"}}"),
                          **RESOURCE_RESPONSES},
        },
    }
