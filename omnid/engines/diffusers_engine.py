"""The `diffusers` engine: a diffusion pipeline (UNet or DiT) loaded from a local directory.

Runs in a stage worker's main thread. One `step()` is one whole pipeline
call; `callback_on_step_end` reports every denoising step as progress and
raises `Cancelled` when the job was cancelled, so a cancel ends the call
within one denoising step. Job inputs other than `prompt` that the
pipeline's `__call__` accepts (e.g. `image` for img2img) are passed through.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from omnid.config import StageConfig
from omnid.params import merged
from omnid.engines.base import Cancelled, Engine, RequestContext

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


class DiffusersEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        warnings.filterwarnings("ignore", category=FutureWarning)
        import torch
        from diffusers import DiffusionPipeline

        self.torch = torch
        self.stage = stage
        args = dict(stage.args)
        dtype_name = _DTYPES.get(str(args.pop("dtype", "float32")))
        if dtype_name is None:
            raise ValueError(f"stages.{stage.name}.args.dtype must be one of {', '.join(_DTYPES)}")
        self.device = "cuda" if stage.devices and torch.cuda.is_available() else "cpu"
        self.pipe = DiffusionPipeline.from_pretrained(str(stage.model), torch_dtype=getattr(torch, dtype_name),
                                                      **args)
        self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self._call_args = set(inspect.signature(self.pipe.__call__).parameters)
        self._queue: list[RequestContext] = []

    def info(self) -> dict[str, Any]:
        return {"model": str(self.stage.model), "pipeline": type(self.pipe).__name__, "device": self.device}

    def add(self, ctx: RequestContext) -> None:
        if not isinstance(ctx.inputs.get("prompt"), str):
            ctx.fail(f"a diffusers stage needs a text input \"prompt\"; got {sorted(ctx.inputs) or 'no inputs'}")
            return
        self._queue.append(ctx)

    def step(self) -> None:
        ctx = self._queue.pop(0)
        params = merged(self.stage.defaults, ctx.params)
        seed = params.pop("seed", None)
        try:
            steps = int(params.get("num_inference_steps", 50))
            generator = None
            if seed is not None:
                generator = self.torch.Generator(device=self.device).manual_seed(int(seed))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            ctx.fail(f"bad parameter: {type(e).__name__}: {e}")
            return
        extra = {k: v for k, v in ctx.inputs.items() if k != "prompt" and k in self._call_args}

        def on_step_end(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if ctx.cancelled():
                raise Cancelled()
            ctx.progress(step + 1, steps)
            return kwargs

        try:
            result = self.pipe(prompt=ctx.inputs["prompt"], generator=generator,
                               callback_on_step_end=on_step_end, **extra, **params)
        except Cancelled:
            ctx.stopped()
            return
        except Exception as e:
            ctx.fail(f"{type(e).__name__}: {e}")
            return
        images = list(result.images)
        ctx.segment({"image": images[-1]}, is_last=True)
        ctx.finish({"image": images[0] if len(images) == 1 else images, "prompt": ctx.inputs["prompt"]})

    def abort(self, job: str) -> None:
        for ctx in [c for c in self._queue if c.job == job]:
            self._queue.remove(ctx)
            ctx.stopped()

    def has_work(self) -> bool:
        return bool(self._queue)
