"""What the OpenAI paths share up to a request's job: a request read and made into one ordinary omnid
job of the caller's. Each endpoint's file (chat.py, completions.py, images.py, speech.py, realtime/)
has its own body's model, on `RequestBody` here, and its own serving; once its job exists, jobs.py
follows it into the answer.

- Errors: OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, raised as an
  `OpenAiError` and answered so by the `openai_errors` middleware, whatever failed under it (the TCP
  door, access.py, refuses in this shape on these paths; realtime/ says it as an `error` event).
- A body: parsed and checked by its pydantic model (`RequestBody.parse`: every problem of its shape at
  once, in omnid's words, the first one's field as OpenAI's `param`), which is also the OpenAPI
  document's schema of it (openapi_schemas.py reads `model_json_schema`). Pydantic's own words never
  reach a caller: each field that can be wrong has its message (`RequestBody.MESSAGES`, by the field's
  path), and any other problem is said by `_plain`. Its `model` and vLLM's `priority` are kept on the
  request for the job it makes (`read_body`); the sampling fields become the token stage's params, by
  that stage's rules (`sampling`); a chat's media parts its job's inputs (`media_inputs`).
- The model: a pipeline's name, or `PIPELINE:ADAPTER` for one of its LoRA adapters (`find_pipeline`),
  checked to give the answer its endpoint needs (`pipeline_for`).
- The job: `submit`, after admission's checks (admission.py, which every front end asks), taken by the
  socket API (`ApiCore.take`); a text job's answer counted as its events come (`Generation`).

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application; reading the
body is the only await. Nothing of the engines is imported (no tokenizer in the supervisor but the
prompt's count, omnid/prompt_length.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar

import structlog
from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from omnid import media as M
from omnid import prompt_length
from omnid.config import Config, PipelineConfig
from omnid.engines.capabilities import capabilities, engines_that, job_param_problem, param_schema, values_problem
from omnid.lora import adapter_stage, pipeline_adapters
from omnid.params import merged
from omnid.store import JobStore
from omnid.supervisor.errors import Refused, retry_after
from omnid.supervisor.http import admission
from omnid.supervisor.http.admission import CheckedBody, Said, fixed, json_body, shown
from omnid.supervisor.jobs.submission import Submission
from omnid.vocabulary import ErrorCode, Event, EventType, JobRecord

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.openai")

OPENAI_PATHS = ("/v1/models", "/v1/chat/", "/v1/completions", "/v1/images/", "/v1/audio/", "/v1/realtime")


class OpenAiError(Exception):
    """A request refused or failed, answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry: bool | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _error_type(status)
        self.retry = retry
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        headers = retry_after(self.status, self.retry_after_s)
        if self.retry is not None:                  # the openai client library honours this header
            headers["x-should-retry"] = "true" if self.retry else "false"
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status, headers=headers)


def _error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def bad(param: str | None, message: str, code: str | None = None) -> OpenAiError:
    """A 400: the request's field `param` is wrong."""
    return OpenAiError(400, message, param, code)


def error_event(e: OpenAiError) -> dict[str, Any]:
    """A job that ended badly, said inside a stream already under way (as OpenAI's servers do)."""
    return {"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}}


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Errors on the OpenAI paths in OpenAI's shape (inside the API's own error middleware)."""
    if not request.path.startswith(OPENAI_PATHS):
        return await handler(request)
    try:
        return await handler(request)
    except OpenAiError as e:
        return e.response()
    except Refused as e:
        param = e.extra.get("input")
        return OpenAiError(e.status, e.message, param=param if isinstance(param, str) else None,
                           code=str(e.code), retry_after_s=e.extra.get("retry_after_s")).response()
    except web.HTTPRequestEntityTooLarge:
        return OpenAiError(413, "the request body is too large (daemon.max_request_bytes)", code="too_large").response()
    except web.HTTPNotFound:
        return OpenAiError(404, f"no such endpoint: {request.method} {request.path}", code="not_found").response()
    except web.HTTPMethodNotAllowed as e:
        resp = OpenAiError(405, f"{request.method} is not allowed on {request.path}; use "
                           f"{', '.join(sorted(e.allowed_methods))}", code="method_not_allowed").response()
        resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        return resp
    except web.HTTPException as e:
        return OpenAiError(e.status, e.reason, code="http_error").response()
    except ConnectionError as e:            # the caller hung up (its job is cancelled): nobody to answer
        log.debug("the caller went away", method=request.method, path=request.path, error=str(e))
        return web.Response(status=499)
    except Exception as e:
        log.exception("request failed", method=request.method, path=request.path)
        return OpenAiError(500, f"the daemon failed on this request: {type(e).__name__}: {e}",
                           code="internal_error").response()


# ------------------------------------------------------------------ a request's body: its shape, read, its sampling

# OpenAI's sampling fields, then the extensions vLLM's own server takes in the same body (`vllm bench
# serve` sends ignore_eos): the token stage's params (max_completion_tokens sets its max_tokens).
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
            "frequency_penalty", "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos")
PRIORITY_SCHEMA = {"type": "integer", "minimum": -1_000_000, "maximum": 1_000_000,
                   "description": "lower runs earlier (0 by default, as in vLLM); more urgent than the owner's "
                                  "max_priority (daemon.owners; 0 unless configured, root on the socket: any): 403 "
                                  "priority_not_allowed"}
_NULL = {"type": "null"}

B = TypeVar("B", bound="RequestBody")


def _maybe(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def checked_later(schema: Mapping[str, Any]) -> Any:
    """A field (null by default) described as `schema`, its value checked by a rule of its own: the
    token stage's sampling params and the body's `priority` later, by the config's rules."""
    return Field(None, json_schema_extra=_maybe(schema))


def _one(value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or value != 1):
        raise ValueError("not 1")
    return value


One = Annotated[Any, AfterValidator(_one)]     # `n`, `best_of`: 1 (1.0 too: JSON's one) or null


_SAMPLER = engines_that(lambda e: e.sampling)[0]        # (the engine whose params the sampling fields set)


def _sampling(name: str) -> Any:
    return checked_later(param_schema(_SAMPLER, "max_tokens" if name == "max_completion_tokens" else name))


class RequestBody(CheckedBody):
    """A request body: its fields checked strictly (a string is no number, "true" no boolean); fields
    omnid does not know are ignored, as OpenAI's clients send some. Each names its `model` (a pipeline:
    the handler looks it up) and may give vLLM's `priority`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    ANSWER: ClassVar[str] = "text"          # what the model named must give (its schema lists those)
    MESSAGES: ClassVar[Said] = {
        ("model",): (fixed("you must provide a model parameter (a pipeline's name)"), None),
    }

    model: Annotated[str, Field(min_length=1)]
    priority: Any = checked_later(PRIORITY_SCHEMA)     # (read_body reads it: admission.priority)

    @classmethod
    def parse(cls: type[B], body: Mapping[str, Any]) -> B:
        """The body as this model; OpenAiError 400 saying each problem, the first one's field as `param`."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            said = cls.problems(e, body)
            raise bad(said[0][0], "; ".join(dict.fromkeys(message for _, message in said))) from None


# ------------------------------------------------------------------ what /v1/chat/completions and /v1/completions share


class StreamOptions(BaseModel):
    """With stream: true, whether the last chunk carries the usage."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


class TextBody(RequestBody):
    n: One = checked_later({"const": 1})
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Any = _sampling("max_tokens")
    max_completion_tokens: Any = _sampling("max_completion_tokens")
    temperature: Any = _sampling("temperature")
    top_p: Any = _sampling("top_p")
    stop: Any = _sampling("stop")
    seed: Any = _sampling("seed")
    presence_penalty: Any = _sampling("presence_penalty")
    frequency_penalty: Any = _sampling("frequency_penalty")
    top_k: Any = _sampling("top_k")
    min_p: Any = _sampling("min_p")
    min_tokens: Any = _sampling("min_tokens")
    repetition_penalty: Any = _sampling("repetition_penalty")
    ignore_eos: Any = _sampling("ignore_eos")

    MESSAGES: ClassVar[Said] = {
        **RequestBody.MESSAGES,
        ("n",): (lambda at, v: f"n must be 1 here (one job, one answer), not {shown(v)}", None),
        ("stream",): (fixed("stream must be true or false"), None),
        ("stream_options",): (fixed("stream_options must be an object"), None),
        ("stream_options", "include_usage"): (fixed("stream_options.include_usage must be true or false"),
                                              "stream_options"),
    }

    def stream_flags(self) -> tuple[bool, bool]:
        """(stream, include_usage); stream_options is only for a stream."""
        if self.stream_options is not None and not self.stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        return bool(self.stream), bool(self.stream_options and self.stream_options.include_usage)

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields given (not null), by their OpenAI names."""
        return {name: value for name in SAMPLING if (value := getattr(self, name)) is not None}


MODEL_KEY = "openai_model"              # request key: the body's `model` (a `PIPELINE:ADAPTER` sets the adapter)
PRIORITY_KEY = "openai_priority"        # request[...]: the body's `priority`, for the job it makes


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; its `model` and `priority` noted on the request for its job."""
    try:
        body = await json_body(request)
    except Refused as e:
        raise OpenAiError(e.status, e.message, code=str(e.code)) from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    request[MODEL_KEY] = body.get("model")
    # vLLM's extra field `priority` (lower runs earlier): the job's, on every path that makes one
    request[PRIORITY_KEY] = admission.priority(body.get("priority"))
    return body


def sampling(config: Config, p: PipelineConfig, given: Mapping[str, Any],
             extra: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The OpenAI sampling fields `given` (by their names: `TextBody.sampling_values`) as the token
    stage's params, each checked by omnid's rules."""
    stage = admission.token_stage(config, p)
    if stage is None:
        return {}                   # no stage that samples: nothing to sample (the fields are ignored)
    engine, defaults = config.stages[stage].engine, config.stages[stage].defaults
    values: dict[str, Any] = {}
    for name in SAMPLING:
        key = "max_tokens" if name == "max_completion_tokens" else name     # (which wins: it comes later)
        value = given.get(name)
        if value is None or (name == "stop" and value == []):
            continue
        why = job_param_problem(stage, engine, defaults, key, value)
        if why is not None:
            raise bad(name, f"{name}: {why}")
        values[key] = value
    why = values_problem(stage, engine, merged(defaults, values))
    if why is not None:
        raise bad("max_tokens", why)
    if capabilities(engine).context_window:     # beyond the context window: 400, as `vllm serve` answers
        name = "max_completion_tokens" if given.get("max_completion_tokens") is not None else "max_tokens"
        why = prompt_length.max_tokens_problem(config.stages[stage], values.get("max_tokens"), name)
        if why is not None:
            raise bad(name, why)
    values.update(extra)
    return {stage: values}


def media_inputs(config: Config, p: PipelineConfig, messages: str,
                 parts: list[tuple[str, bytes, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat with media parts as a job's inputs: `messages`, and `image` / `audio` lists in the
    order of their parts. Each part is checked against the limits of the stage that takes the
    chat (400 naming the part), then the whole as any job's inputs are."""
    stage = admission.media_stage(config, p)
    inputs: dict[str, Any] = {"messages": messages}
    summary: dict[str, Any] = {"messages": admission.text_summary(messages)}
    for kind, data, where in parts:
        limits = stage.media if stage is not None else M.NO_MEDIA
        items = inputs.setdefault(kind, [])
        if not limits.count(kind):
            raise bad(where, f"model {p.name!r} takes no {kind} input (the media it takes: "
                             f"{', '.join(limits.kinds) or 'none'})", "media_not_accepted")
        if len(items) >= limits.count(kind):
            raise bad(where, f"model {p.name!r} takes at most {limits.count(kind)} {kind} item(s) per request",
                      ErrorCode.INVALID_MEDIA)
        try:
            (doc,) = M.check_media(kind, data, limits)
        except M.MediaError as e:
            raise bad(where, f"{where}: {e}", ErrorCode.INVALID_MEDIA) from None
        items.append(data)
        summary.setdefault(kind, []).append({"filename": None, "size": len(data), **doc})
    try:
        admission.check_inputs(config, inputs, summary, p)
    except Refused as e:
        raise bad("messages", e.message, str(e.code)) from None
    return inputs, summary


# ------------------------------------------------------------------ the model named

# What each kind of answer is asked on (a model's `omnid.endpoints`).
ENDPOINTS = {"text": ["/v1/chat/completions", "/v1/completions"], "image": ["/v1/images/generations"],
             "audio": ["/v1/audio/speech"]}


def find_pipeline(config: Config, name: Any) -> PipelineConfig:
    """The pipeline a `model` names: a pipeline's name, or `PIPELINE:ADAPTER`, one of the adapters
    of the pipeline's adapter stage (`adapter_stage`)."""
    if not isinstance(name, str) or not name:
        raise bad("model", "you must provide a model parameter (a pipeline's name)")
    p = config.pipelines.get(name)
    if p is None and ":" in name:
        base, _, adapter = name.rpartition(":")
        p = config.pipelines.get(base)
        known = pipeline_adapters(config, p) if p is not None else []
        if p is not None and adapter not in known:
            raise OpenAiError(404, f"The model `{name}` does not exist: pipeline {base!r} has no adapter {adapter!r} "
                              f"(its adapters: {', '.join(known) or 'none'})", "model", ErrorCode.MODEL_NOT_FOUND)
    if p is None:
        raise OpenAiError(404, f"The model `{name}` does not exist (the pipelines: "
                          f"{', '.join(sorted(config.pipelines))})", "model",
                          ErrorCode.MODEL_NOT_FOUND)
    return p


def pipeline_for(config: Config, store: JobStore, asked: RequestBody, *kinds: str) -> PipelineConfig:
    """The pipeline the request's `model` names (looked up once), if it produces each of `kinds` (or
    may: a last stage whose engine declares no answer, untried)."""
    p = find_pipeline(config, asked.model)
    produces = admission.answers(config, store, p)
    for kind in kinds:
        if produces is not None and kind not in produces:
            raise bad("model", f"model {p.name!r} produces {', '.join(produces) or 'nothing'}, not {kind}; "
                      f"{ENDPOINTS[kind][0]} needs a pipeline that ends in {kind}",
                      ErrorCode.MODEL_NOT_SUPPORTED)
    return p


# ---------------------------------------------------------------------------- LoRA adapters as models
# As `vllm serve --lora-modules` lists them: each adapter is a model of its own, `PIPELINE:ADAPTER`,
# whose `parent` is the pipeline; a request for it is the pipeline's job with the adapter stage's
# `adapter` set.


def adapter_choice(config: Config, p: PipelineConfig, model: Any) -> tuple[str, str] | None:
    """(stage, adapter) that a `model` of `PIPELINE:ADAPTER` asks for, `p` being the pipeline
    `find_pipeline` gave for it (not looked up again); None for the plain pipeline."""
    if not isinstance(model, str) or model == p.name or ":" not in model:
        return None
    base, _, adapter = model.rpartition(":")
    stage = adapter_stage(config, p) if base == p.name else None
    if stage is None or adapter not in config.stages[stage].adapters:
        return None
    return stage, adapter


# ------------------------------------------------------------------ the job

JOB_KEY = "openai_job"                  # request keys: the job, for the answer's X-Omnid-Job header,
CONTENT_TYPE_KEY = "openai_ctype"       # and what a streamed output of unknown type is sent as
WAIT_KEY = "openai_wait"                # and a waiting stream's place (jobs.py: `on_prepare`)


def submit(api: ApiCore, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
           params: dict[str, dict[str, Any]], summary: dict[str, Any]) -> JobRecord:
    """An ordinary job of the caller's (what `POST /v1/jobs` does after its checks); a `model`
    `PIPELINE:ADAPTER` sets the pipeline's adapter stage's `adapter`."""
    chosen = adapter_choice(api.config, p, request.get(MODEL_KEY))
    if chosen is not None:
        stage, adapter = chosen
        params = {**params, stage: {**params.get(stage, {}), "adapter": adapter}}
    sub = admission.owned(api.config, Submission(p, inputs, params, summary, request["uid"],
                                                 priority=request.get(PRIORITY_KEY, 0)),
                          request.get("api_key"), not request.get("tcp"))
    job = api.take(sub, "the daemon is stopping; try again once it is back", request)
    request[JOB_KEY] = job.id
    request[WAIT_KEY] = api.scheduler.gate.waiting(job.id)
    log.info("audit", action="submit", uid=request["uid"], job=job.id, pipeline=p.name, via=request.path)
    return job


@dataclass
class Generation:
    """What a text job produced so far, from its events."""

    text_stage: str                 # whose segments are the answer
    token_stage: str | None         # the vLLM stage whose progress counts the tokens
    pieces: list[str] = field(default_factory=list)
    segments: int = 0
    tokens: int | None = None
    max_tokens: int | None = None
    prompt_tokens: int = 0          # what the vLLM stage counted (its stage_finished event's usage)
    finished_by: str | None = None  # the vLLM stage's own finish_reason (its last segment, its stage_finished event)
    ends_job: bool = False          # no stage follows the text stage: its last segment ends the answer
    text_done: bool = False         # the text stage's last segment came

    @property
    def completion_tokens(self) -> int:
        return self.tokens if self.tokens is not None else self.segments

    @property
    def finish_reason(self) -> str:
        """OpenAI's (and vLLM's): "length" when max_tokens or the context window cut the answer, else
        "stop". The engine's own word when it said one; else max_tokens reached."""
        if self.finished_by in ("stop", "length"):
            return self.finished_by
        return "length" if self.max_tokens is not None and self.completion_tokens >= self.max_tokens else "stop"


def generation(config: Config, p: PipelineConfig) -> Generation:
    """A text job's answer so far: its text stage's segments, its token stage's counts."""
    text = admission.text_stage(config, p)
    if text is None:
        raise bad("model", f"model {p.name!r} does not end in text", ErrorCode.MODEL_NOT_SUPPORTED)
    ends = [s for s in p.stages if not p.outgoing(s)]      # (every other stage leads to it)
    return Generation(text, admission.token_stage(config, p), ends_job=ends == [text])


def take(ev: Event, gen: Generation) -> str | None:
    """What one event says of the generation: its counts into `gen`, a text segment's text out."""
    stage = ev.get("stage")
    if ev["type"] == EventType.PROGRESS and stage == gen.token_stage:
        gen.tokens, gen.max_tokens = ev["done"], ev["total"]
    elif ev["type"] == EventType.STAGE_FINISHED and stage == gen.token_stage:
        if ev.get("usage"):
            gen.prompt_tokens = int(ev["usage"].get("prompt_tokens") or 0)
        if isinstance(ev.get("finish_reason"), str):
            gen.finished_by = ev["finish_reason"]
    elif ev["type"] == EventType.SEGMENT and stage == gen.text_stage:
        gen.segments += 1
        if ev.get("is_last"):
            gen.text_done = True
            if isinstance(ev.get("finish_reason"), str):
                gen.finished_by = ev["finish_reason"]
        return ev.get("text") or None
    return None


def usage(gen: Generation) -> dict[str, int]:
    """The vLLM stage's own count of the prompt's tokens (0 when the answer came from no vLLM stage)."""
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}
