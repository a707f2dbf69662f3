"""The pipelines as OpenAI models, in process (`omnid.supervisor.http.openai.models`): a `model`
looked up (a pipeline, or `PIPELINE:ADAPTER`), the 404s in OpenAI's words, a model refused where its
answer is not the endpoint's, and the model documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnid.config import Config, DaemonConfig, EdgeConfig, PipelineConfig, StageConfig
from omnid.config_types import LoraConfig
from omnid.supervisor.http.openai.common import OpenAiError, RequestBody, adapter_choice, find_pipeline, pipeline_for
from omnid.supervisor.http.openai.models import adapter_model, model_doc

D = Path("/nonexistent")


def config() -> Config:
    stages = {
        "gen": StageConfig("gen", "vllm", model=D, lora=LoraConfig({"pirate": D / "pirate"})),
        "draw": StageConfig("draw", "diffusers", model=D),
    }
    pipelines = {"chat": PipelineConfig("chat", ("gen",), ()),
                 "t2i": PipelineConfig("t2i", ("gen", "draw"), (EdgeConfig("gen", "draw"),))}
    return Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D), stages, pipelines)


class NoJobs:
    """A store with no job (the engines here all declare their answers)."""

    def list(self, *args: Any) -> list[Any]:
        return []


def refused(name: Any) -> OpenAiError:
    with pytest.raises(OpenAiError) as e:
        find_pipeline(config(), name)
    return e.value


def test_a_model_is_a_pipeline_or_one_of_its_adapters() -> None:
    cfg = config()
    assert find_pipeline(cfg, "chat").name == "chat"
    assert find_pipeline(cfg, "chat:pirate").name == "chat"
    chat = cfg.pipelines["chat"]
    assert adapter_choice(cfg, chat, "chat:pirate") == ("gen", "pirate")
    assert adapter_choice(cfg, chat, "chat") is None and adapter_choice(cfg, chat, "chat:nope") is None
    assert adapter_model(cfg, 7.5, cfg.pipelines["chat"], "pirate") == {
        "id": "chat:pirate", "object": "model", "created": 7, "owned_by": "omnid", "parent": "chat",
        "root": str(D / "pirate"), "omnid": {"stage": "gen", "adapter": "pirate", "base": str(D)}}


def test_an_unknown_model_is_a_404_in_openais_words() -> None:
    e = refused(None)
    assert (e.status, e.param) == (400, "model") and "you must provide a model" in e.message
    e = refused("nope")
    assert (e.status, e.code) == (404, "model_not_found")
    assert e.message == "The model `nope` does not exist (the pipelines: chat, t2i)"
    e = refused("chat:nope")
    assert e.status == 404 and "pipeline 'chat' has no adapter 'nope' (its adapters: pirate)" in e.message


def test_a_model_must_give_the_endpoints_answer() -> None:
    cfg = config()
    asked = RequestBody.parse({"model": "t2i"})
    assert pipeline_for(cfg, NoJobs(), asked, "image").name == "t2i"      # type: ignore[arg-type]
    with pytest.raises(OpenAiError) as e:
        pipeline_for(cfg, NoJobs(), asked, "text")                          # type: ignore[arg-type]
    assert e.value.code == "model_not_supported" and e.value.param == "model"
    assert e.value.message == ("model 't2i' produces image, not text; /v1/chat/completions needs a pipeline "
                               "that ends in text")
    doc = model_doc(cfg, NoJobs(), 1.0, cfg.pipelines["chat"])                         # type: ignore[arg-type]
    assert doc["omnid"]["outputs"] == ["text"]
    assert doc["omnid"]["endpoints"] == ["/v1/chat/completions", "/v1/completions"]
