"""An OpenAI request's body read and made into what an omnid job takes: the JSON object (its
`model` and vLLM's `priority` kept on the request for the job it makes), the sampling fields as the
token stage's params (by that stage's rules), a chat's messages and their media parts (a data: URL
image, a WAV `input_audio`) as the job's inputs. The body's shape is checked before, by its model
(openai_protocol.py).

Runs in the supervisor's event-loop thread, called by the OpenAI handlers (openai_api.py,
openai_audio.py) and the realtime session (realtime.py, realtime_responses.py); reading the body is
the only await. Each refusal is an `OpenAiError` naming its field (`param`); a job's own checks are
admission's (admission.py), said in OpenAI's words here where the OpenAI shape has its own.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from omnid import media as M
from omnid import prompt_length
from omnid.config import Config, PipelineConfig
from omnid.engines.capabilities import capabilities, job_param_problem, values_problem
from omnid.params import merged
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import json_body
from omnid.supervisor.http.openai.common import OpenAiError, bad
from omnid.supervisor.http.openai.protocol import SAMPLING, ChatMessage, ContentPart
from omnid.vocabulary import ErrorCode

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
             extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
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
