"""An OpenAI request's body checked into a job's params, in process
(`omnid.supervisor.http.openai_requests`): `n` / `stream` / `stream_options`, the sampling fields as
the token stage's params (checked by omnid's rules, each refusal naming its field), and the chat
features refused rather than ignored. (A chat's messages and media: tests/unit/test_media_config.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnid.config import Config, DaemonConfig, PipelineConfig, StageConfig
from omnid.supervisor.http.openai_errors import OpenAiError
from omnid.supervisor.http.openai_requests import refuse_chat_features, sampling, stream_options

D = Path("/nonexistent")


def config() -> Config:
    stages = {"gen": StageConfig("gen", "vllm", model=D, defaults={"max_tokens": 16}),
              "frame": StageConfig("frame", "python", function="m:f")}
    pipelines = {"chat": PipelineConfig("chat", ("gen",), ()), "framed": PipelineConfig("framed", ("frame",), ())}
    return Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D), stages, pipelines)


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


def test_the_sampling_fields_are_the_token_stages_params() -> None:
    cfg = config()
    chat = cfg.pipelines["chat"]
    body = {"max_completion_tokens": 8, "temperature": 0.5, "stop": [], "seed": None, "ignore_eos": True}
    assert sampling(cfg, chat, body, {"include_prompt": False}) == {
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
