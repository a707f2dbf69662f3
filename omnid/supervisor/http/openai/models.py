"""The pipelines as OpenAI models: a `model` looked up (a pipeline's name, or `PIPELINE:ADAPTER` for
one of its LoRA adapters), the model documents of `GET /v1/models`, and the check that a model gives
the answer an endpoint needs.

Runs in the supervisor's event-loop thread, called by the OpenAI handlers (openai_api.py,
openai_audio.py), the job submission (openai_jobs.py: an adapter model sets its stage's `adapter`)
and the realtime door (realtime.py). Pure functions of the config (what each stage
produces is declared there: admission.answers); nothing blocks.
"""

from __future__ import annotations

from typing import Any

from omnid.config import Config, PipelineConfig
from omnid.lora import adapter_stage, pipeline_adapters
from omnid.store import JobStore
from omnid.supervisor.http import admission
from omnid.supervisor.http.openai.common import OpenAiError, bad
from omnid.vocabulary import ErrorCode

# What each kind of answer is asked on (a model's `omnid.endpoints`).
ENDPOINTS = {"text": ["/v1/chat/completions", "/v1/completions"], "image": ["/v1/images/generations"],
             "audio": ["/v1/audio/speech"]}


def model_doc(config: Config, store: JobStore, created: float, p: PipelineConfig) -> dict[str, Any]:
    """A pipeline as a model: what it produces, which endpoints take it, the media its chats may hold."""
    produces = admission.answers(config, store, p)
    endpoints = sorted({e for kind in (produces or ENDPOINTS) for e in ENDPOINTS.get(kind, [])})
    return {"id": p.name, "object": "model", "created": int(created), "owned_by": "omnid",
            "omnid": {"stages": list(p.stages), "engines": [config.stages[s].engine for s in p.stages],
                      "outputs": produces, "endpoints": endpoints,
                      "media": list(stage.media.kinds) if (stage := admission.media_stage(config, p)) else []}}


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


def pipeline_for(config: Config, store: JobStore, body: dict[str, Any], *kinds: str) -> PipelineConfig:
    """The pipeline named by `model` (looked up once), if it produces each of `kinds` (or may: a
    last stage whose engine declares no answer, untried)."""
    p = find_pipeline(config, body.get("model"))
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


def adapter_model(config: Config, created: float, p: PipelineConfig, adapter: str) -> dict[str, Any]:
    """A LoRA adapter as a model of its own (`PIPELINE:ADAPTER`, its `parent` the pipeline)."""
    stage = adapter_stage(config, p)
    assert stage is not None
    return {"id": f"{p.name}:{adapter}", "object": "model", "created": int(created), "owned_by": "omnid",
            "parent": p.name, "root": str(config.stages[stage].adapters[adapter]),
            "omnid": {"stage": stage, "adapter": adapter, "base": str(config.stages[stage].model)}}
