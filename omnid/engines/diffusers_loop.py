"""omnid's own denoising loop for a diffusers stage: step-level (continuous) batching.

Runs in a stage worker's main thread, called by `omnid.engines.diffusers_engine`
while the main thread waits (it blocks in torch for one denoising step of one batch at a time).
It never calls a job's context but to read its inputs.

A `Driver` knows one pipeline family's loop (what its `__call__` does, split in three): `prepare`
a row (its prompt encoded, its noise drawn from its own generator, its own scheduler with its own
timestep schedule), `step` a batch of rows (ONE UNet / transformer forward for every row, each row
at its own timestep with its own guidance, then each row's own scheduler step) and `decode` a
row's latents into its image. Rows of one batch may be at different timesteps: a job joins at the
next step boundary and leaves when its own schedule ends. The arithmetic per row is the pipeline's
own (checked against diffusers 0.42), so a job's image is the one its seed gives alone, but for
what a different batch shape changes in the kernels (tests/test_diffusers_joining.py states the
tolerance).

`driver_for` says which pipelines have a driver: StableDiffusionPipeline (a UNet, a scheduler with
no state of the whole batch: each row has its own instance) and FluxPipeline (a DiT, flow-matching
Euler). Every other pipeline keeps call-level batching. A request whose parameters the loop does
not take (several images per prompt, other inputs such as `image`, Flux with `eta`) runs as a
pipeline call of its own.

`cache` (a DiT's cache hook of a kind that keeps state per `cache_context`): each row runs its
transformer forward in its own context (`row-N`), so its cache decides on its own residuals, and
its hits and misses are its own; the context's state is dropped when the row leaves. Such a
stage's rows still join at a step and share the step's loop, but its transformer runs once per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnid.engines.base import RequestContext

# Parameters the loop takes (the rest of DIFFUSERS_PARAMS is taken out before: seed, negative_prompt, adapters).
_SD_PARAMS = frozenset({"num_inference_steps", "guidance_scale", "height", "width", "eta", "guidance_rescale",
                        "num_images_per_prompt"})
_FLUX_PARAMS = frozenset({"num_inference_steps", "guidance_scale", "height", "width", "num_images_per_prompt"})
_names = itertools.count()


class ForwardTimes:
    """The step loop's measured times on the CPU, by latent shape: a forward's, by its rows, and a
    row's prepare (its prompt encoded, its noise drawn). They say when a forward gives way to a job
    that arrives during it (DiffusersEngine._gives_way_until): while more of it is left than that
    job's own way to its first step (`join_time`), which a newcomer would otherwise wait on top of it.

    A CPU's forward grows with its rows, by how much depends on the host: the tiny SD at 64 px with
    guidance, on a 2-core EPYC (Zen 5), took 29, 43, 75 and 119 ms at 1, 2, 4 and 8 rows (a row's
    prepare: 5 ms); on a Sapphire Rapids, about the same per row at any size. A size's first forward
    only warms its kernels: its time counts from the second."""

    _WEIGHT = 0.25          # of a new time in the running means

    def __init__(self) -> None:
        self._seconds: dict[tuple[str, int], float] = {}     # (shape, rows) -> a forward's mean time
        self._runs: dict[tuple[str, int], int] = {}
        self._prepare: dict[str, float] = {}                  # shape -> a row's mean prepare time

    def took(self, key: str, rows: int) -> float | None:
        """A forward's mean time, None before it is timed."""
        return self._seconds.get((key, rows))

    def join_time(self, key: str) -> float | None:
        """A lone job's way to its first step: a row's prepare and one row's forward."""
        one = self._seconds.get((key, 1))
        return None if one is None else one + self._prepare.get(key, 0.0)

    def ran(self, key: str, rows: int, seconds: float) -> None:
        """A forward of `rows` rows of shape `key` took `seconds`."""
        runs = self._runs[(key, rows)] = self._runs.get((key, rows), 0) + 1
        if runs > 1:
            self._seconds[(key, rows)] = self._mean(self._seconds.get((key, rows)), seconds)

    def prepared(self, key: str, seconds: float) -> None:
        """A row of shape `key` took `seconds` to prepare."""
        self._prepare[key] = self._mean(self._prepare.get(key), seconds)

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self._WEIGHT * (new - old)

    def timed(self) -> dict[str, dict[str, float]]:
        """The mean times in ms, by shape: `prepare`, and each size's forward by its rows."""
        out: dict[str, dict[str, float]] = {}          # (copies first: the heartbeat thread reads it)
        for key, seconds in sorted(dict(self._prepare).items()):
            out.setdefault(key, {})["prepare"] = round(seconds * 1000, 1)
        for (key, rows), seconds in sorted(dict(self._seconds).items()):
            out.setdefault(key, {})[str(rows)] = round(seconds * 1000, 1)
        return out

@dataclass
class Row:
    """One job's image in the loop: its conditioning, latents and scheduler, and how far it got."""

    ctx: RequestContext
    key: str                        # rows of equal keys share a forward (the same latent shape)
    adapters: tuple[tuple[str, float], ...]
    steps: int
    scheduler: Any
    timesteps: list[Any]
    latents: Any                    # batch dimension 1
    cond: dict[str, Any]            # the driver's conditioning tensors (batch dimension 1)
    guidance: float
    generator: Any
    height: int
    width: int
    extra: dict[str, Any] = field(default_factory=dict)     # per-row step options (eta, guidance_rescale)
    done: int = 0                   # denoising steps taken
    hits: int = 0                   # its cache's hits and misses (a cached DiT stage)
    misses: int = 0
    context: str = field(default_factory=lambda: f"row-{next(_names)}")
    error: str | None = None        # its own scheduler step failed (the engine fails its job)
    gave_way: bool = False          # a forward with it gave way: the next one with it does not

    @property
    def finished(self) -> bool:
        return self.done >= len(self.timesteps)


class Driver:
    """One pipeline family's denoising loop; `pipe` is the loaded pipeline."""

    params: frozenset[str] = frozenset()

    def __init__(self, pipe: Any, torch: Any, device: str, per_row: bool = False, counter: Any = None) -> None:
        self.pipe, self.torch, self.device = pipe, torch, device
        self.per_row = per_row          # a cache hook on the transformer: one context per row
        self.counter = counter          # the hook's `_CacheCounter`, when it counts hits

    def takes(self, params: Mapping[str, Any], extra: Mapping[str, Any], negative: str | None) -> bool:
        """The loop can run a request of these parameters (else: a pipeline call)."""
        return not extra and set(params) <= self.params and int(params.get("num_images_per_prompt", 1) or 1) == 1

    def key(self, params: Mapping[str, Any]) -> str:
        """Rows of equal keys can share one forward."""
        height, width = self.size(params)
        return f"{height}x{width}"

    def size(self, params: Mapping[str, Any]) -> tuple[int, int]:
        raise NotImplementedError

    def prepare(self, ctx: RequestContext, key: str, adapters: tuple[tuple[str, float], ...], params: Mapping[str, Any],
                negative: str | None, generator: Any) -> Row:
        raise NotImplementedError

    def step(self, rows: list[Row]) -> None:
        raise NotImplementedError

    def decode(self, row: Row) -> Any:
        raise NotImplementedError

    def forget(self, row: Row) -> None:
        """A row left the loop: drop what the cache keeps for it."""
        if self.per_row:
            forget_context(self.pipe.transformer, row.context)


def _advance(row: Row, scheduler_step: Callable[[], Any]) -> None:
    """One row's scheduler step; an error there (its own values) fails that row alone (`row.error`)."""
    try:
        row.latents = scheduler_step()
    except Exception as e:                      # noqa: BLE001 - reported as the job's failure
        row.error = f"{type(e).__name__}: {e}"
        return
    row.done += 1


def forget_context(model: Any, name: str) -> None:
    """Drop one `cache_context`'s state from every stateful hook of `model`."""
    from diffusers.hooks.hooks import StateManager

    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook in registry.hooks.values():
            for value in vars(hook).values():
                if isinstance(value, StateManager):
                    value._state_cache.pop(name, None)


class StableDiffusionDriver(Driver):
    """StableDiffusionPipeline.__call__ (text to image, no IP adapter), one row at a time but the UNet."""

    params = _SD_PARAMS

    def size(self, params: Mapping[str, Any]) -> tuple[int, int]:
        default = self.pipe.unet.config.sample_size * self.pipe.vae_scale_factor
        return int(params.get("height") or default), int(params.get("width") or default)

    def prepare(self, ctx: RequestContext, key: str, adapters: tuple[tuple[str, float], ...], params: Mapping[str, Any],
                negative: str | None, generator: Any) -> Row:
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        pipe = self.pipe
        height, width = self.size(params)
        guidance = float(params.get("guidance_scale", 7.5))
        cfg = guidance > 1
        steps = int(params.get("num_inference_steps", 50))
        with self.torch.no_grad():
            embeds, negative_embeds = pipe.encode_prompt(ctx.inputs["prompt"], self.device, 1, cfg, negative)
            scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            timesteps, _ = retrieve_timesteps(scheduler, steps, self.device)
            latents = pipe.prepare_latents(1, pipe.unet.config.in_channels, height, width, embeds.dtype, self.device,
                                           generator, None)
        extra = pipe.prepare_extra_step_kwargs(generator, float(params.get("eta", 0.0)))
        cond = {"embeds": embeds, "negative": negative_embeds if cfg else None,
                "rescale": float(params.get("guidance_rescale", 0.0))}
        return Row(ctx, key, adapters, steps, scheduler, list(timesteps), latents, cond, guidance, generator,
                   height, width, extra)

    def step(self, rows: list[Row]) -> None:
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

        torch = self.torch
        with torch.no_grad():
            inputs, embeds, times = [], [], []
            for row in rows:                # [uncond, cond] per row with guidance, as the pipeline's cat
                t = row.timesteps[row.done]
                n = 2 if row.cond["negative"] is not None else 1
                latent = torch.cat([row.latents] * n) if n == 2 else row.latents
                inputs.append(row.scheduler.scale_model_input(latent, t))
                embeds += [row.cond["negative"], row.cond["embeds"]] if n == 2 else [row.cond["embeds"]]
                times += [t] * n
            sample = torch.cat(inputs)
            timestep = torch.stack([torch.as_tensor(t) for t in times]).to(self.device)
            noise = self.pipe.unet(sample, timestep, encoder_hidden_states=torch.cat(embeds), return_dict=False)[0]
            at = 0
            for row in rows:
                t = row.timesteps[row.done]
                if row.cond["negative"] is not None:
                    uncond, text = noise[at:at + 1], noise[at + 1:at + 2]
                    at += 2
                    pred = uncond + row.guidance * (text - uncond)
                    if row.cond["rescale"] > 0.0:
                        pred = rescale_noise_cfg(pred, text, guidance_rescale=row.cond["rescale"])
                else:
                    pred = noise[at:at + 1]
                    at += 1
                _advance(row, lambda: row.scheduler.step(pred, t, row.latents, **row.extra, return_dict=False)[0])

    def decode(self, row: Row) -> Any:
        pipe = self.pipe
        with self.torch.no_grad():
            image = pipe.vae.decode(row.latents / pipe.vae.config.scaling_factor, return_dict=False,
                                    generator=row.generator)[0]
            image, nsfw = pipe.run_safety_checker(image, self.device, row.cond["embeds"].dtype)
            denormalize = [True] * image.shape[0] if nsfw is None else [not x for x in nsfw]
            return pipe.image_processor.postprocess(image, output_type="pil", do_denormalize=denormalize)[0]


class FluxDriver(Driver):
    """FluxPipeline.__call__ (no true CFG, no IP adapter): one transformer forward for every row."""

    params = _FLUX_PARAMS

    def size(self, params: Mapping[str, Any]) -> tuple[int, int]:
        default = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return int(params.get("height") or default), int(params.get("width") or default)

    def prepare(self, ctx: RequestContext, key: str, adapters: tuple[tuple[str, float], ...], params: Mapping[str, Any],
                negative: str | None, generator: Any) -> Row:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe = self.pipe
        height, width = self.size(params)
        steps = int(params.get("num_inference_steps", 28))
        with self.torch.no_grad():
            embeds, pooled, text_ids = pipe.encode_prompt(prompt=ctx.inputs["prompt"], prompt_2=None,
                                                          device=self.device, num_images_per_prompt=1)
            latents, image_ids = pipe.prepare_latents(1, pipe.transformer.config.in_channels // 4, height, width,
                                                      embeds.dtype, self.device, generator, None)
            config = pipe.scheduler.config
            scheduler = type(pipe.scheduler).from_config(config)
            sigmas = None if getattr(config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
            mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                                 config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                 config.get("max_shift", 1.15))
            timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
            scheduler.set_begin_index(0)
        cond = {"embeds": embeds, "pooled": pooled, "text_ids": text_ids, "image_ids": image_ids}
        return Row(ctx, key, adapters, steps, scheduler, list(timesteps), latents, cond,
                   float(params.get("guidance_scale", 3.5)), generator, height, width)

    def _forward(self, rows: list[Row]) -> Any:
        torch = self.torch
        first = rows[0].cond
        latents = torch.cat([r.latents for r in rows])
        timestep = torch.cat([r.timesteps[r.done].expand(1).to(latents.dtype) for r in rows])
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.tensor([r.guidance for r in rows], device=self.device, dtype=torch.float32)
        return self.pipe.transformer(
            hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
            pooled_projections=torch.cat([r.cond["pooled"] for r in rows]),
            encoder_hidden_states=torch.cat([r.cond["embeds"] for r in rows]),
            txt_ids=first["text_ids"], img_ids=first["image_ids"], joint_attention_kwargs={}, return_dict=False)[0]

    def step(self, rows: list[Row]) -> None:
        with self.torch.no_grad():
            if not self.per_row:
                noise = list(self._forward(rows).split(1))
            else:
                noise = []
                for row in rows:            # each row's cache decides on its own residuals
                    if self.counter is not None:
                        self.counter.start_call()
                    with self.pipe.transformer.cache_context(row.context):
                        noise.append(self._forward([row]))
                    if self.counter is not None:
                        row.hits += self.counter.call_hits
                        row.misses += self.counter.call_misses
            for row, pred in zip(rows, noise):
                t = row.timesteps[row.done]
                _advance(row, lambda: row.scheduler.step(pred, t, row.latents, return_dict=False)[0])

    def decode(self, row: Row) -> Any:
        pipe = self.pipe
        with self.torch.no_grad():
            latents = pipe._unpack_latents(row.latents, row.height, row.width, pipe.vae_scale_factor)
            latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
            image = pipe.vae.decode(latents, return_dict=False)[0]
            return pipe.image_processor.postprocess(image, output_type="pil")[0]


_DRIVERS: dict[str, Callable[..., Driver]] = {"StableDiffusionPipeline": StableDiffusionDriver,
                                               "FluxPipeline": FluxDriver}


def driver_for(pipe: Any, torch: Any, device: str, cache: Any, cache_kind: str | None,
               per_context: frozenset[str]) -> tuple[Driver | None, str]:
    """The loop for this pipeline, or None and why not (then: call-level batching)."""
    name = type(pipe).__name__
    make = _DRIVERS.get(name)
    if make is None:
        return None, f"omnid has no denoising loop for {name} (it has one for {', '.join(sorted(_DRIVERS))})"
    if name == "StableDiffusionPipeline" and getattr(pipe.unet.config, "time_cond_proj_dim", None) is not None:
        return None, "a UNet with a guidance embedding (an LCM) is not driven by the loop"
    if cache_kind is not None and cache_kind not in per_context:
        return None, f"cache kind {cache_kind!r} keeps no state per context: rows could not have their own"
    return make(pipe, torch, device, cache_kind is not None, cache), ""
