"""`POST /v1/images/generations`: an image drawn by a pipeline that ends in one, one ordinary omnid
job, answered as `b64_json` (a PNG; omnid serves no URLs), with its `revised_prompt` when the
pipeline wrote one (a `text` output named `prompt`).

Here: the body's model (`ImageRequest`) and the handler. A `size` sets the diffusers stage's width
and height, checked by that stage's rules. Runs in the supervisor's event-loop thread; the images are
read in the loop's default executor once the job succeeded.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field

from omnid.config import PipelineConfig
from omnid.engines.capabilities import job_param_problem
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import follow
from omnid.supervisor.http.openai.common import (
    One,
    OpenAiError,
    RequestBody,
    bad,
    checked_later,
    fixed,
    pipeline_for,
    read_body,
    shown,
    submit,
)
from omnid.supervisor.http.openai.jobs import Endpoint, pick, read_output, succeeded
from omnid.vocabulary import ErrorCode


class ImageRequest(RequestBody):
    """An image, drawn by an image-ending pipeline, answered as b64_json (a PNG)."""

    ANSWER = "image"
    prompt: Annotated[str, Field(min_length=1)]
    n: One = checked_later({"const": 1})
    # WIDTHxHEIGHT or "auto": what the pipeline's diffusers stage takes is its rule's (the schema says it)
    size: Annotated[str, Field(pattern=r"^(?:auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")] | None = None
    response_format: Literal["b64_json"] | None = None
    output_format: Literal["png"] | None = None

    MESSAGES = {
        **RequestBody.MESSAGES,
        ("prompt",): (fixed("prompt must be a non-empty string"), None),
        ("n",): (lambda at, v: f"n must be 1 here (one job, one image), not {shown(v)}", None),
        ("size",): (lambda at, v: f"size must be \"WIDTHxHEIGHT\" (e.g. \"64x64\") or \"auto\", not {shown(v)}", None),
        ("response_format",): (fixed("only response_format \"b64_json\" is supported (omnid serves no URLs)"), None),
        ("output_format",): (fixed("only output_format \"png\" is supported"), None),
    }

    def width_height(self) -> tuple[int, int] | None:
        """The size asked, None for "auto" (the stage's own)."""
        if self.size is None or self.size == "auto":
            return None
        width, _, height = self.size.partition("x")
        return int(width), int(height)


class Images(Endpoint):
    """The image handler."""

    async def handle(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        asked = ImageRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, asked, "image")
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
        job = submit(self.api, request, p, inputs, params, summary)
        try:
            async for _ in follow(request, self.api.scheduler, job.id):
                pass
            return web.json_response({"created": int(job.created_at), "data": await self._images(p, job.id)})
        finally:
            self.jobs.abandon(request, job.id)

    async def _images(self, p: PipelineConfig, job_id: str) -> list[dict[str, str]]:
        """The ended job's images as `b64_json` items; OpenAiError when it failed or drew none."""
        record = succeeded(self.api.scheduler, job_id)
        images = [o for o in record.outputs if o["kind"] == "image"]
        if not images:
            raise OpenAiError(500, f"job {job_id} of {p.name!r} produced no image "
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
        return data
