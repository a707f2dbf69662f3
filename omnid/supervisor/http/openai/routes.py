"""OpenAI-compatible endpoints on the daemon's socket (and its TCP listener); each request is one ordinary omnid job.

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application (the
daemon mounts it: `OpenAiApi(api).mount(api.app)`). Handlers never block: they submit a job through the
scheduler and follow it (openai_jobs.py: its event queue, a hang-up cancelling the job), reading small
output files in the loop's default executor. A request's checks are admission's (admission.py), in
OpenAI's words where the OpenAI shape has its own (openai_protocol.py: each body's shape, by its model;
openai_requests.py: the sampling fields, a chat's messages and media; openai_models.py: the `model`).

- `GET /v1/models`, `GET /v1/models/{model}`: the pipelines as models (`omnid.outputs`: what each
  produces: `text` for a vLLM last stage, `image` for diffusers; for a python last stage, what it
  declares (its `produces`, or its function's), null when it declares nothing; `omnid.media`: the media its
  chats may hold, `image`, `audio`, `video`).
- `POST /v1/chat/completions`, `POST /v1/completions`: pipelines that end in text. A chat's
  messages are one job input `messages` (JSON text), which the vLLM stage renders with its
  tokenizer's chat template; the answer is the text segments of the text-producing last stage.
  A chat's media parts (`image_url` with a data: URL, `input_audio`) become the job's `image` and
  `audio` inputs, in order, and `{"type": "image"}` / `{"type": "audio"}` parts in its messages,
  where the model's template puts its placeholders; they are checked like any job's media. A chat
  that asks for speech (`modalities: ["text", "audio"]`) is answered by openai_audio.py.
- `POST /v1/images/generations`: pipelines that end in an image (`b64_json` only).
- `POST /v1/audio/speech`: pipelines that end in audio (`wav` only), streamed as it is produced
  (openai_audio.py).

Each job belongs to the caller's uid and shows in `GET /v1/jobs` like any other; a caller that goes
away before its job ended cancels it. The answers carry the job's id in `X-Omnid-Job`. Errors on
these paths are OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` (openai_errors.py).

Nothing of the engines is imported here (no tokenizer in the supervisor).
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from omnid.config import PipelineConfig
from omnid.engines.capabilities import job_param_problem
from omnid.lora import pipeline_adapters
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import DISCONNECT_POLL_S as DISCONNECT_POLL_S  # (re-exported)
from omnid.supervisor.http.http_common import follow, sse_response, sse_send
from omnid.supervisor.http.openai.common import OpenAiError, bad, openai_errors
from omnid.supervisor.http.openai.jobs import (
    Generation,
    OpenAiJobs,
    Opening,
    generation,
    on_prepare,
    pick,
    read_output,
    succeeded,
    usage,
)
from omnid.supervisor.http.openai.models import adapter_model, find_pipeline, model_doc, pipeline_for
from omnid.supervisor.http.openai.protocol import ChatCompletionRequest, CompletionRequest, ImageRequest
from omnid.supervisor.http.openai.requests import chat_messages, media_inputs, read_body, sampling
from omnid.supervisor.http.openai.speech import OpenAiAudio
from omnid.vocabulary import ErrorCode, JobRecord

if TYPE_CHECKING:
    from omnid.supervisor.http.api import Api

log = structlog.get_logger("omnid.openai")


class OpenAiApi:
    """The OpenAI-shaped handlers, on the `Api`'s collaborators (config, store, scheduler, info)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.jobs = OpenAiJobs(api)
        self.audio = OpenAiAudio(self.jobs)

    def mount(self, app: web.Application) -> None:
        app.middlewares.append(openai_errors)
        app.on_response_prepare.append(on_prepare)
        app.add_routes([
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model}", self.get_model),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/images/generations", self.images),
            web.post("/v1/audio/speech", self.audio.speech),
        ])

    # ------------------------------------------------------------------ models

    async def list_models(self, request: web.Request) -> web.Response:
        api = self.api
        data = []
        for p in api.config.pipelines.values():
            data.append(model_doc(api.config, api.store, api.info.started, p))
            data += [adapter_model(api.config, api.info.started, p, name) for name in pipeline_adapters(api.config, p)]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        p = find_pipeline(self.api.config, name)
        if name != p.name:
            return web.json_response(adapter_model(self.api.config, self.api.info.started, p, name.rpartition(":")[2]))
        return web.json_response(model_doc(self.api.config, self.api.store, self.api.info.started, p))

    # ------------------------------------------------------------------ text

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        chat = ChatCompletionRequest.parse(body)
        audio = chat.audio_format()
        p = pipeline_for(self.api.config, self.api.store, body, "text", *(["audio"] if audio is not None else []))
        stream, include_usage = chat.stream_flags()
        messages, parts = chat_messages(chat.messages)
        params = sampling(self.api.config, p, chat.sampling_values(), {"include_prompt": False})
        if not parts:
            inputs, summary = admission.inputs(self.api.config, {"messages": json.dumps(messages)}, p)
        else:
            inputs, summary = media_inputs(self.api.config, p, json.dumps(messages), parts)
        if audio is not None:
            return await self.audio.chat(request, p, inputs, params, summary, stream, include_usage, audio)
        return await self._text_job(request, p, inputs, params, summary, stream, include_usage, chat=True, echo="")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        completion = CompletionRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, body, "text")
        stream, include_usage = completion.stream_flags()
        prompt, echo = completion.text, completion.echo
        stage = admission.token_stage(self.api.config, p)
        extra: dict[str, Any] = {"include_prompt": False}
        if stage is not None and self.api.config.stages[stage].defaults.get("prompt_template"):
            extra["prompt_template"] = ""           # a completion continues the prompt as it is
        params = sampling(self.api.config, p, completion.sampling_values(), extra)
        inputs, summary = admission.inputs(self.api.config, {"prompt": prompt}, p)
        return await self._text_job(request, p, inputs, params, summary, stream, include_usage, chat=False,
                                    echo=prompt if echo else "")

    async def _text_job(self, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
                        params: dict[str, dict[str, Any]], summary: dict[str, Any], stream: bool,
                        include_usage: bool, chat: bool, echo: str) -> web.StreamResponse:
        gen = generation(self.api.config, p)
        job = self.jobs.submit(request, p, inputs, params, summary)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": kind,
                "created": int(job.created_at), "model": p.name}
        try:
            if stream:
                return await self._stream_text(request, job, gen, head, chat, include_usage, echo)
            text = echo + "".join([piece async for piece in self.jobs.deltas(request, job, gen)])
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            return web.json_response({**head, "choices": [choice], "usage": usage(gen)})
        finally:
            self.jobs.abandon(request, job.id)

    async def _stream_text(self, request: web.Request, job: JobRecord, gen: Generation, head: dict[str, Any],
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
        opening = Opening(chunk(None, first=True) if chat else None)
        try:
            if echo:
                await sse_send(resp, *opening.take(), chunk(echo))
            await self.jobs.sse_answer(request, resp, job, gen, head if include_usage else None, chunk,
                                       lambda: chunk(None, gen.finish_reason), opening=opening)
        except ConnectionError as e:
            log.debug("chat stream reader went away", job=job.id, error=str(e))
        return resp

    # ------------------------------------------------------------------ images


    async def images(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        asked = ImageRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, body, "image")
        draw = admission.image_stage(self.api.config, p)
        params: dict[str, dict[str, Any]] = {}
        size = asked.width_height()
        if size is not None:
            if draw is None:
                raise bad("size", f"model {p.name!r} has no diffusers stage to set the size of")
            params[draw] = {"width": size[0], "height": size[1]}
            stage = self.api.config.stages[draw]
            for key, value in params[draw].items():
                why = job_param_problem(draw, stage.engine, stage.defaults, key, value)
                if why is not None:
                    raise bad("size", f"size: {why}")
        inputs, summary = admission.inputs(self.api.config, {admission.prompt_key(self.api.config, p): asked.prompt}, p)
        job = self.jobs.submit(request, p, inputs, params, summary)
        try:
            async for _ in follow(request, self.api.scheduler, job.id):
                pass
            record = succeeded(self.api.scheduler, job.id)
            images = [o for o in record.outputs if o["kind"] == "image"]
            if not images:
                raise OpenAiError(500, f"job {job.id} of {p.name!r} produced no image "
                                  f"(its outputs: {', '.join(o['name'] for o in record.outputs) or 'none'})",
                                  code=ErrorCode.NO_IMAGE, retry=False)
            revised_out = pick(record.outputs, "text", "prompt", None)
            revised = (await read_output(self.api.store, record, revised_out)).decode("utf-8", "replace") \
                if revised_out else None
            data = []
            for out in images:
                item = {"b64_json": base64.b64encode(await read_output(self.api.store, record, out)).decode("ascii")}
                if revised is not None:
                    item["revised_prompt"] = revised
                data.append(item)
            return web.json_response({"created": int(job.created_at), "data": data})
        finally:
            self.jobs.abandon(request, job.id)
