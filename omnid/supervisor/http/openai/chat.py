"""`POST /v1/chat/completions`: a chat, one ordinary omnid job, answered in text or in text and speech.

A chat's messages are one job input `messages` (JSON text), which the vLLM stage renders with its
tokenizer's chat template; the answer is the text segments of the text-producing last stage. Its
media parts (`image_url` with a data: URL, `input_audio`) become the job's `image` and `audio`
inputs, in order, and `{"type": "image"}` / `{"type": "audio"}` parts in its messages, where the
model's template puts its placeholders; they are checked like any job's media (common.py:
`media_inputs`). A chat that asks for speech (`modalities: ["text", "audio"]`) is answered as OpenAI
answers one: `message.audio` = {id, data (base64), expires_at, transcript}, or streamed, `delta.audio`
pieces (the transcript as it grows, the PCM16 as it is made, read from the job's live WAV stream).

Here: the body's model (`ChatCompletionRequest`: a chat's messages and their parts are typed dicts),
its messages made a job's (`chat_messages`), the handler (`Chat.handle`) and the speech answer; the
text answer is jobs.py's (`OpenAiJobs.text_answer`, as a completion's). Runs in the supervisor's
event-loop thread; nothing blocks.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, with_config
from typing_extensions import NotRequired, TypedDict

from omnid.config import PipelineConfig
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import sse_response, sse_send
from omnid.supervisor.http.openai.common import (
    Generation,
    OpenAiError,
    TextBody,
    bad,
    fixed,
    generation,
    media_inputs,
    pipeline_for,
    read_body,
    sampling,
    shown,
    submit,
    usage,
)
from omnid.supervisor.http.openai.jobs import Endpoint, Opening, read_output, succeeded
from omnid.supervisor.http.openai.live_audio import WAV_HEADER_BYTES, LiveAudio, wav_bytes
from omnid.vocabulary import ErrorCode, JobRecord

log = structlog.get_logger("omnid.openai")

AUDIO_EXPIRES_S = 3600          # how long a chat's audio id is said to be good (the job's files may outlive it)
ROLES = ("system", "developer", "user", "assistant", "tool")


# A chat's messages and their parts are typed dicts, not models: a long chat has thousands of them, and
# a dict checked in place costs a third of a model made of it.
_STRICT = ConfigDict(strict=True, extra="ignore")


@with_config(_STRICT)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


@with_config(_STRICT)
class ImagePart(TypedDict):
    """An image, as a data: URL (omnid fetches nothing from the network)."""

    type: Literal["image_url"]
    image_url: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "object", "properties": {"url": {"type": "string", "pattern": "^data:[^,]*;base64,"}},
         "required": ["url"]},
        {"type": "string", "pattern": "^data:[^,]*;base64,"}]})]


@with_config(_STRICT)
class AudioPart(TypedDict):
    """A WAV file, base64."""

    type: Literal["input_audio"]
    input_audio: Annotated[Any, WithJsonSchema({"type": "object", "properties": {
        "data": {"type": "string", "contentEncoding": "base64"}, "format": {"const": "wav"}}, "required": ["data"]})]


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"={kind}" if kind in ("text", "image_url", "input_audio") else None


ContentPart = Annotated[Annotated[TextPart, Tag("=text")] | Annotated[ImagePart, Tag("=image_url")]
                        | Annotated[AudioPart, Tag("=input_audio")], Discriminator(_part_kind)]
Content = Annotated[Annotated[str, Tag("=string")] | Annotated[list[ContentPart], Tag("=parts")],
                    Discriminator(lambda v: "=parts" if isinstance(v, list) else "=string")]


@with_config(_STRICT)
class ChatMessage(TypedDict):
    """A message; an assistant's content may be null."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: NotRequired[Content | None]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]


class ChatAudio(BaseModel):
    """The speech asked for with modalities ["text", "audio"] (and only then)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    voice: str | dict[str, Any]
    format: Literal["wav", "pcm16"]


_TOOLS = fixed("tools and function calling are not supported")
Nothing = Annotated[list[Any], Field(max_length=0)]


class ChatCompletionRequest(TextBody):
    """A chat. stream_options only with stream: true; audio with modalities ["text", "audio"] (and only
    then), on a pipeline that ends in audio."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Nothing | None = None
    functions: Nothing | None = None
    function_call: Literal["none"] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: None = None
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudio | None = None

    MESSAGES = {
        **TextBody.MESSAGES,
        ("messages",): (fixed("messages must be a non-empty array of {\"role\", \"content\"}"), None),
        ("messages", "*"): (lambda at, v: f"{at} must be an object", None),
        ("messages", "*", "role"): (lambda at, v: f"{at} must be one of {', '.join(sorted(ROLES))}, not {shown(v)}", None),
        ("messages", "*", "content"): (lambda at, v: f"{at} must be a string or an array of content parts", None),
        ("messages", "*", "content", "*"): (lambda at, v: (
            f"{at}: content parts are text ({{\"type\": \"text\", \"text\"}}), image_url (a data: URL) or "
            f"input_audio (wav), not {v.get('type') if isinstance(v, dict) else None!r}"), None),
        ("messages", "*", "content", "*", "image_url"): (
            lambda at, v: f"{at} must be {{\"url\": \"data:image/...;base64,...\"}}", 4),
        ("messages", "*", "content", "*", "input_audio"): (
            lambda at, v: f"{at} must be {{\"data\": BASE64, \"format\": \"wav\"}}", 4),
        ("tools",): (_TOOLS, None), ("functions",): (_TOOLS, None), ("function_call",): (_TOOLS, None),
        ("tool_choice",): (_TOOLS, None),
        ("logprobs",): (fixed("logprobs are not supported"), None),
        ("top_logprobs",): (fixed("logprobs are not supported"), "logprobs"),
        ("logit_bias",): (fixed("logit_bias is not supported"), None),
        ("response_format",): (fixed("only response_format {\"type\": \"text\"} is supported"), None),
        ("modalities",): (fixed("modalities must be a list of \"text\" and \"audio\""), None),
        ("audio",): (fixed("modalities [\"text\", \"audio\"] need audio: {\"voice\": ..., \"format\": \"wav\"}"),
                     None),
        ("audio", "format"): (lambda at, v: "audio.format must be one of wav, pcm16 (omnid writes PCM; mp3, opus, "
                              f"flac and aac are not supported), not {shown(v)}", None),
    }

    def audio_format(self) -> str | None:
        """None for a text answer, else the audio format asked ("wav" or "pcm16"). OpenAI's rule:
        `audio` is required with the "audio" modality, and only then."""
        if self.modalities is None or "audio" not in self.modalities:
            if self.audio is not None:
                raise bad("audio", "audio is for modalities [\"text\", \"audio\"]")
            return None
        if self.audio is None:
            raise bad("audio", "modalities [\"text\", \"audio\"] need audio: {\"voice\": ..., \"format\": \"wav\"}")
        return self.audio.format


# ---------------------------------------------------------------------------- a chat's messages


def chat_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]]]:
    """The chat's messages as [{"role", "content"}], and its media parts in order as (kind, bytes,
    where). Text content stays text (parts joined); a message with media parts keeps its parts,
    each media part replaced by `{"type": "image"}` or `{"type": "audio"}`. `developer` is given
    to the template as `system`."""
    out: list[dict[str, Any]] = []
    media: list[tuple[str, bytes, str]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if content is None and role != "assistant":
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or an array of "
                      "content parts")
        text = _content_parts(content, f"messages[{i}].content", media) if isinstance(content, list) else content or ""
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return out, media


def _content_parts(parts: list[ContentPart], where: str, media: list[tuple[str, bytes, str]]) -> str | list[dict[str, Any]]:
    """A message's content parts: text (joined into one string when there is nothing else), or the
    parts with each image or audio taken out into `media`."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        if part["type"] == "text":
            out.append({"type": "text", "text": part["text"]})
        elif part["type"] == "image_url":
            media.append(("image", _image_url(part["image_url"], at), at))
            out.append({"type": "image"})
        else:
            media.append(("audio", _input_audio(part["input_audio"], at), at))
            out.append({"type": "audio"})
    if all(p["type"] == "text" for p in out):
        return "\n".join(p["text"] for p in out)
    return out


def _image_url(value: Any, where: str) -> bytes:
    """An `image_url` part's image: `{"url": "data:image/png;base64,..."}` (or the URL alone)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad(where, f"{where}.image_url must be {{\"url\": \"data:image/...;base64,...\"}}")
    if not url.startswith("data:"):
        raise bad(where, f"{where}: only data: URLs are supported (data:image/png;base64,...): omnid fetches "
                         "nothing from the network")
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise bad(where, f"{where}: the data: URL must be base64 (data:image/png;base64,...)")
    return _b64(payload, where)


def _input_audio(value: Any, where: str) -> bytes:
    """An `input_audio` part's WAV file: `{"data": BASE64, "format": "wav"}`."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise bad(where, f"{where}.input_audio must be {{\"data\": BASE64, \"format\": \"wav\"}}")
    if value.get("format", "wav") != "wav":
        raise bad(where, f"{where}: only \"wav\" audio is supported, not {value.get('format')!r}")
    return _b64(value["data"], where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise bad(where, f"{where}: the data is not valid base64") from None


class Chat(Endpoint):
    """The chat handler."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        chat = ChatCompletionRequest.parse(body)
        audio = chat.audio_format()
        p = pipeline_for(self.api.config, self.api.store, chat, "text", *(["audio"] if audio is not None else []))
        stream, include_usage = chat.stream_flags()
        messages, parts = chat_messages(chat.messages)
        params = sampling(self.api.config, p, chat.sampling_values(), {"include_prompt": False})
        if not parts:
            inputs, summary = admission.inputs(self.api.config, {"messages": json.dumps(messages)}, p)
        else:
            inputs, summary = media_inputs(self.api.config, p, json.dumps(messages), parts)
        gen = generation(self.api.config, p)
        job = submit(self.api, request, p, inputs, params, summary)
        if audio is not None:
            return await self._speech_answer(request, p, job, gen, stream, include_usage, audio)
        return await self.jobs.text_answer(request, p, job, gen, stream, include_usage, chat=True, echo="")

    # ------------------------------------------------------------------ answered in speech

    async def _speech_answer(self, request: web.Request, p: PipelineConfig, job: JobRecord, gen: Generation,
                             stream: bool, include_usage: bool, fmt: str) -> web.StreamResponse:
        """A chat answered in text and speech, as OpenAI answers one: `message.audio` = {id, data
        (base64), expires_at, transcript}, the text being the transcript (`content` is null); streamed,
        `delta.audio` pieces: the transcript as it grows and the PCM16 as it is made."""
        head = {"id": "chatcmpl-" + job.id, "object": "chat.completion", "created": int(job.created_at),
                "model": p.name}
        audio_id = "audio_" + job.id
        expires = int(job.created_at) + AUDIO_EXPIRES_S
        try:
            if stream:
                return await self._stream_speech(request, job, gen, head, include_usage, audio_id, expires)
            transcript = "".join([piece async for piece in self.jobs.deltas(request, job, gen)])
            record = succeeded(self.api.scheduler, job.id)
            out = next((o for o in record.outputs if o["kind"] == "audio"), None)
            if out is None:
                raise OpenAiError(500, f"job {job.id} of model {p.name!r} ended with no audio output",
                                  code=ErrorCode.INTERNAL_ERROR)
            data = wav_bytes(await read_output(self.api.store, record, out))
            if fmt == "pcm16":
                data = data[WAV_HEADER_BYTES:]
            message = {"role": "assistant", "content": None, "refusal": None,
                       "audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii"),
                                 "expires_at": expires, "transcript": transcript}}
            choice = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason, "message": message}
            return web.json_response({**head, "choices": [choice], "usage": usage(gen)})
        finally:
            self.jobs.abandon(request, job.id)

    async def _stream_speech(self, request: web.Request, job: JobRecord, gen: Generation,
                           head: Mapping[str, Any], include_usage: bool, audio_id: str,
                           expires: int) -> web.StreamResponse:
        head = {**head, "object": "chat.completion.chunk"}
        resp = await sse_response(request)
        reader = LiveAudio(self.api.store.job_dir(job.id))

        def chunk(delta: Mapping[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "delta": delta}],
                    **({"usage": None} if include_usage else {})}

        opening = Opening(chunk({"role": "assistant", "content": None, "refusal": None}))

        async def pcm_out() -> None:
            data = reader.read()
            if data:
                await sse_send(resp, *opening.take(),
                               chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))

        try:
            await self.jobs.sse_answer(request, resp, job, gen, head if include_usage else None,
                                       lambda piece: chunk({"audio": {"id": audio_id, "transcript": piece}}),
                                       lambda: chunk({"audio": {"id": audio_id, "expires_at": expires}},
                                                     gen.finish_reason),
                                       on_event=pcm_out, opening=opening)
        except ConnectionError as e:
            log.debug("audio chat stream reader went away", job=job.id, error=str(e))
        finally:
            reader.close()
        return resp
