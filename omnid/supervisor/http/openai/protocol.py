"""The OpenAI paths' request bodies as pydantic models: one definition of each body, which parses and
checks it (`parse`: every problem of its shape at once, in omnid's words, the first one's field as
OpenAI's `param`) and is the OpenAPI document's schema of it (openapi_schemas.py reads
`model_json_schema`). What a body's values mean for a pipeline (its `model`, the sampling fields by
the token stage's rules, a chat's media parts decoded) is checked after, by openai_requests.py and
the handlers, against the config in force.

Pydantic's own words never reach a caller: each field that can be wrong has its message here
(`RequestBody.MESSAGES`, by the field's path), and any other problem is said by `_plain`.

Runs in the supervisor's event-loop thread, called by the OpenAI handlers (openai_api.py,
openai_audio.py); no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WithJsonSchema,
    with_config,
)
from pydantic_core import ErrorDetails
from typing_extensions import NotRequired, TypedDict

from omnid.engines.capabilities import engines_that, param_schema
from omnid.supervisor.http.openai.common import bad

ROLES = ("system", "developer", "user", "assistant", "tool")
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
# A message to say for a field (by its path: names, "*" for any index), given where it is ("messages[0].role")
# and its value; and the param to name when not that path itself: a name, or how much of the path.
Say = Callable[[str, Any], str]
Said = dict[tuple[str, ...], tuple[Say, str | int | None]]


def _maybe(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def _checked_later(schema: dict[str, Any]) -> Any:
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
    return _checked_later(param_schema(_SAMPLER, "max_tokens" if name == "max_completion_tokens" else name))


def _fixed(message: str) -> Say:
    return lambda at, value: message


def _shown(value: Any) -> str:
    """A wrong value as a message shows it: its repr, cut (a body may hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


class RequestBody(BaseModel):
    """A request body: its fields checked strictly (a string is no number, "true" no boolean); fields
    omnid does not know are ignored, as OpenAI's clients send some. Each names its `model` (a pipeline:
    the handler looks it up) and may give vLLM's `priority`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    ANSWER: ClassVar[str] = "text"          # what the model named must give (its schema lists those)
    MESSAGES: ClassVar[Said] = {
        ("model",): (_fixed("you must provide a model parameter (a pipeline's name)"), None),
    }

    model: Annotated[str, Field(min_length=1)]
    priority: Any = _checked_later(PRIORITY_SCHEMA)     # (read_body reads it: admission.priority)

    @classmethod
    def parse(cls: type[B], body: dict[str, Any]) -> B:
        """The body as this model; OpenAiError 400 saying each problem, the first one's field as `param`."""
        try:
            found = cls.model_validate(body)
        except ValidationError as e:
            said = [cls._say(err, body) for err in e.errors(include_url=False)]
            messages = list(dict.fromkeys(message for _, message in said))
            raise bad(said[0][0], "; ".join(messages)) from None
        return found

    @classmethod
    def _say(cls, err: ErrorDetails, body: Any) -> tuple[str | None, str]:
        """(param, message) of one of pydantic's errors: the message of the longest known path that
        starts the error's, else `_plain`'s."""
        path = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("="))]    # (our union tags)
        for n in range(len(path), 0, -1):
            key = tuple("*" if isinstance(p, int) else p for p in path[:n])
            known = cls.MESSAGES.get(key)
            if known is not None:
                at = _where(path[:n])
                say, param = known
                named = _where(path[:param]) if isinstance(param, int) else param or at
                return named, say(at, _value_at(body, path[:n]))
        return _where(path) or None, _plain(err, _where(path))


def _where(path: list[int | str]) -> str:
    """A field's path as the error names it: `messages[0].content[1]`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _value_at(body: Any, path: list[int | str]) -> Any:
    for p in path:
        try:
            body = body[p]
        except (KeyError, IndexError, TypeError):
            return None
    return body


_PLAIN = {"missing": "is required", "string_type": "must be a string", "bool_type": "must be true or false",
          "int_type": "must be an integer", "float_type": "must be a number", "list_type": "must be an array",
          "dict_type": "must be an object", "model_type": "must be an object", "model_attributes_type":
          "must be an object", "none_required": "is not supported (null only)"}


def _plain(err: ErrorDetails, at: str) -> str:
    """A problem no message of the model's names, in plain words."""
    words = _PLAIN.get(err["type"])
    if words is None:
        ctx = err.get("ctx") or {}
        if err["type"] == "literal_error":
            words = f"must be {ctx.get('expected')}"
        elif err["type"] in ("too_short", "too_long"):
            words = f"must have {'at least' if err['type'] == 'too_short' else 'at most'} " \
                    f"{ctx.get('min_length', ctx.get('max_length'))} item(s)"
        else:
            words = err["msg"].replace("Input should be", "must be")
    return f"{at or 'the request body'} {words}, not {_shown(err['input'])}" if err["type"] != "missing" \
        else f"{at} {words}"


# ------------------------------------------------------------------ what /v1/chat/completions and /v1/completions share


class StreamOptions(BaseModel):
    """With stream: true, whether the last chunk carries the usage."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


class TextBody(RequestBody):
    n: One = _checked_later({"const": 1})
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
        ("n",): (lambda at, v: f"n must be 1 here (one job, one answer), not {_shown(v)}", None),
        ("stream",): (_fixed("stream must be true or false"), None),
        ("stream_options",): (_fixed("stream_options must be an object"), None),
        ("stream_options", "include_usage"): (_fixed("stream_options.include_usage must be true or false"),
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


# ------------------------------------------------------------------ POST /v1/chat/completions


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


_TOOLS = _fixed("tools and function calling are not supported")
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
        ("messages",): (_fixed("messages must be a non-empty array of {\"role\", \"content\"}"), None),
        ("messages", "*"): (lambda at, v: f"{at} must be an object", None),
        ("messages", "*", "role"): (lambda at, v: f"{at} must be one of {', '.join(sorted(ROLES))}, not {_shown(v)}", None),
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
        ("logprobs",): (_fixed("logprobs are not supported"), None),
        ("top_logprobs",): (_fixed("logprobs are not supported"), "logprobs"),
        ("logit_bias",): (_fixed("logit_bias is not supported"), None),
        ("response_format",): (_fixed("only response_format {\"type\": \"text\"} is supported"), None),
        ("modalities",): (_fixed("modalities must be a list of \"text\" and \"audio\""), None),
        ("audio",): (_fixed("modalities [\"text\", \"audio\"] need audio: {\"voice\": ..., \"format\": \"wav\"}"),
                     None),
        ("audio", "format"): (lambda at, v: "audio.format must be one of wav, pcm16 (omnid writes PCM; mp3, opus, "
                              f"flac and aac are not supported), not {_shown(v)}", None),
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


# ------------------------------------------------------------------ POST /v1/completions


class CompletionRequest(TextBody):
    """A completion. stream_options only with stream: true."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool | None = None
    suffix: None = None
    logprobs: None = None
    best_of: One = _checked_later({"const": 1})

    MESSAGES = {
        **TextBody.MESSAGES,
        ("prompt",): (_fixed("prompt must be a string (or a list of one string); token arrays and batches are "
                             "not supported"), None),
        ("echo",): (_fixed("echo must be true or false"), None),
        ("suffix",): (_fixed("suffix is not supported here"), None),
        ("logprobs",): (_fixed("logprobs is not supported here"), None),
        ("best_of",): (_fixed("best_of is not supported here"), None),     # (but 1)
    }

    @property
    def text(self) -> str:
        """The prompt (a list of one string is its string)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ------------------------------------------------------------------ POST /v1/images/generations


class ImageRequest(RequestBody):
    """An image, drawn by an image-ending pipeline, answered as b64_json (a PNG)."""

    ANSWER = "image"
    prompt: Annotated[str, Field(min_length=1)]
    n: One = _checked_later({"const": 1})
    # WIDTHxHEIGHT or "auto": what the pipeline's diffusers stage takes is its rule's (the schema says it)
    size: Annotated[str, Field(pattern=r"^(?:auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")] | None = None
    response_format: Literal["b64_json"] | None = None
    output_format: Literal["png"] | None = None

    MESSAGES = {
        **RequestBody.MESSAGES,
        ("prompt",): (_fixed("prompt must be a non-empty string"), None),
        ("n",): (lambda at, v: f"n must be 1 here (one job, one image), not {_shown(v)}", None),
        ("size",): (lambda at, v: f"size must be \"WIDTHxHEIGHT\" (e.g. \"64x64\") or \"auto\", not {_shown(v)}", None),
        ("response_format",): (_fixed("only response_format \"b64_json\" is supported (omnid serves no URLs)"), None),
        ("output_format",): (_fixed("only output_format \"png\" is supported"), None),
    }

    def width_height(self) -> tuple[int, int] | None:
        """The size asked, None for "auto" (the stage's own)."""
        if self.size is None or self.size == "auto":
            return None
        width, _, height = self.size.partition("x")
        return int(width), int(height)


# ------------------------------------------------------------------ POST /v1/audio/speech


class SpeechRequest(RequestBody):
    """Speech, by an audio-ending pipeline, streamed as it is produced."""

    ANSWER = "audio"
    input: Annotated[str, Field(min_length=1)]
    voice: Any = Field(None, description="given to a last stage that has `voice` in its defaults")
    response_format: Literal["wav", "pcm"] | None = None
    stream_format: Literal["audio", "sse"] | None = None

    MESSAGES = {
        **RequestBody.MESSAGES,
        ("input",): (_fixed("input must be a non-empty string"), None),
        ("response_format",): (lambda at, v: "response_format must be one of wav, pcm (omnid writes PCM: mp3, opus, "
                               f"aac and flac are not supported), not {_shown(v)}", None),
        ("stream_format",): (_fixed("stream_format must be \"audio\" (the bytes, as they come) or \"sse\" "
                                    "(speech.audio.delta events)"), None),
    }


REQUESTS: dict[str, type[RequestBody]] = {"ChatCompletionRequest": ChatCompletionRequest,
                                          "CompletionRequest": CompletionRequest, "ImageRequest": ImageRequest,
                                          "SpeechRequest": SpeechRequest}
