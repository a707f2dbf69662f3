"""An OpenAI request's body checked into a job's params, in process: its shape by its model
(each endpoint's model, on `omnid.supervisor.http.openai.common.RequestBody`: `n` / `stream` / `stream_options`, the chat features refused
rather than ignored, every problem said at once in omnid's words), then the sampling fields as the
token stage's params (`common.sampling`: checked by omnid's rules, each refusal naming its
field). (A chat's messages and media: tests/unit/config/test_media_config.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

from omnid.config import Config, DaemonConfig, PipelineConfig, StageConfig
from omnid.supervisor.http.openai.chat import ChatCompletionRequest
from omnid.supervisor.http.openai.common import OpenAiError, RequestBody, sampling
from omnid.supervisor.http.openai.completions import CompletionRequest
from omnid.supervisor.http.openai.images import ImageRequest
from omnid.supervisor.http.openai.speech import SpeechRequest
from omnid.supervisor.http.openapi_schemas import REQUESTS

D = Path("/nonexistent")


def config() -> Config:
    stages = {"gen": StageConfig("gen", "vllm", model=D, defaults={"max_tokens": 16}),
              "frame": StageConfig("frame", "python", function="m:f")}
    pipelines = {"chat": PipelineConfig("chat", ("gen",), ()), "framed": PipelineConfig("framed", ("frame",), ())}
    return Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D), stages, pipelines)


CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    return ChatCompletionRequest.parse({**CHAT, **body}).stream_flags()


def refuse_chat_features(body: dict[str, Any]) -> None:
    ChatCompletionRequest.parse({**CHAT, **body})


def refused(check: Any, *args: Any) -> OpenAiError:
    with pytest.raises(OpenAiError) as e:
        check(*args)
    assert e.value.status == 400
    return e.value


def test_n_stream_and_its_options() -> None:
    assert stream_options({}) == (False, False)
    assert stream_options({"n": 1, "stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert refused(stream_options, {"n": 2}).param == "n"
    assert refused(stream_options, {"n": True}).param == "n"
    assert refused(stream_options, {"stream": "yes"}).param == "stream"
    assert refused(stream_options, {"stream_options": {"include_usage": True}}).message == \
        "stream_options is only allowed when stream is true"
    assert refused(stream_options, {"stream": True, "stream_options": {"include_usage": 1}}).param == "stream_options"
    assert stream_options({"n": 1.0}) == (False, False)                 # JSON's one


def test_the_sampling_fields_are_the_token_stages_params() -> None:
    cfg = config()
    chat = cfg.pipelines["chat"]
    body = {"max_completion_tokens": 8, "temperature": 0.5, "stop": [], "seed": None, "ignore_eos": True}
    given = ChatCompletionRequest.parse({**CHAT, **body}).sampling_values()
    assert given == {"max_completion_tokens": 8, "temperature": 0.5, "stop": [], "ignore_eos": True}
    assert sampling(cfg, chat, given, {"include_prompt": False}) == {
        "gen": {"max_tokens": 8, "temperature": 0.5, "ignore_eos": True, "include_prompt": False}}
    e = refused(sampling, cfg, chat, {"temperature": "hot"}, {})
    assert e.param == "temperature" and e.message.startswith("temperature: ")
    assert sampling(cfg, cfg.pipelines["framed"], {"temperature": "hot"}, {}) == {}   # nothing samples there


def test_the_chat_features_omnid_does_not_do_are_refused() -> None:
    refuse_chat_features({"tools": [], "tool_choice": "auto", "logprobs": False, "logit_bias": {},
                          "response_format": {"type": "text"}, "function_call": "none"})
    for body, param in (({"tools": [{"type": "function"}]}, "tools"), ({"functions": [{}]}, "functions"),
                        ({"function_call": "auto"}, "function_call"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "logprobs"),
                        ({"logit_bias": {"1": 2}}, "logit_bias"),
                        ({"response_format": {"type": "json_object"}}, "response_format")):
        assert refused(refuse_chat_features, body).param == param


def test_every_problem_of_a_body_is_said_at_once_in_plain_words() -> None:
    e = refused(refuse_chat_features, {"n": 2, "stream": "yes", "tools": [{"type": "function"}], "top_logprobs": 3})
    assert e.param == "n"
    assert e.message == ("n must be 1 here (one job, one answer), not 2; stream must be true or false; tools and "
                         "function calling are not supported; logprobs are not supported")
    e = refused(CompletionRequest.parse, {"model": "chat", "prompt": ["a", "b"], "echo": "y", "best_of": 2})
    assert e.param == "prompt"
    assert e.message == ("prompt must be a string (or a list of one string); token arrays and batches are not "
                         "supported; echo must be true or false; best_of is not supported here")
    assert CompletionRequest.parse({"model": "chat", "prompt": ["once"]}).text == "once"


def test_a_problem_no_message_names_is_still_said_in_plain_words() -> None:
    """Pydantic's own words ("Input should be ...", "[type=...]") never reach a caller."""
    e = refused(refuse_chat_features, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert (e.param, e.message) == ("messages[0].content[0]",
                                    "messages[0].content[0].image_url must be {\"url\": \"data:image/...;base64,...\"}")
    e = refused(refuse_chat_features, {"stream_options": {"include_usage": True}, "stream": True, "model": ""})
    assert (e.param, e.message) == ("model", "you must provide a model parameter (a pipeline's name)")

    class Sized(RequestBody):                 # a body whose fields have no message of their own
        width: int
        tags: Annotated[list[str], Field(max_length=1)] = []

    e = refused(Sized.parse, {"model": "m", "width": "8", "tags": ["a", "b"]})
    assert (e.param, e.message) == ("width", "width must be an integer, not '8'; tags must have at most 1 item(s), "
                                             "not ['a', 'b']")
    assert refused(Sized.parse, {"model": "m"}).message == "width is required"


def test_images_and_speech_bodies() -> None:
    image = {"model": "t2i", "prompt": "a fox"}
    assert ImageRequest.parse({**image, "size": "64x48"}).width_height() == (64, 48)
    assert ImageRequest.parse({**image, "size": "auto"}).width_height() is None
    e = refused(ImageRequest.parse, {**image, "prompt": "", "n": 2, "output_format": "jpeg"})
    assert e.param == "prompt" and e.message == ("prompt must be a non-empty string; n must be 1 here (one job, one "
                                                 "image), not 2; only output_format \"png\" is supported")
    speech = SpeechRequest.parse({"model": "speak", "input": "hi", "voice": {"id": "v"}, "stream_format": "sse"})
    assert (speech.input, speech.voice, speech.response_format, speech.stream_format) == ("hi", {"id": "v"}, None, "sse")
    assert refused(SpeechRequest.parse, {"model": "speak", "input": "hi", "stream_format": "ws"}).param == "stream_format"


# Bodies whose shape alone decides (no sampling value a stage's rule refuses, no rule across fields).
SHAPES: list[tuple[type[RequestBody], dict[str, Any]]] = [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
    (ChatCompletionRequest, {"messages": [{"role": "assistant", "content": None}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}], "n": 1, "stream": True,
        "stream_options": {"include_usage": False}, "tools": [], "tool_choice": "auto", "logprobs": False,
        "logit_bias": {}, "response_format": {"type": "text"}, "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "pcm16"}, "temperature": 0.5, "priority": -3}),
    (ChatCompletionRequest, {"messages": []}), (ChatCompletionRequest, {"messages": [{"role": "robot", "content": ""}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "a", "format": "mp3"}}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}}),
    (CompletionRequest, {"prompt": "x", "echo": True, "best_of": 1, "max_tokens": 4}),
    (CompletionRequest, {"prompt": ["x"]}), (CompletionRequest, {"prompt": ["x", "y"]}), (CompletionRequest, {}),
    (CompletionRequest, {"prompt": [1, 2]}), (CompletionRequest, {"prompt": "x", "suffix": "y"}),
    (CompletionRequest, {"prompt": "x", "echo": 1}),
    (ImageRequest, {"prompt": "a fox", "size": "64x64", "n": 1, "response_format": "b64_json", "output_format": "png"}),
    (ImageRequest, {"prompt": ""}), (ImageRequest, {"prompt": "a", "size": "big"}),
    (ImageRequest, {"prompt": "a", "response_format": "url"}),
    (SpeechRequest, {"input": "hi", "voice": "v", "response_format": "pcm", "stream_format": "audio"}),
    (SpeechRequest, {"input": ""}), (SpeechRequest, {"input": "hi", "response_format": "mp3"}),
]


@pytest.mark.parametrize("model, body", SHAPES)
def test_the_openapi_schema_is_the_model(model: type[RequestBody], body: dict[str, Any]) -> None:
    """The OpenAPI document's schema of each body (generated from its model) takes what the model
    takes and refuses what it refuses."""
    import jsonschema
    from aiohttp import web

    from omnid.supervisor.http.openapi import openapi_document
    doc = openapi_document(web.Application(), draw_config(), "1")
    name = next(n for n, m in REQUESTS.items() if m is model)
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **doc})
    body = {"model": doc["components"]["schemas"][name]["properties"]["model"]["enum"][0], **body}
    try:
        model.parse(body)
        parsed = True
    except OpenAiError:
        parsed = False
    assert validator.is_valid(body) == parsed, (body, parsed)


def draw_config() -> Config:
    stages = {"gen": StageConfig("gen", "vllm", model=D), "draw": StageConfig("draw", "diffusers", model=D),
              "speak": StageConfig("speak", "python", function="m:f", produces=("audio",))}
    pipelines = {"chat": PipelineConfig("chat", ("gen",), ()), "t2i": PipelineConfig("t2i", ("draw",), ()),
                 "speak": PipelineConfig("speak", ("speak",), ())}
    return Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D), stages, pipelines)


def test_a_huge_wrong_value_is_shown_cut() -> None:
    e = refused(refuse_chat_features, {"messages": [{"role": "x" * 1_000_000, "content": "hi"}]})
    assert e.param == "messages[0].role" and len(e.message) < 200 and "(1000002 characters)" in e.message


def test_a_message_without_content_is_an_assistants_only() -> None:
    from omnid.supervisor.http.openai.chat import chat_messages
    chat = ChatCompletionRequest.parse({**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                                             {"role": "assistant"}, {"role": "user", "content": "hi"}]})
    assert chat_messages(chat.messages) == ([{"role": "system", "content": "be brief"},
                                             {"role": "assistant", "content": ""},
                                             {"role": "user", "content": "hi"}], [])
    with pytest.raises(OpenAiError) as e:
        chat_messages(ChatCompletionRequest.parse({**CHAT, "messages": [{"role": "user", "content": None}]}).messages)
    assert (e.value.param, e.value.message) == ("messages[0].content", "messages[0].content must be a string or an "
                                                                       "array of content parts")


def test_an_image_size_is_described_by_the_diffusers_rule() -> None:
    """The body's model takes any WIDTHxHEIGHT; the document says what the config's diffusers stage
    takes (8 to 4096, multiples of 8), which the handler checks after."""
    import jsonschema
    from aiohttp import web

    from omnid.supervisor.http.openapi import openapi_document
    doc = openapi_document(web.Application(), draw_config(), "1")
    size = jsonschema.Draft202012Validator(doc["components"]["schemas"]["ImageRequest"]["properties"]["size"])
    assert [size.is_valid(s) for s in ("64x64", "auto", None, "60x60", "8x4104")] == [True, True, True, False, False]
    assert ImageRequest.parse({"model": "t2i", "prompt": "a", "size": "60x60"}).width_height() == (60, 60)
