"""An OpenAI request's body read and checked into what an omnid job takes: the JSON object (its
`model` and vLLM's `priority` kept on the request for the job it makes), `n` / `stream` /
`stream_options`, the sampling fields as the token stage's params, a chat's messages and their
media parts (a data: URL image, a WAV `input_audio`) as the job's inputs, and the chat features
omnid refuses rather than ignores.

Runs in the supervisor's event-loop thread, called by the OpenAI handlers (openai_api.py,
openai_audio.py) and the realtime session (realtime.py, realtime_responses.py); reading the body is
the only await. Each refusal is an `OpenAiError` naming its field (`param`); a job's own checks are
admission's (admission.py), said in OpenAI's words here where the OpenAI shape has its own.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from omnid import media as M
from omnid.config import Config, PipelineConfig
from omnid.engines.capabilities import capabilities, job_param_problem, values_problem
from omnid.params import merged
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission, prompt_length
from omnid.supervisor.http.http_common import json_body
from omnid.supervisor.http.openai_errors import OpenAiError, bad
from omnid.vocabulary import ErrorCode

MODEL_KEY = "openai_model"              # request key: the body's `model` (a `PIPELINE:ADAPTER` sets the adapter)
PRIORITY_KEY = "openai_priority"        # request[...]: the body's `priority`, for the job it makes
_ROLES = {"system", "developer", "user", "assistant", "tool"}
# OpenAI sampling fields -> the vLLM stage's params (max_completion_tokens wins over max_tokens); then
# the extensions vLLM's own server takes in the same body (`vllm bench serve` sends ignore_eos).
_SAMPLING = (("max_tokens", "max_tokens"), ("max_completion_tokens", "max_tokens"),
             ("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop"), ("seed", "seed"),
             ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
             ("top_k", "top_k"), ("min_p", "min_p"), ("min_tokens", "min_tokens"),
             ("repetition_penalty", "repetition_penalty"), ("ignore_eos", "ignore_eos"))


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


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """`n` (1 only), `stream`, `stream_options.include_usage`."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n", f"n must be 1 here (one job, one answer), not {n!r}")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    if options and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("stream_options", "stream_options.include_usage must be true or false")
    return bool(stream), bool(include_usage)


def sampling(config: Config, p: PipelineConfig, body: dict[str, Any],
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
            raise bad(name, f"{name}: {why}")
        values[key] = value
    why = values_problem(stage, engine, merged(defaults, values))
    if why is not None:
        raise bad("max_tokens", why)
    if capabilities(engine).context_window:     # beyond the context window: 400, as `vllm serve` answers
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        why = prompt_length.max_tokens_problem(config.stages[stage], values.get("max_tokens"), name)
        if why is not None:
            raise bad(name, why)
    values.update(extra)
    return {stage: values}


def refuse_chat_features(body: dict[str, Any]) -> None:
    """What a chat may ask that omnid does not do: 400 rather than an answer that ignores it."""
    # (each field is refused unless it asks for nothing: the OpenAPI document says the same of it)
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise bad(name, "tools and function calling are not supported")
    if body.get("function_call") not in (None, "none"):
        raise bad("function_call", "tools and function calling are not supported")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise bad("tool_choice", "tools and function calling are not supported")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("logprobs", "logprobs are not supported")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "logit_bias is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported")


# ---------------------------------------------------------------------------- a chat's messages


def chat_messages(raw: Any) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]]]:
    """The chat's messages as [{"role", "content"}], and its media parts in order as (kind, bytes,
    where). Text content stays text (parts joined); a message with media parts keeps its parts,
    each media part replaced by `{"type": "image"}` or `{"type": "audio"}`. `developer` is given
    to the template as `system`."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "messages must be a non-empty array of {\"role\", \"content\"}")
    out: list[dict[str, Any]] = []
    media: list[tuple[str, bytes, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, "
                      f"not {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = _content_parts(content, f"messages[{i}].content", media)
        if not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or an array of "
                      "content parts")
        out.append({"role": "system" if role == "developer" else str(role), "content": content})
    return out, media


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
            raise bad(at, f"{at}: content parts are text ({{\"type\": \"text\", \"text\"}}), image_url (a data: URL) "
                          f"or input_audio (wav), not {kind!r}")
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
                      str(ErrorCode.INVALID_MEDIA))
        try:
            (doc,) = M.check_media(kind, data, limits)
        except M.MediaError as e:
            raise bad(where, f"{where}: {e}", str(ErrorCode.INVALID_MEDIA)) from None
        items.append(data)
        summary.setdefault(kind, []).append({"filename": None, "size": len(data), **doc})
    try:
        admission.check_inputs(config, inputs, summary, p)
    except Refused as e:
        raise bad("messages", e.message, str(e.code)) from None
    return inputs, summary
