"""`GET /v1/models`, `GET /v1/models/{model}`: the pipelines as OpenAI models, and each LoRA adapter
of a pipeline as a model of its own (`PIPELINE:ADAPTER`, as `vllm serve --lora-modules` lists them:
its `parent` is the pipeline; a request for it is the pipeline's job with the adapter stage's
`adapter` set, common.py: `adapter_choice`).

A model's `omnid.outputs` is what its pipeline produces: `text` for a vLLM last stage, `image` for
diffusers; for a python last stage, what it declares (its `produces`, or its function's), null when it
declares nothing (admission.answers); `omnid.endpoints` which endpoints take it; `omnid.media` the
media its chats may hold (`image`, `audio`, `video`). Pure functions of the config but the last
successful job's outputs looked up in the store; nothing blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from omnid.config import Config, PipelineConfig
from omnid.lora import adapter_stage, pipeline_adapters
from omnid.store import JobStore
from omnid.supervisor.http import admission
from omnid.supervisor.http.openai.common import ENDPOINTS, find_pipeline

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore


def model_doc(config: Config, store: JobStore, created: float, p: PipelineConfig) -> dict[str, Any]:
    """A pipeline as a model: what it produces, which endpoints take it, the media its chats may hold."""
    produces = admission.answers(config, store, p)
    endpoints = sorted({e for kind in (produces or ENDPOINTS) for e in ENDPOINTS.get(kind, [])})
    return {"id": p.name, "object": "model", "created": int(created), "owned_by": "omnid",
            "omnid": {"stages": list(p.stages), "engines": [config.stages[s].engine for s in p.stages],
                      "outputs": produces, "endpoints": endpoints,
                      "media": list(stage.media.kinds) if (stage := admission.media_stage(config, p)) else []}}


def adapter_model(config: Config, created: float, p: PipelineConfig, adapter: str) -> dict[str, Any]:
    """A LoRA adapter as a model of its own (`PIPELINE:ADAPTER`, its `parent` the pipeline)."""
    stage = adapter_stage(config, p)
    assert stage is not None
    return {"id": f"{p.name}:{adapter}", "object": "model", "created": int(created), "owned_by": "omnid",
            "parent": p.name, "root": str(config.stages[stage].adapters[adapter]),
            "omnid": {"stage": stage, "adapter": adapter, "base": str(config.stages[stage].model)}}


class Models:
    """The model handlers, on the `ApiCore`'s collaborators (config, store, info)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

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
