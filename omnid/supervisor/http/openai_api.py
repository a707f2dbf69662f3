"""OpenAI-compatible endpoints on the daemon's socket (and its TCP listener); each request is one ordinary omnid job.

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application (the
daemon mounts it: `OpenAiApi(api).mount(api.app)`). Handlers never block: they submit a job through the
scheduler, wait on the job's event queue (an asyncio queue; whether the caller hung up is looked at
after every event and after every quiet DISCONNECT_POLL_S, so a hang-up cancels the job however fast
its events flow) and read small output files in the loop's default executor. Speech streams
through the API's own `?stream=1` helper (`http_common.stream_output`). A request's checks are
admission's (admission.py), in OpenAI's words where the OpenAI shape has its own.

- `GET /v1/models`, `GET /v1/models/{model}`: the pipelines as models (`omnid.outputs`: what each
  produces: `text` for a vLLM last stage, `image` for diffusers; for a python last stage, the kinds
  of outputs its latest successful job had, null before it has one; `omnid.media`: the media its
  chats may hold, `image`, `audio`, `video`).
- `POST /v1/chat/completions`, `POST /v1/completions`: pipelines that end in text. A chat's
  messages are one job input `messages` (JSON text), which the vLLM stage renders with its
  tokenizer's chat template; the answer is the text segments of the text-producing last stage.
  A chat's media parts (`image_url` with a data: URL, `input_audio`) become the job's `image` and
  `audio` inputs, in order, and `{"type": "image"}` / `{"type": "audio"}` parts in its messages,
  where the model's template puts its placeholders; they are checked like any job's media.
- `POST /v1/images/generations`: pipelines that end in an image (`b64_json` only).
- `POST /v1/audio/speech`: pipelines that end in audio (`wav` only), streamed as it is produced.

Each job belongs to the caller's uid and shows in `GET /v1/jobs` like any other; a caller that goes
away before its job ended cancels it. The answers carry the job's id in `X-Omnid-Job`. Errors on
these paths are OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Nothing of the engines is imported here (no tokenizer in the supervisor).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import structlog
from aiohttp import web

from omnid import media as M
from omnid.config import Config, PipelineConfig
from omnid.engines.capabilities import job_param_problem, values_problem
from omnid.params import merged
from omnid.supervisor.http import admission
from omnid.supervisor.jobs.submission import Submission
from omnid.supervisor.http.api import retry_after
from omnid.supervisor.errors import Refused
from omnid.supervisor.http.http_common import DISCONNECT_POLL_S as DISCONNECT_POLL_S    # (re-exported)
from omnid.supervisor.http.http_common import (follow, follow_batches, json_body, output_file, sse_done,
                                          sse_response, sse_send, stream_output)
from omnid.lora import adapter_stage, pipeline_adapters
from omnid.vocabulary import ErrorCode, EventType, JobRecord, JobState
from omnid.worker.outputs import STREAM_DIR

if TYPE_CHECKING:
    from omnid.store import JobStore
    from omnid.supervisor.http.api import Api
    from omnid.supervisor.jobs.scheduler import Scheduler

log = structlog.get_logger("omnid.openai")

OPENAI_PATHS = ("/v1/models", "/v1/chat/", "/v1/completions", "/v1/images/", "/v1/audio/", "/v1/realtime")
JOB_HEADER = "X-Omnid-Job"
_MODEL_KEY = "openai_model"             # request key: the body's `model` (a `PIPELINE:ADAPTER` sets the adapter)
_JOB_KEY = "openai_job"                 # request keys: the job, for the answer's X-Omnid-Job header,
_PRIORITY_KEY = "openai_priority"        # request[...]: the body's `priority`, for the job it makes
_CONTENT_TYPE_KEY = "openai_ctype"      # and what a streamed output of unknown type is sent as
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
# OpenAI sampling fields -> the vLLM stage's params (max_completion_tokens wins over max_tokens); then
# the extensions vLLM's own server takes in the same body (`vllm bench serve` sends ignore_eos).
_SAMPLING = (("max_tokens", "max_tokens"), ("max_completion_tokens", "max_tokens"),
             ("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop"), ("seed", "seed"),
             ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
             ("top_k", "top_k"), ("min_p", "min_p"), ("min_tokens", "min_tokens"),
             ("repetition_penalty", "repetition_penalty"), ("ignore_eos", "ignore_eos"))
_ENDPOINTS = {"text": ["/v1/chat/completions", "/v1/completions"], "image": ["/v1/images/generations"],
              "audio": ["/v1/audio/speech"]}


class OpenAiError(Exception):
    """A request refused or failed, answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _error_type(status)
        self.retry = retry

    def response(self) -> web.Response:
        headers = retry_after(self.status)
        if self.retry is not None:                  # the openai client library honours this header
            headers["x-should-retry"] = "true" if self.retry else "false"
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status, headers=headers)


def _error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def _bad(param: str | None, message: str, code: str | None = None) -> OpenAiError:
    return OpenAiError(400, message, param, code)


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
                           code=str(e.code)).response()
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


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer on these paths names its job; a streamed output of unknown type gets its type."""
    if not request.path.startswith(OPENAI_PATHS):
        return
    job = request.get(_JOB_KEY)
    if job is not None:
        response.headers[JOB_HEADER] = str(job)
    ctype = request.get(_CONTENT_TYPE_KEY)
    if ctype is not None and response.content_type == "application/octet-stream":
        response.content_type = str(ctype)


@dataclass
class _Generation:
    """What a text job produced so far, from its events."""

    text_stage: str                 # whose segments are the answer
    token_stage: str | None         # the vLLM stage whose progress counts the tokens
    pieces: list[str] = field(default_factory=list)
    segments: int = 0
    tokens: int | None = None
    max_tokens: int | None = None
    prompt_tokens: int = 0          # what the vLLM stage counted (its stage_finished event's usage)

    @property
    def completion_tokens(self) -> int:
        return self.tokens if self.tokens is not None else self.segments

    @property
    def finish_reason(self) -> str:
        return "length" if self.max_tokens is not None and self.completion_tokens >= self.max_tokens else "stop"


def _take(ev: dict[str, Any], gen: _Generation) -> str | None:
    """What one event says of the generation: its counts into `gen`, a text segment's text out."""
    stage = ev.get("stage")
    if ev["type"] == EventType.PROGRESS and stage == gen.token_stage:
        gen.tokens, gen.max_tokens = int(ev["done"]), int(ev["total"])
    elif ev["type"] == EventType.STAGE_FINISHED and stage == gen.token_stage and ev.get("usage"):
        gen.prompt_tokens = int(ev["usage"].get("prompt_tokens") or 0)
    elif ev["type"] == EventType.SEGMENT and stage == gen.text_stage:
        gen.segments += 1
        return ev.get("text") or None
    return None


class OpenAiApi:
    """The OpenAI-shaped handlers, on the `Api`'s collaborators (config, store, scheduler, info)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def mount(self, app: web.Application) -> None:
        app.middlewares.append(openai_errors)
        app.on_response_prepare.append(_on_prepare)
        app.add_routes([
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model}", self.get_model),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/images/generations", self.images),
            web.post("/v1/audio/speech", self.speech),
        ])

    # ------------------------------------------------------------------ models

    async def list_models(self, request: web.Request) -> web.Response:
        api = self.api
        data = []
        for p in api.config.pipelines.values():
            data.append(_model(api.config, api.store, api.info.started, p))
            data += [adapter_model(api.config, api.info.started, p, name) for name in pipeline_adapters(api.config, p)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        p = _find(self.api.config, name)
        if name != p.name:
            return web.json_response(adapter_model(self.api.config, self.api.info.started, p, name.rpartition(":")[2]))
        return web.json_response(_model(self.api.config, self.api.store, self.api.info.started, p))

    def _pipeline(self, body: dict[str, Any], *kinds: str) -> PipelineConfig:
        """The pipeline named by `model` (looked up once), if it produces each of `kinds` (or may: a
        last stage whose engine declares no answer, untried)."""
        p = _find(self.api.config, body.get("model"))
        produces = admission.answers(self.api.config, self.api.store, p)
        for kind in kinds:
            if produces is not None and kind not in produces:
                raise _bad("model", f"model {p.name!r} produces {', '.join(produces) or 'nothing'}, not {kind}; "
                           f"{_ENDPOINTS[kind][0]} needs a pipeline that ends in {kind}",
                           str(ErrorCode.MODEL_NOT_SUPPORTED))
        return p

    # ------------------------------------------------------------------ text

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        _refuse_chat_features(body)
        audio = _audio_request(body)
        p = self._pipeline(body, "text", *(["audio"] if audio is not None else []))
        stream, include_usage = _common(body)
        messages, parts = _messages(body.get("messages"))
        params = _sampling(self.api.config, p, body, {"include_prompt": False})
        if not parts:
            inputs, summary = admission.inputs(self.api.config, {"messages": json.dumps(messages)}, p)
        else:
            inputs, summary = _media_inputs(self.api.config, p, json.dumps(messages), parts)
        if audio is not None:
            return await self._audio_chat(request, p, inputs, params, summary, stream, include_usage, audio)
        return await self._text_job(request, p, inputs, params, summary, stream, include_usage, chat=True, echo="")

    # ------------------------------------------------------------------ audio chat

    async def _audio_chat(self, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
                          params: dict[str, dict[str, Any]], summary: dict[str, Any], stream: bool,
                          include_usage: bool, fmt: str) -> web.StreamResponse:
        """A chat answered in text and speech, as OpenAI answers one: `message.audio` = {id, data
        (base64), expires_at, transcript}, the text being the transcript (`content` is null); streamed,
        `delta.audio` pieces: the transcript as it grows and the PCM16 as it is made."""
        gen = _generation(self.api.config, p)
        job = self._submit(request, p, inputs, params, summary)
        head = {"id": "chatcmpl-" + job.id, "object": "chat.completion", "created": int(job.created_at),
                "model": p.name}
        audio_id = "audio_" + job.id
        expires = int(job.created_at) + AUDIO_EXPIRES_S
        try:
            if stream:
                return await self._stream_audio_chat(request, job, gen, head, include_usage, audio_id, expires)
            transcript = "".join([piece async for piece in self._deltas(request, job, gen)])
            record = _succeeded(self.api.scheduler, job.id)
            out = next((o for o in record.outputs if o["kind"] == "audio"), None)
            if out is None:
                raise OpenAiError(500, f"job {job.id} of model {p.name!r} ended with no audio output",
                                  code=str(ErrorCode.INTERNAL_ERROR))
            data = _wav_bytes(await _read(self.api.store, record, out))
            if fmt == "pcm16":
                data = data[WAV_HEADER_BYTES:]
            message = {"role": "assistant", "content": None, "refusal": None,
                       "audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii"),
                                 "expires_at": expires, "transcript": transcript}}
            choice = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason, "message": message}
            return web.json_response({**head, "choices": [choice], "usage": _usage(gen)})
        finally:
            self._abandon(request, job.id)

    async def _stream_audio_chat(self, request: web.Request, job: JobRecord, gen: _Generation,
                                 head: dict[str, Any], include_usage: bool, audio_id: str,
                                 expires: int) -> web.StreamResponse:
        head = {**head, "object": "chat.completion.chunk"}
        resp = await sse_response(request)
        reader = _LiveAudio(self.api.store.job_dir(job.id))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "delta": delta}],
                    **({"usage": None} if include_usage else {})}

        opening = _Opening(chunk({"role": "assistant", "content": None, "refusal": None}))

        async def pcm_out() -> None:
            data = reader.read()
            if data:
                await sse_send(resp, *opening.take(),
                               chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))

        try:
            await self._sse_answer(request, resp, job, gen, head if include_usage else None,
                                   lambda piece: chunk({"audio": {"id": audio_id, "transcript": piece}}),
                                   lambda: chunk({"audio": {"id": audio_id, "expires_at": expires}}, gen.finish_reason),
                                   on_event=pcm_out, opening=opening)
        except ConnectionError as e:
            log.debug("audio chat stream reader went away", job=job.id, error=str(e))
        finally:
            reader.close()
        return resp

    async def _sse_answer(self, request: web.Request, resp: web.StreamResponse, job: JobRecord, gen: _Generation,
                          usage_head: dict[str, Any] | None, piece: Callable[[str], dict[str, Any]],
                          last: Callable[[], dict[str, Any]],
                          on_event: Callable[[], Awaitable[None]] | None = None,
                          opening: _Opening | None = None) -> None:
        """A streamed answer's tail: a chunk per piece of text (`on_event` awaited at every event and
        once more at the end), the `last` chunk and the usage chunk (when `usage_head`), or the job's
        error said in the stream as OpenAI's servers do; then `[DONE]`. `opening` (a chat's role
        chunk) goes out with the first of them, in the same write."""
        opening = opening or _Opening(None)
        try:
            async for text in self._deltas(request, job, gen, on_event=on_event):
                await sse_send(resp, *opening.take(), piece(text))
            if on_event is not None:
                await on_event()                # the rest, once the job has ended
        except OpenAiError as e:
            await sse_send(resp, *opening.take(), _error_event(e))
        else:
            await sse_send(resp, *opening.take(), last())
            if usage_head is not None:
                await sse_send(resp, {**usage_head, "choices": [], "usage": _usage(gen)})
        await sse_done(resp)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        p = self._pipeline(body, "text")
        stream, include_usage = _common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("prompt", "prompt must be a string (or a list of one string); token arrays and "
                       "batches are not supported")
        for name, ok in (("suffix", None), ("logprobs", None), ("best_of", 1)):
            if body.get(name) not in (None, ok):
                raise _bad(name, f"{name} is not supported here")
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise _bad("echo", "echo must be true or false")
        stage = admission.token_stage(self.api.config, p)
        extra: dict[str, Any] = {"include_prompt": False}
        if stage is not None and self.api.config.stages[stage].defaults.get("prompt_template"):
            extra["prompt_template"] = ""           # a completion continues the prompt as it is
        params = _sampling(self.api.config, p, body, extra)
        inputs, summary = admission.inputs(self.api.config, {"prompt": prompt}, p)
        return await self._text_job(request, p, inputs, params, summary, stream, include_usage, chat=False,
                                    echo=prompt if echo else "")

    async def _text_job(self, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
                        params: dict[str, dict[str, Any]], summary: dict[str, Any], stream: bool,
                        include_usage: bool, chat: bool, echo: str) -> web.StreamResponse:
        gen = _generation(self.api.config, p)
        job = self._submit(request, p, inputs, params, summary)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": kind,
                "created": int(job.created_at), "model": p.name}
        try:
            if stream:
                return await self._stream_text(request, job, gen, head, chat, include_usage, echo)
            text = echo + "".join([piece async for piece in self._deltas(request, job, gen)])
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            return web.json_response({**head, "choices": [choice], "usage": _usage(gen)})
        finally:
            self._abandon(request, job.id)

    async def _stream_text(self, request: web.Request, job: JobRecord, gen: _Generation, head: dict[str, Any],
                           chat: bool, include_usage: bool, echo: str) -> web.StreamResponse:
        """Server-sent events: one chunk per text segment, a last one with `finish_reason`, `[DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        resp = await sse_response(request)

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                choice["delta"] = ({"role": "assistant", "content": "", "refusal": None} if first
                                   else {} if text is None else {"content": text})
            else:
                choice["text"] = text or ""
            return {**head, "choices": [choice], **({"usage": None} if include_usage else {})}

        # A chat's role chunk goes with its first text, as `vllm serve` sends it: a client that
        # times the first chunk (vLLM's benchmark, for one) times the first token, not the POST.
        opening = _Opening(chunk(None, first=True) if chat else None)
        try:
            if echo:
                await sse_send(resp, *opening.take(), chunk(echo))
            await self._sse_answer(request, resp, job, gen, head if include_usage else None, chunk,
                                   lambda: chunk(None, gen.finish_reason), opening=opening)
        except ConnectionError as e:
            log.debug("chat stream reader went away", job=job.id, error=str(e))
        return resp

    async def _deltas(self, request: web.Request, job: JobRecord, gen: _Generation,
                      on_event: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
        """The answer's text as its segments come, what arrived at once joined (one SSE write);
        raises OpenAiError if the job ends badly. A last stage that streamed no text is answered
        with its `text` output once the job ended. `on_event` is awaited at every arrival (an audio
        chat sends the speech made meanwhile)."""
        async with aclosing(follow_batches(request, self.api.scheduler, job.id)) as batches:
            async for batch in batches:
                if on_event is not None:
                    await on_event()
                texts = [text for ev in batch if (text := _take(ev, gen))]
                if texts:
                    text = "".join(texts)
                    gen.pieces.append(text)
                    yield text
        record = _succeeded(self.api.scheduler, job.id)
        if not gen.pieces:
            text_out = _pick(record.outputs, "text", "text", gen.text_stage)
            if text_out is not None:
                text = (await _read(self.api.store, record, text_out)).decode("utf-8", errors="replace")
                if text:
                    gen.pieces.append(text)
                    yield text

    # ------------------------------------------------------------------ images

    async def images(self, request: web.Request) -> web.Response:
        body = await _body(request)
        p = self._pipeline(body, "image")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt", "prompt must be a non-empty string")
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise _bad("n", f"n must be 1 here (one job, one image), not {n!r}")
        if body.get("response_format") not in (None, "b64_json"):
            raise _bad("response_format", "only response_format \"b64_json\" is supported (omnid serves no URLs)")
        if body.get("output_format") not in (None, "png"):
            raise _bad("output_format", "only output_format \"png\" is supported")
        draw = admission.image_stage(self.api.config, p)
        params: dict[str, dict[str, Any]] = {}
        size = body.get("size")
        if size is not None and size != "auto":
            m = _SIZE.match(size) if isinstance(size, str) else None
            if m is None:
                raise _bad("size", f"size must be \"WIDTHxHEIGHT\" (e.g. \"64x64\") or \"auto\", not {size!r}")
            if draw is None:
                raise _bad("size", f"model {p.name!r} has no diffusers stage to set the size of")
            params[draw] = {"width": int(m.group(1)), "height": int(m.group(2))}
            stage = self.api.config.stages[draw]
            for key, value in params[draw].items():
                why = job_param_problem(draw, stage.engine, stage.defaults, key, value)
                if why is not None:
                    raise _bad("size", f"size: {why}")
        inputs, summary = admission.inputs(self.api.config, {admission.prompt_key(self.api.config, p): prompt}, p)
        job = self._submit(request, p, inputs, params, summary)
        try:
            async for _ in follow(request, self.api.scheduler, job.id):
                pass
            record = _succeeded(self.api.scheduler, job.id)
            images = [o for o in record.outputs if o["kind"] == "image"]
            if not images:
                raise OpenAiError(500, f"job {job.id} of {p.name!r} produced no image "
                                  f"(its outputs: {', '.join(o['name'] for o in record.outputs) or 'none'})",
                                  code=str(ErrorCode.NO_IMAGE), retry=False)
            revised_out = _pick(record.outputs, "text", "prompt", None)
            revised = (await _read(self.api.store, record, revised_out)).decode("utf-8", "replace") \
                if revised_out else None
            data = []
            for out in images:
                item = {"b64_json": base64.b64encode(await _read(self.api.store, record, out)).decode("ascii")}
                if revised is not None:
                    item["revised_prompt"] = revised
                data.append(item)
            return web.json_response({"created": int(job.created_at), "data": data})
        finally:
            self._abandon(request, job.id)

    # ------------------------------------------------------------------ speech

    async def speech(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request)
        p = self._pipeline(body, "audio")
        text = body.get("input")
        if not isinstance(text, str) or not text:
            raise _bad("input", "input must be a non-empty string")
        fmt = body.get("response_format") or "wav"
        if fmt not in SPEECH_FORMATS:
            raise _bad("response_format", f"response_format must be one of {', '.join(SPEECH_FORMATS)} (omnid writes "
                       f"PCM: mp3, opus, aac and flac are not supported), not {fmt!r}")
        sse = body.get("stream_format") == "sse"
        if body.get("stream_format") not in (None, "audio", "sse"):
            raise _bad("stream_format", "stream_format must be \"audio\" (the bytes, as they come) or \"sse\" "
                       "(speech.audio.delta events)")
        voice = body.get("voice")
        params: dict[str, dict[str, Any]] = {}
        for s in p.sinks:        # `voice` goes to a last stage that declares it in its defaults
            if voice is not None and "voice" in self.api.config.stages[s].defaults:
                params[s] = {"voice": voice}
        inputs, summary = admission.inputs(self.api.config, {admission.prompt_key(self.api.config, p, "text"): text}, p)
        job = self._submit(request, p, inputs, params, summary)
        if sse or fmt == "pcm":
            try:
                return await self._speech_live(request, job, fmt, sse)
            finally:
                self._abandon(request, job.id)
        name = _audio_name(self.api.store, p)
        request[_CONTENT_TYPE_KEY] = "audio/wav"
        try:
            current = self.api.scheduler.job(job.id) or job
            try:
                if current.terminal:
                    return output_file(self.api.store, current, name)
                return await stream_output(request, self.api.store, self.api.scheduler, current, name)
            except Refused:
                _succeeded(self.api.scheduler, job.id)          # the job's own error, if it ended badly
                raise
        finally:
            self._abandon(request, job.id)

    async def _speech_live(self, request: web.Request, job: JobRecord, fmt: str, sse: bool) -> web.StreamResponse:
        """Speech as it is made: PCM16 bytes (`response_format: "pcm"`), or server-sent events
        (`stream_format: "sse"`): `speech.audio.delta` with base64 audio (the first one of a WAV
        carrying its header), then `speech.audio.done`."""
        reader = _LiveAudio(self.api.store.job_dir(job.id))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "audio/pcm",
                                           "Cache-Control": "no-cache"})
        header = fmt == "wav"
        started = False

        async def out(data: bytes) -> None:
            nonlocal started
            if not started:
                await resp.prepare(request)
                started = True
            if sse and data:
                await sse_send(resp, {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
            elif data:
                await resp.write(data)

        try:
            async for _ev in follow(request, self.api.scheduler, job.id):
                data = reader.read()
                if data:
                    if header:
                        data, header = reader.header + data, False
                    await out(data)
            await out(reader.read())
            _succeeded(self.api.scheduler, job.id)          # the job's own error, if it ended badly
            if sse:
                await sse_send(resp, {"type": "speech.audio.done",
                                   "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}})
            await resp.write_eof()
        except OpenAiError as e:
            if not started:
                raise                        # nothing sent yet: an ordinary error answer
            if sse:
                await sse_send(resp, _error_event(e))
            await resp.write_eof()
        except ConnectionError as e:
            log.debug("speech stream reader went away", job=job.id, error=str(e))
        finally:
            reader.close()
        return resp

    # ------------------------------------------------------------------ jobs

    def _submit(self, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
                params: dict[str, dict[str, Any]], summary: dict[str, Any]) -> JobRecord:
        """An ordinary job of the caller's (what `POST /v1/jobs` does after its checks); a `model`
        `PIPELINE:ADAPTER` sets the pipeline's adapter stage's `adapter`."""
        chosen = adapter_choice(self.api.config, request.get(_MODEL_KEY))
        if chosen is not None:
            stage, adapter = chosen
            params = {**params, stage: {**params.get(stage, {}), "adapter": adapter}}
        sub = admission.owned(self.api.config, Submission(p, inputs, params, summary, request["uid"],
                                                          priority=request.get(_PRIORITY_KEY, 0)),
                              request.get("api_key"), not request.get("tcp"))
        job = self.api.take(sub, "the daemon is stopping; try again once it is back", request)
        request[_JOB_KEY] = job.id
        log.info("audit", action="submit", uid=request["uid"], job=job.id, pipeline=p.name, via=request.path)
        return job

    def _abandon(self, request: web.Request, job_id: str) -> None:
        """The answer is over (sent, failed, or its caller went away): a job still live is cancelled."""
        if job_id in self.api.scheduler.live:
            self.api.scheduler.cancel(job_id)
            log.info("audit", action="cancel", uid=request["uid"], job=job_id, why="the caller went away",
                     via=request.path)

# ---------------------------------------------------------------------------- helpers


def _model(config: Config, store: JobStore, created: float, p: PipelineConfig) -> dict[str, Any]:
    """A pipeline as a model: what it produces, which endpoints take it, the media its chats may hold."""
    produces = admission.answers(config, store, p)
    endpoints = sorted({e for kind in (produces or _ENDPOINTS) for e in _ENDPOINTS.get(kind, [])})
    return {"id": p.name, "object": "model", "created": int(created), "owned_by": "omnid",
            "omnid": {"stages": list(p.stages), "engines": [config.stages[s].engine for s in p.stages],
                      "outputs": produces, "endpoints": endpoints,
                      "media": list(stage.media.kinds) if (stage := admission.media_stage(config, p)) else []}}


def _find(config: Config, name: Any) -> PipelineConfig:
    """The pipeline a `model` names: a pipeline's name, or `PIPELINE:ADAPTER`, one of the adapters
    of the pipeline's adapter stage (`adapter_stage`)."""
    if not isinstance(name, str) or not name:
        raise _bad("model", "you must provide a model parameter (a pipeline's name)")
    p = config.pipelines.get(name)
    if p is None and ":" in name:
        base, _, adapter = name.rpartition(":")
        p = config.pipelines.get(base)
        known = pipeline_adapters(config, p) if p is not None else []
        if p is not None and adapter not in known:
            raise OpenAiError(404, f"The model `{name}` does not exist: pipeline {base!r} has no adapter {adapter!r} "
                              f"(its adapters: {', '.join(known) or 'none'})", "model", str(ErrorCode.MODEL_NOT_FOUND))
    if p is None:
        raise OpenAiError(404, f"The model `{name}` does not exist (the pipelines: "
                          f"{', '.join(sorted(config.pipelines))})", "model",
                          str(ErrorCode.MODEL_NOT_FOUND))
    return p


def _media_inputs(config: Config, p: PipelineConfig, messages: str,
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
            raise _bad(where, f"model {p.name!r} takes no {kind} input (the media it takes: "
                              f"{', '.join(limits.kinds) or 'none'})", "media_not_accepted")
        if len(items) >= limits.count(kind):
            raise _bad(where, f"model {p.name!r} takes at most {limits.count(kind)} {kind} item(s) per request",
                       str(ErrorCode.INVALID_MEDIA))
        try:
            (doc,) = M.check_media(kind, data, limits)
        except M.MediaError as e:
            raise _bad(where, f"{where}: {e}", str(ErrorCode.INVALID_MEDIA)) from None
        items.append(data)
        summary.setdefault(kind, []).append({"filename": None, "size": len(data), **doc})
    try:
        admission.check_inputs(config, inputs, summary, p)
    except Refused as e:
        raise _bad("messages", e.message, str(e.code)) from None
    return inputs, summary


def _generation(config: Config, p: PipelineConfig) -> _Generation:
    """A text job's answer so far: its text stage's segments, its token stage's counts."""
    text = admission.text_stage(config, p)
    if text is None:
        raise _bad("model", f"model {p.name!r} does not end in text", str(ErrorCode.MODEL_NOT_SUPPORTED))
    return _Generation(text, admission.token_stage(config, p))


def _audio_name(store: JobStore, p: PipelineConfig) -> str:
    """The audio output's name: as the pipeline's latest successful job had it, else "audio"."""
    last = store.list(None, JobState.SUCCEEDED, p.name, 1)
    for out in last[0].outputs if last else []:
        if out["kind"] == "audio":
            return str(out["name"])
    return "audio"


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await json_body(request)
    except Refused as e:
        raise OpenAiError(e.status, e.message, code=str(e.code)) from None
    if not isinstance(body, dict):
        raise _bad(None, "the request body must be a JSON object")
    request[_MODEL_KEY] = body.get("model")
    # vLLM's extra field `priority` (lower runs earlier): the job's, on every path that makes one
    request[_PRIORITY_KEY] = admission.priority(body.get("priority"))
    return body


def _succeeded(scheduler: Scheduler, job_id: str) -> JobRecord:
    """The ended job's record; OpenAiError when it did not succeed."""
    record = scheduler.job(job_id)
    if record is None:
        raise OpenAiError(500, f"job {job_id} was deleted before it was answered", code="unknown_job",
                          retry=False)
    if record.state is not JobState.SUCCEEDED:
        err = record.error or {}
        if err.get("code") == ErrorCode.INPUT_REJECTED:     # the request's fault, found by the engine
            raise OpenAiError(400, f"the model refused the request: {err.get('message') or 'no reason given'}",
                              code=str(ErrorCode.INPUT_REJECTED), retry=False)
        raise OpenAiError(504 if record.state is JobState.TIMED_OUT else 500,
                          f"job {job_id} {record.state}: {err.get('message') or 'no reason given'}",
                          code=str(err.get("code") or record.state), retry=False)
    return record


async def _read(store: JobStore, record: JobRecord, out: dict[str, Any]) -> bytes:
    path = store.job_dir(record.id) / out["file"]
    try:
        return await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
    except FileNotFoundError:
        raise OpenAiError(410, f"output {out['name']!r} of job {record.id} is no longer on disk",
                          code=str(ErrorCode.OUTPUT_GONE)) from None



def _messages(raw: Any) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]]]:
    """The chat's messages as [{"role", "content"}], and its media parts in order as (kind, bytes,
    where). Text content stays text (parts joined); a message with media parts keeps its parts,
    each media part replaced by `{"type": "image"}` or `{"type": "audio"}`. `developer` is given
    to the template as `system`."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "messages must be a non-empty array of {\"role\", \"content\"}")
    out: list[dict[str, Any]] = []
    media: list[tuple[str, bytes, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, "
                       f"not {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content", media)
        if not isinstance(content, (str, list)):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or an array of "
                       "content parts")
        out.append({"role": "system" if role == "developer" else str(role), "content": content})
    return out, media


_PART_KINDS = {"image_url": "image", "input_audio": "audio"}


def _content_parts(parts: list[Any], where: str, media: list[tuple[str, bytes, str]]) -> str | list[dict[str, Any]]:
    """A message's content parts: text (joined into one string when there is nothing else), or the
    parts with each image or audio taken out into `media`."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and isinstance(part, dict):
            media.append(("image", _image_url(part.get("image_url"), at), at))
            out.append({"type": "image"})
        elif kind == "input_audio" and isinstance(part, dict):
            media.append(("audio", _input_audio(part.get("input_audio"), at), at))
            out.append({"type": "audio"})
        else:
            raise _bad(at, f"{at}: content parts are text ({{\"type\": \"text\", \"text\"}}), image_url (a data: URL) "
                           f"or input_audio (wav), not {kind!r}")
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


def _image_url(value: Any, where: str) -> bytes:
    """An `image_url` part's image: `{"url": "data:image/png;base64,..."}` (or the URL alone)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise _bad(where, f"{where}.image_url must be {{\"url\": \"data:image/...;base64,...\"}}")
    if not url.startswith("data:"):
        raise _bad(where, f"{where}: only data: URLs are supported (data:image/png;base64,...): omnid fetches "
                          "nothing from the network")
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise _bad(where, f"{where}: the data: URL must be base64 (data:image/png;base64,...)")
    return _b64(payload, where)


def _input_audio(value: Any, where: str) -> bytes:
    """An `input_audio` part's WAV file: `{"data": BASE64, "format": "wav"}`."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise _bad(where, f"{where}.input_audio must be {{\"data\": BASE64, \"format\": \"wav\"}}")
    if value.get("format", "wav") != "wav":
        raise _bad(where, f"{where}: only \"wav\" audio is supported, not {value.get('format')!r}")
    return _b64(value["data"], where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise _bad(where, f"{where}: the data is not valid base64") from None


def _refuse_chat_features(body: dict[str, Any]) -> None:
    """What a chat may ask that omnid does not do: 400 rather than an answer that ignores it."""
    # (each field is refused unless it asks for nothing: the OpenAPI document says the same of it)
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _bad(name, "tools and function calling are not supported")
    if body.get("function_call") not in (None, "none"):
        raise _bad("function_call", "tools and function calling are not supported")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "tools and function calling are not supported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("logprobs", "logprobs are not supported")
    if body.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", "logit_bias is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported")


AUDIO_FORMATS = ("wav", "pcm16")
SPEECH_FORMATS = ("wav", "pcm")
WAV_HEADER_BYTES = 44           # omnid's streamed WAVs: RIFF, fmt (16 bytes of PCM format), data
AUDIO_EXPIRES_S = 3600          # how long a chat's audio id is said to be good (the job's files may outlive it)


def _audio_request(body: dict[str, Any]) -> str | None:
    """A chat's `modalities` and `audio`: None for a text answer, else the audio format asked
    ("wav" or "pcm16"). OpenAI's rule: `audio` is required with the "audio" modality."""
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list)
                                   or any(m not in ("text", "audio") for m in modalities)):
        raise _bad("modalities", "modalities must be a list of \"text\" and \"audio\"")
    wants = modalities is not None and "audio" in modalities
    audio = body.get("audio")
    if not wants:
        if audio is not None:
            raise _bad("audio", "audio is for modalities [\"text\", \"audio\"]")
        return None
    if not isinstance(audio, dict) or not isinstance(audio.get("voice"), (str, dict)):
        raise _bad("audio", "modalities [\"text\", \"audio\"] need audio: {\"voice\": ..., \"format\": \"wav\"}")
    fmt = audio.get("format")
    if fmt not in AUDIO_FORMATS:
        raise _bad("audio.format", f"audio.format must be one of {', '.join(AUDIO_FORMATS)} (omnid writes PCM; "
                   f"mp3, opus, flac and aac are not supported), not {fmt!r}")
    return str(fmt)


def _wav_bytes(data: bytes) -> bytes:
    """A whole WAV from a streamed one: the size fields set to the real length (a stream wrote
    "to the end of the file")."""
    if len(data) < WAV_HEADER_BYTES or data[:4] != b"RIFF" or data[36:40] != b"data":
        return data
    n = len(data) - WAV_HEADER_BYTES
    return b"RIFF" + (n + 36).to_bytes(4, "little") + data[8:40] + n.to_bytes(4, "little") + data[WAV_HEADER_BYTES:]


class _Opening:
    """A stream's opening chunk (a chat's role chunk), held until the first chunk that follows it:
    `take()` gives it once, in a list to splat into `sse_send`, then nothing."""

    def __init__(self, chunk: dict[str, Any] | None) -> None:
        self._chunk = chunk

    def take(self) -> list[dict[str, Any]]:
        chunk, self._chunk = self._chunk, None
        return [chunk] if chunk is not None else []


class _LiveAudio:
    """A live job's audio stream file (a last stage's WAV as it is written: `.stream/` in the job's
    folder), read as PCM16 while it grows. The file is found by its WAV header; kept open once
    found, so the rest is still read after the worker removes it at the job's end."""

    def __init__(self, job_dir: Path) -> None:
        self.folder = job_dir / STREAM_DIR
        self._f: BinaryIO | None = None
        self._header = True
        self.header = b""                        # the stream's WAV header, once read

    def _open(self) -> BinaryIO | None:
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return None
        for name in names:
            try:
                f = open(self.folder / name, "rb")
            except OSError:
                continue
            if f.read(4) == b"RIFF":
                f.seek(0)
                return f
            f.close()
        return None

    def read(self) -> bytes:
        """The PCM written since the last read (no WAV header)."""
        if self._f is None:
            self._f = self._open()
            if self._f is None:
                return b""
        if self._header:
            if os.fstat(self._f.fileno()).st_size < WAV_HEADER_BYTES:
                return b""
            self.header = self._f.read(WAV_HEADER_BYTES)
            self._header = False
        data = self._f.read()
        if len(data) % 2:
            self._f.seek(-1, os.SEEK_CUR)        # half a sample: next time
            data = data[:-1]
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _pick(outputs: list[dict[str, Any]], kind: str, name: str, stage: str | None) -> dict[str, Any] | None:
    """The output of `kind` named `name` (else the first of that kind), of `stage` if given."""
    mine = [o for o in outputs if o["kind"] == kind and (stage is None or o.get("stage") == stage)]
    return next((o for o in mine if o["name"] == name), mine[0] if mine and stage is not None else None)


def _usage(gen: _Generation) -> dict[str, int]:
    """The vLLM stage's own count of the prompt's tokens (0 when the answer came from no vLLM stage)."""
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _error_event(e: OpenAiError) -> dict[str, Any]:
    """A job that ended badly, said inside a stream already under way (as OpenAI's servers do)."""
    return {"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}}


def _common(body: dict[str, Any]) -> tuple[bool, bool]:
    """`n` (1 only), `stream`, `stream_options.include_usage`."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad("n", f"n must be 1 here (one job, one answer), not {n!r}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    if options and not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options", "stream_options.include_usage must be true or false")
    return bool(stream), bool(include_usage)


def _sampling(config: Config, p: PipelineConfig, body: dict[str, Any],
              extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The OpenAI sampling fields as the token stage's params, each checked by omnid's rules."""
    stage = admission.token_stage(config, p)
    if stage is None:
        return {}                   # no stage that samples: nothing to sample (the fields are ignored)
    engine, defaults = config.stages[stage].engine, config.stages[stage].defaults
    values: dict[str, Any] = {}
    for name, key in _SAMPLING:
        value = body.get(name)
        if value is None or (name == "stop" and value == []):
            continue
        why = job_param_problem(stage, engine, defaults, key, value)
        if why is not None:
            raise _bad(name, f"{name}: {why}")
        values[key] = value
    why = values_problem(stage, engine, merged(defaults, values))
    if why is not None:
        raise _bad("max_tokens", why)
    values.update(extra)
    return {stage: values}


# ---------------------------------------------------------------------------- LoRA adapters as models
# As `vllm serve --lora-modules` lists them: each adapter is a model of its own, `PIPELINE:ADAPTER`,
# whose `parent` is the pipeline; a request for it is the pipeline's job with the adapter stage's
# `adapter` set.


def adapter_choice(config: Config, model: Any) -> tuple[str, str] | None:
    """(stage, adapter) that a `model` of `PIPELINE:ADAPTER` asks for; None for a plain pipeline."""
    if not isinstance(model, str) or model in config.pipelines or ":" not in model:
        return None
    base, _, adapter = model.rpartition(":")
    p = config.pipelines.get(base)
    stage = adapter_stage(config, p) if p is not None else None
    if stage is None or adapter not in config.stages[stage].adapters:
        return None
    return stage, adapter


def adapter_model(config: Config, created: float, p: PipelineConfig, adapter: str) -> dict[str, Any]:
    stage = adapter_stage(config, p)
    assert stage is not None
    return {"id": f"{p.name}:{adapter}", "object": "model", "created": int(created), "owned_by": "omnid",
            "parent": p.name, "root": str(config.stages[stage].adapters[adapter]),
            "omnid": {"stage": stage, "adapter": adapter, "base": str(config.stages[stage].model)}}
