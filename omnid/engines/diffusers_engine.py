"""The `diffusers` engine: a diffusion pipeline (UNet or DiT) loaded from a local directory.

Runs in a stage worker's main thread. `callback_on_step_end` reports every
denoising step as progress, and a cancel ends a request within one denoising
step. Job inputs other than `prompt` that the pipeline's `__call__` accepts
(e.g. `image` for img2img) are passed through.

`max_inflight = 1`: one `step()` is one whole pipeline call, made in the main
thread, which blocks in it; the callback raises `Cancelled` when the job was
cancelled.

`max_inflight > 1` and a pipeline omnid's own denoising loop drives (Stable Diffusion, Flux; see
omnid.engines.diffusers_loop), unless the stage says `batching = "call"`: step-level batching,
all in the main thread. One `step()` admits the queued requests that can join (the oldest first, up to
max_inflight rows, all of one adapter set; the first that cannot join stops the ones behind it),
then runs one denoising step of some rows of one latent shape: one forward for them, each at its
own timestep. Which rows (`_next_forward`): those that just joined first, by themselves, then the
fewest steps left; every row of that shape. On the CPU, where a forward's time grows with its rows,
a job that arrives during a forward, and that the worker would take at once (a slot free), makes
it give way (`_give_way`, a pre-hook of the denoiser's blocks) while more of it is left than the
newcomer's own way to its first step: the forward is given up (no row moved), the newcomer is taken
and its first step runs, then the forward again; a row's forward gives way once, the next one with
that row does not (`ForwardTimes` has the measured times; not a DiT with a `cache`, whose hooks
keep state inside a forward). A row whose schedule ended is decoded and delivered
in that `step()`; a cancelled one leaves before the next. A request the loop does not take
(other inputs, several images per prompt) waits for the loop to empty and runs as a call, below.

Otherwise, `max_inflight > 1` (call-level): compatible requests (the same parameters but for `seed`
and `negative_prompt`'s text, a text prompt and no other inputs, one image
each) run as ONE pipeline call with a list of prompts and one
`torch.Generator` per request, so each request's image is the one its seed
gives alone. That call runs in a helper thread ("diffusers-batch") that is
never running at the same time as the main thread: at the end of each
denoising step the callback hands control back to the main thread and waits
for the next `step()`. So one `step()` is one denoising step of the batch (the
first one also encodes the prompts, the last one also decodes), and between
steps the worker's loop runs as it does for vLLM: a cancelled request is
aborted (`ctx.stopped()`), its slot frees and its `Stopped` goes out at once,
while the others go on. Its rows leave the batch's tensors at the next step
when the pipeline and scheduler are known to allow it (`_SHRINKABLE_*`);
otherwise they are still computed and thrown away. Every `ctx` call is made
in the main thread. The main thread blocks on the helper thread's reply for
one denoising step at a time.

`cache` (a DiT pipeline's transformer only; see omnid.config.CACHE_KINDS): diffusers' cache hook of
that kind goes on `pipe.transformer` at load (`enable_cache`). Its state is reset before every call
(a cancelled call never reaches the pipeline's own reset). For the kinds that decide per transformer
call whether to run the remaining blocks (first_block, mag_cache: their state's `should_compute`), a
forward hook on the head block reads that decision: a skip is a hit, a full run a miss. Each job's stage result carries its
call's counts (`usage`: cache_hits, cache_misses; in a call-level batch, each row the batch's; in
the step loop each row has its own cache context, and its own counts), and the worker's
heartbeat the stage's totals (`cache_counts`).
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnid.config_types import StageConfig
from omnid.engines.base import Cancelled, Engine, RequestContext
from omnid.engines.capabilities import DIFFUSERS, check_param
from omnid.engines.diffusers_loop import Driver, ForwardTimes, Row, driver_for
from omnid.lora import job_adapters
from omnid.params import merged
from omnid.vocabulary import ErrorCode

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}

# Pipelines whose denoising loop reads back every batched tensor it uses from `callback_kwargs`
# (checked against diffusers 0.42: SD reads latents and prompt_embeds, SDXL also add_text_embeds
# and add_time_ids, and nothing after the loop depends on the original batch size), and
# schedulers that keep no per-sample state between steps (multistep ones such as PNDM, DPM-Solver,
# UniPC, LMS or Heun keep earlier model outputs of the full batch). Only with both are a
# cancelled request's rows removed mid-call.
_SHRINKABLE_PIPELINES = frozenset({"StableDiffusionPipeline", "StableDiffusionXLPipeline"})
_SHRINKABLE_SCHEDULERS = frozenset({"DDIMScheduler", "DDPMScheduler", "EulerDiscreteScheduler",
                                    "EulerAncestralDiscreteScheduler"})
_BATCHED_TENSORS = ("latents", "prompt_embeds", "add_text_embeds", "add_time_ids")


# Kinds whose hooks keep state per `transformer.cache_context(...)`: the pipeline must open one.
_CONTEXT_KINDS = frozenset({"first_block", "mag_cache", "sea_cache", "taylorseer"})
# Kinds that read the denoising loop's timestep through a callback (`pipe.current_timestep`).
_TIMESTEP_KINDS = frozenset({"pyramid_attention_broadcast", "faster_cache"})
_CACHE_CLASSES = {"first_block": "FirstBlockCacheConfig", "mag_cache": "MagCacheConfig",
                  "taylorseer": "TaylorSeerCacheConfig", "pyramid_attention_broadcast": "PyramidAttentionBroadcastConfig",
                  "faster_cache": "FasterCacheConfig", "sea_cache": "SeaCacheConfig"}


class _CacheCounter:
    """Hits (the remaining blocks skipped) and misses of a decision-making cache hook, per transformer
    call: totals of the worker's life and of the pipeline call running now."""

    def __init__(self) -> None:
        self.hits = self.misses = 0
        self.call_hits = self.call_misses = 0

    def start_call(self) -> None:
        self.call_hits = self.call_misses = 0

    def count(self, computed: bool) -> None:
        if computed:
            self.misses += 1
            self.call_misses += 1
        else:
            self.hits += 1
            self.call_hits += 1


def _apply_cache(stage: StageConfig, pipe: Any) -> _CacheCounter | None:
    """Put the stage's `cache` on the pipeline's transformer; a counter when the hook reports hits."""
    import diffusers
    import torch

    spec = dict(stage.cache)
    kind = str(spec.pop("kind"))
    where = f"stages.{stage.name}.cache"
    transformer = getattr(pipe, "transformer", None)
    if transformer is None or not hasattr(transformer, "enable_cache"):
        raise ValueError(f"{where}: cache kind {kind!r} needs a DiT pipeline whose transformer takes a cache; "
                         f"{type(pipe).__name__} has {'no transformer' if transformer is None else type(transformer).__name__}")
    if kind in _CONTEXT_KINDS and "cache_context" not in _source(type(pipe).__call__):
        raise ValueError(f"{where}: {type(pipe).__name__} does not open a transformer.cache_context around its "
                         f"transformer calls, which cache kind {kind!r} needs (try pyramid_attention_broadcast)")
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if isinstance(value, list) and key.endswith("_range"):
            value = tuple(value)
        elif key == "taylor_factors_dtype":
            value = getattr(torch, str(value))
        options[key] = value
    if kind in _TIMESTEP_KINDS:
        if not hasattr(type(pipe), "current_timestep"):
            raise ValueError(f"{where}: {type(pipe).__name__} has no current_timestep, which cache kind {kind!r} "
                             "reads")
        options["current_timestep_callback"] = lambda: pipe.current_timestep
    config_class = getattr(diffusers, _CACHE_CLASSES[kind], None)
    if config_class is None:
        raise ValueError(f"{where}: this diffusers ({diffusers.__version__}) has no {_CACHE_CLASSES[kind]}")
    try:
        transformer.enable_cache(config_class(**options))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"{where}: diffusers refused cache kind {kind!r} on {type(transformer).__name__}: "
                         f"{type(e).__name__}: {e}") from e
    return _count_decisions(transformer)


def _source(function: Any) -> str:
    """A function's source; "cache_context" when it cannot be read (then nothing is refused here)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return "cache_context"


def _count_decisions(transformer: Any) -> _CacheCounter | None:
    """A forward hook on the head block of a hook that decides per call (its state's `should_compute`
    or `gate_should_compute`), feeding a counter; None when the kind decides per module instead."""
    from diffusers.hooks.hooks import StateManager

    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or module is transformer:
            continue
        for hook in registry.hooks.values():
            managers = [v for v in vars(hook).values() if isinstance(v, StateManager)]
            if not getattr(hook, "_is_stateful", False) or not managers:
                continue
            manager = managers[0]
            state_class = getattr(manager, "_state_cls", None)
            name = "should_compute" if "should_compute" in _state_fields(state_class) else \
                "gate_should_compute" if "gate_should_compute" in _state_fields(state_class) else None
            if name is None:
                return None
            counter = _CacheCounter()

            def after(_module: Any, _args: Any, _output: Any, manager: Any = manager, name: str = name) -> None:
                counter.count(bool(getattr(manager.get_state(), name, True)))

            module.register_forward_hook(after)
            return counter
    return None


def _state_fields(state_class: Any) -> set[str]:
    """The attributes a hook's state object sets (made once to look)."""
    try:
        return set(vars(state_class()))
    except Exception:                           # noqa: BLE001 - a state that needs arguments: no counting
        return set()


class _GaveWay(Exception):
    """A forward given up for a job that came in during it (`DiffusersEngine._give_way`)."""


@dataclass
class _Request:
    """One admitted request, its values checked."""

    ctx: RequestContext
    params: dict[str, Any]          # the pipeline's keyword arguments, without seed and negative_prompt
    seed: int | None
    negative_prompt: str | None
    extra: dict[str, Any]           # other job inputs passed to the pipeline
    steps: int                      # denoising steps, for progress
    per_prompt: int                 # images per prompt
    key: str                        # equal keys: one pipeline call can serve both
    adapters: tuple[tuple[str, float], ...] = ()    # its LoRA adapters and weights, sorted (in its key)

    @property
    def alone(self) -> bool:
        return bool(self.extra) or self.per_prompt != 1


@dataclass
class _Batch:
    """One pipeline call in progress; `rows[i]` owns row i of the batched tensors (and its images)."""

    rows: list[_Request]
    generators: list[Any] = field(default_factory=list)     # one per row, shrunk with the rows
    thread: threading.Thread | None = None
    to_pipe: queue.Queue[str] = field(default_factory=queue.Queue)             # "go" | "close"
    to_main: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)  # (kind, value)


class DiffusersEngine(Engine):
    capabilities = DIFFUSERS          # (engines/capabilities.py: what it can do)
    # the step loop's give-way on the CPU (`_give_way_setup`)
    _times: ForwardTimes | None
    _input_waiting: Callable[[], bool]
    _give_way_before: float | None
    gave_way: int

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
        self._cache = _apply_cache(stage, self.pipe) if stage.cache else None
        self._call_args = set(inspect.signature(self.pipe.__call__).parameters)
        self.max_batch = max(1, stage.max_inflight)
        self._shrink_inputs = self._shrinkable_tensors()
        self._queue: list[_Request] = []
        self._batch: _Batch | None = None       # max_inflight > 1: the call running in the helper thread
        # max_inflight > 1 and a pipeline the loop drives (batching = "step"): omnid's own denoising
        # loop (engines/diffusers_loop.py); `_rows` are the jobs in it, `_loop_adapters` their LoRA set
        self._loop: Driver | None = None
        self._loop_why = ""
        if self.max_batch > 1:
            if stage.batching == "call":
                self._loop_why = 'batching = "call"'
            else:
                kind = str(stage.cache["kind"]) if stage.cache else None
                self._loop, self._loop_why = driver_for(self.pipe, torch, self.device, self._cache, kind,
                                                        _CONTEXT_KINDS)
        self._rows: list[Row] = []
        self._loop_adapters: tuple[tuple[str, float], ...] = ()
        self._give_way_setup(stage, torch)
        # LoRA adapters: each loaded once (`load_lora_weights(..., adapter_name=name)`), those of a
        # call set before it (`set_adapters` with the call's weights), none for a call without:
        # a job's adapters never reach the next call. Removed ones are deleted once no queued or
        # running request names them.
        self._adapters: dict[str, str] = {}
        self._retiring: set[str] = set()
        self._active: tuple[tuple[str, float], ...] | None = None   # what the pipeline has on now
        self._pending: dict[str, str] | None = None     # a new set that waits for the running call's end
        self._pristine: dict[int, tuple[Any, Any]] = {}   # id(LoRA layer) -> (its base weight, a copy)
        self._fused = False
        if stage.lora is not None:
            self.set_adapters(stage.adapters)
            self._activate(())

    def _shrinkable_tensors(self) -> list[str]:
        """The tensors to cut a cancelled request's rows from; empty: keep computing them."""
        unet_config = getattr(getattr(self.pipe, "unet", None), "config", None)
        if type(self.pipe).__name__ not in _SHRINKABLE_PIPELINES \
                or type(getattr(self.pipe, "scheduler", None)).__name__ not in _SHRINKABLE_SCHEDULERS \
                or unet_config is None or getattr(unet_config, "time_cond_proj_dim", None) is not None:
            return []
        allowed = list(getattr(self.pipe, "_callback_tensor_inputs", []))
        return [name for name in _BATCHED_TENSORS if name in allowed] if "latents" in allowed else []

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"model": str(self.stage.model), "pipeline": type(self.pipe).__name__,
                                "device": self.device}
        if self.stage.cache:
            info["cache"] = str(self.stage.cache["kind"])
        if self.stage.lora is not None:
            info["adapters"] = sorted(self._adapters)
        if self.max_batch > 1:
            info["batching"] = "step" if self._loop is not None else "call"
            if self._loop_why:
                info["batching_why"] = self._loop_why
        return info

    # ------------------------------------------------------------------ LoRA adapters

    def set_adapters(self, adapters: Any) -> None:
        if self._batch is not None or self._rows:
            # A call (or the loop) is paused between two denoising steps: loading or deleting an adapter now would
            # change the UNet under it. The new set goes in before the next call.
            self._pending = {n: str(p) for n, p in adapters.items()}
            return
        self._pending = None
        for name, path in adapters.items():
            if self._adapters.get(name) == str(path):
                self._retiring.discard(name)
                continue
            if name in self._adapters:          # the same name, another folder: the old one goes first
                self.pipe.delete_adapters([name])
                self._active = None
            self.pipe.load_lora_weights(str(path), adapter_name=name)
            self._adapters[name] = str(path)
            self._retiring.discard(name)
            self._active = None                 # (loading one turns it on: set the next call's again)
        self._retiring |= {n for n in self._adapters if n not in adapters}
        self._retire()

    def _retire(self) -> None:
        """Delete the removed adapters that no queued or running request names."""
        if not self._retiring:
            return
        rows = list(self._queue) + (list(self._batch.rows) if self._batch is not None else [])
        used = {name for r in rows for name, _ in r.adapters} | {name for r in self._rows for name, _ in r.adapters}
        gone = [n for n in self._retiring if n not in used]
        if gone:
            self.pipe.delete_adapters(gone)
            for name in gone:
                self._adapters.pop(name, None)
                self._retiring.discard(name)
            self._active = None

    def _lora_layers(self) -> list[Any]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = []
        for component in getattr(self.pipe, "_lora_loadable_modules", ()):
            model = getattr(self.pipe, component, None)
            if model is not None:
                layers += [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        return layers

    def _activate(self, adapters: tuple[tuple[str, float], ...]) -> None:
        """The pipeline's LoRA for the next call: these adapters at these weights, fused into the
        weights for the call (a step then costs what a step of the base model does: unfused, each
        adapted layer adds two small matmuls a step, which on the tiny SD cost a third of its steps/s);
        or none."""
        if adapters != self._active:
            if adapters:
                self.pipe.enable_lora()
                self.pipe.set_adapters([n for n, _ in adapters], adapter_weights=[w for _, w in adapters])
            elif self._adapters:
                self.pipe.disable_lora()
            self._active = adapters
        if adapters:
            for layer in self._lora_layers():       # the exact base weights, to put back after the call
                if id(layer) not in self._pristine:
                    weight = layer.get_base_layer().weight
                    self._pristine[id(layer)] = (weight, weight.detach().clone())
            self.pipe.fuse_lora(components=list(self.pipe._lora_loadable_modules),
                                adapter_names=[n for n, _ in adapters])
            self._fused = True

    def _unfuse(self) -> None:
        """After a call with adapters: the base weights back, bit for bit (unfusing subtracts what
        fusing added, which leaves rounding behind: copied back from the copy instead)."""
        if not self._fused:
            return
        self.pipe.unfuse_lora(components=list(self.pipe._lora_loadable_modules))
        with self.torch.no_grad():
            for weight, copy in self._pristine.values():
                weight.copy_(copy)
        self._fused = False

    @property
    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the stage's cache hook since the worker started; (0, 0) without one."""
        return (self._cache.hits, self._cache.misses) if self._cache is not None else (0, 0)

    # ------------------------------------------------------------------ the Engine interface

    def add(self, ctx: RequestContext) -> None:
        if not isinstance(ctx.inputs.get("prompt"), str):
            ctx.fail(f"a diffusers stage needs a text input \"prompt\"; got {sorted(ctx.inputs) or 'no inputs'}")
            return
        request = self._request(ctx)
        if request is not None:
            self._queue.append(request)

    def step(self) -> None:
        if self._pending is not None and self._batch is None and not self._rows:
            self.set_adapters(self._pending)        # (an add or remove that came during the last call)
        if self.max_batch == 1:
            self._run_inline(self._take_batch())
            return
        if self._batch is None and (self._rows or (self._queue and self._loop_takes(self._queue[0]))):
            self._loop_step()
            return
        if self._batch is None:
            batch = self._start(self._take_batch())
        else:
            batch = self._batch
            batch.to_pipe.put("go")
        self._answer(batch, *batch.to_main.get())

    def abort(self, job: str) -> None:
        for request in [r for r in self._queue if r.ctx.job == job]:
            self._queue.remove(request)
            request.ctx.stopped()
        if self._batch is not None:
            for request in self._batch.rows:
                if request.ctx.job == job:
                    request.ctx.stopped()       # its rows go at the next denoising step
        for row in self._rows:
            if row.ctx.job == job:
                row.ctx.stopped()               # it leaves the loop at the next step

    def has_work(self) -> bool:
        return bool(self._queue) or self._batch is not None or bool(self._rows)

    def close(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None and batch.thread is not None:
            batch.to_pipe.put("close")
            batch.thread.join(timeout=5)

    # ------------------------------------------------------------------ requests and batches

    def _request(self, ctx: RequestContext) -> _Request | None:
        """Check one request's values (so that it cannot fail a batch it joins); None: it failed."""
        params = merged(self.stage.defaults, ctx.params)
        for key, value in params.items():
            if (why := check_param("diffusers", key, value)) is not None:
                ctx.fail(f"bad parameter: {key} {why}, not {value!r}")
                return None
        seed = params.pop("seed", None)
        negative = params.pop("negative_prompt", None)
        wanted = job_adapters(params)
        params.pop("adapter", None)
        params.pop("adapters", None)
        in_force = set(self._pending) if self._pending is not None else set(self._adapters) - self._retiring
        unknown = [n for n in wanted if n not in in_force]
        if unknown:
            known = ", ".join(sorted(in_force)) or "none"
            ctx.fail(f"stage {self.stage.name!r} has no adapter {unknown[0]!r} (its adapters: {known})",
                     ErrorCode.INPUT_REJECTED)
            return None
        adapters = tuple(sorted((n, w) for n, w in wanted.items() if w != 0))
        try:
            steps = int(params.get("num_inference_steps", 50))
            per_prompt = int(params.get("num_images_per_prompt", 1) or 1)
            if seed is not None:
                seed = int(seed)
                self.torch.Generator(device=self.device).manual_seed(seed)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            ctx.fail(f"bad parameter: {type(e).__name__}: {e}")
            return None
        extra = {k: v for k, v in ctx.inputs.items() if k != "prompt" and k in self._call_args}
        key = repr((sorted(params.items()), negative is not None, adapters))
        return _Request(ctx, params, seed, None if negative is None else str(negative), extra, steps, per_prompt,
                        key, adapters)

    def _take_batch(self) -> list[_Request]:
        """The oldest request and, up to max_inflight, every queued one compatible with it."""
        first = self._queue.pop(0)
        rows = [first]
        if not first.alone:
            for request in list(self._queue):
                if len(rows) >= self.max_batch:
                    break
                if not request.alone and request.key == first.key:
                    self._queue.remove(request)
                    rows.append(request)
        return rows

    def _generators(self, rows: list[_Request]) -> list[Any]:
        """One generator per row (None: unseeded); [] when no row has a seed (the global RNG draws)."""
        generators: list[Any] = []
        for request in rows:
            generator = None
            if request.seed is not None:
                generator = self.torch.Generator(device=self.device).manual_seed(request.seed)
            generators.append(generator)
        if len(rows) == 1:
            return generators
        if all(g is None for g in generators):
            return []
        # diffusers takes a list of generators only when all are set: an unseeded row gets a random seed
        for index, generator in enumerate(generators):
            if generator is None:
                generators[index] = self.torch.Generator(device=self.device)
                generators[index].seed()
        return generators

    def _call(self, batch: _Batch, on_step_end: Any) -> Any:
        """The pipeline call for a batch (the same arguments as before batching for one request)."""
        first = batch.rows[0]
        kwargs: dict[str, Any] = dict(first.params)
        if len(batch.rows) == 1:
            prompt: str | list[str] = first.ctx.inputs["prompt"]
            generator = batch.generators[0] if batch.generators else None
            if first.negative_prompt is not None:
                kwargs["negative_prompt"] = first.negative_prompt
        else:
            prompt = [r.ctx.inputs["prompt"] for r in batch.rows]
            generator = batch.generators or None    # shrunk in place with the rows: the scheduler reads it
            if first.negative_prompt is not None:
                kwargs["negative_prompt"] = [r.negative_prompt or "" for r in batch.rows]
        if len(batch.rows) > 1 and self._shrink_inputs:
            kwargs["callback_on_step_end_tensor_inputs"] = list(self._shrink_inputs)
        if self.stage.lora is not None:
            self._activate(first.adapters)      # (every row has the same: they are in the key)
        if self.stage.cache:
            # a cancelled call never reached the pipeline's own reset: no state of it may leak into this one
            self.pipe.transformer._reset_stateful_cache()
            if self._cache is not None:
                self._cache.start_call()
        try:
            return self.pipe(prompt=prompt, generator=generator, callback_on_step_end=on_step_end,
                             **first.extra, **kwargs)
        finally:
            self._unfuse()              # (a cancelled or failed call too: the next one starts from the base)

    def _report_step(self, batch: _Batch, step: int) -> None:
        """Main thread, after a denoising step: progress for the live requests, stop the cancelled."""
        for request in batch.rows:
            if request.ctx.done:
                continue
            if request.ctx.cancelled():
                request.ctx.stopped()
            else:
                request.ctx.progress(step + 1, request.steps)

    def _deliver(self, batch: _Batch, images: list[Any]) -> None:
        """Main thread: each live request's own images (and its prompt)."""
        for index, request in enumerate(batch.rows):
            if request.ctx.done:
                continue
            mine = images[index * request.per_prompt:(index + 1) * request.per_prompt]
            if not mine:
                request.ctx.fail(f"the pipeline returned {len(images)} images for {len(batch.rows)} requests")
                continue
            if self._cache is not None:
                request.ctx.usage = {"cache_hits": self._cache.call_hits, "cache_misses": self._cache.call_misses}
            request.ctx.segment({"image": mine[-1]}, is_last=True)
            request.ctx.finish({"image": mine[0] if len(mine) == 1 else mine, "prompt": request.ctx.inputs["prompt"]})

    def _drop_done(self, batch: _Batch, pipe: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """At a step's end: leave the rows of requests that ended; raise Cancelled when none is left."""
        live = [i for i, r in enumerate(batch.rows) if not r.ctx.done]
        if not live:
            raise Cancelled()
        if len(live) == len(batch.rows) or not self._shrink_inputs or "latents" not in kwargs:
            return kwargs
        n = len(batch.rows)
        cfg = bool(getattr(pipe, "do_classifier_free_guidance", False))
        both = live + [n + i for i in live]
        out: dict[str, Any] = {}
        for name, tensor in kwargs.items():
            size = tensor.shape[0] if hasattr(tensor, "shape") and tensor.dim() > 0 else None
            if size == n:
                out[name] = tensor[live]
            elif cfg and size == 2 * n:
                out[name] = tensor[both]            # [negative rows..., positive rows...]
            else:
                out[name] = tensor
        batch.rows[:] = [batch.rows[i] for i in live]
        if batch.generators:
            batch.generators[:] = [batch.generators[i] for i in live]
        return out

    # ------------------------------------------------------------------ max_inflight = 1: in the main thread

    def _run_inline(self, rows: list[_Request]) -> None:
        batch = _Batch(rows, self._generators(rows))

        def on_step_end(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            self._report_step(batch, step)
            return self._drop_done(batch, pipe, kwargs)

        try:
            result = self._call(batch, on_step_end)
        except Cancelled:
            return
        except Exception as e:
            for request in batch.rows:
                request.ctx.fail(f"{type(e).__name__}: {e}")
            return
        finally:
            self._retire()
        self._deliver(batch, list(result.images))

    # ------------------------------------------------------------------ max_inflight > 1: step by step

    def _start(self, rows: list[_Request]) -> _Batch:
        """Start a batch's pipeline call in the helper thread; it runs up to its first step's end."""
        batch = _Batch(rows, self._generators(rows))
        batch.thread = threading.Thread(target=self._pipeline_thread, args=(batch,), name="diffusers-batch",
                                        daemon=True)
        self._batch = batch
        batch.thread.start()
        return batch

    def _pipeline_thread(self, batch: _Batch) -> None:
        """Helper thread: the batch's pipeline call, paused at each step's end until the next `step()`."""

        def on_step_end(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            batch.to_main.put(("step", step))
            if batch.to_pipe.get() == "close":
                raise Cancelled()
            return self._drop_done(batch, pipe, kwargs)

        try:
            result = self._call(batch, on_step_end)
        except Cancelled:
            batch.to_main.put(("cancelled", None))
        except BaseException as e:                      # noqa: BLE001 - reported to the main thread
            batch.to_main.put(("error", e))
        else:
            batch.to_main.put(("done", list(result.images)))

    def _answer(self, batch: _Batch, kind: str, value: Any) -> None:
        """Main thread: act on what the helper thread reported for this step."""
        if kind == "step":
            self._report_step(batch, int(value))
            return
        if batch.thread is not None:
            batch.thread.join()
        self._batch = None
        self._retire()
        if kind == "done":
            self._deliver(batch, value)
        elif kind == "error":
            for request in batch.rows:
                request.ctx.fail(f"{type(value).__name__}: {value}")

    # ------------------------------------------------------------------ max_inflight > 1: the step loop

    def _loop_takes(self, request: _Request) -> bool:
        """The step loop can run this request (else: a pipeline call, once the loop is empty)."""
        return self._loop is not None and self._loop.takes(request.params, request.extra, request.negative_prompt)

    def _loop_step(self) -> None:
        """Main thread: admit what can join, then one denoising step of one shape's rows; rows whose
        schedule ended are decoded and delivered, cancelled ones leave."""
        assert self._loop is not None
        self._woken.clear()                     # (only what comes in from now on counts)
        self._admit()
        self._rows = [row for row in self._rows if not self._left(row)]
        if not self._rows:
            self._loop_idle()
            return
        group = self._next_forward()
        started = time.perf_counter()
        self._give_way_before = self._gives_way_until(group, started)
        try:
            self._loop.step(group)
        except _GaveWay:
            self.gave_way += 1
            for row in group:                   # (they did not move: the newcomer's first step, then they again)
                row.gave_way = True
            return
        except Exception as e:                  # noqa: BLE001 - it fails the rows of that forward
            for row in group:
                row.ctx.fail(f"{type(e).__name__}: {e}")
        else:
            if self._times is not None:
                self._times.ran(group[0].key, len(group), time.perf_counter() - started)
        finally:
            self._give_way_before = None
        for row in group:
            row.gave_way = False
            if row.error is not None:
                row.ctx.fail(row.error)
            if row.ctx.done:
                continue
            if row.ctx.cancelled():
                row.ctx.stopped()
                continue
            row.ctx.progress(row.done, row.steps)
            if row.finished:
                self._loop_deliver(row)
        self._rows = [row for row in self._rows if not self._left(row)]
        if not self._rows:
            self._loop_idle()

    def _give_way_setup(self, stage: StageConfig, torch: Any) -> None:
        """A forward on the CPU gives way to a job that arrives during it (`_give_way`, a pre-hook of each
        of the denoiser's blocks). Not on a GPU, where a batch costs about what a row does (and a forward's
        time is not known before it synchronizes); not a DiT with a cache, whose hooks keep state inside a
        forward."""
        self._times = ForwardTimes() if self.device == "cpu" and self._loop is not None and not stage.cache else None
        self._woken = threading.Event()         # something came in (`wake`, any thread)
        self._input_waiting = lambda: False     # (the worker's probe)
        self._give_way_before = None            # the forward in progress gives way until then
        self.gave_way = 0                       # forwards given up
        if self._times is not None:
            denoiser = getattr(self.pipe, "unet", None) or self.pipe.transformer
            for child in denoiser.children():
                for block in child if isinstance(child, torch.nn.ModuleList) else [child]:
                    block.register_forward_pre_hook(self._give_way)

    def _gives_way_until(self, group: list[Row], started: float) -> float | None:
        """Until when this forward gives way to a job that comes in: while more than a lone job's way
        to its first step is left of it, when a job could join (a free slot, no adapter set waiting,
        none queued) and none of its rows gave way already (None: it does not; so every row moves
        at least every other forward it is in)."""
        if self._times is None or self._queue or len(self._rows) >= self.max_batch or self._pending is not None \
                or any(row.gave_way for row in group):
            return None
        took, join = self._times.took(group[0].key, len(group)), self._times.join_time(group[0].key)
        if took is None or join is None or took <= join:
            return None
        return started + took - join

    def _give_way(self, _module: Any, _args: Any) -> None:
        """A forward pre-hook of each of the denoiser's blocks: something came in during the forward
        (`wake`), and the worker says it would take a job from its input queue next."""
        if self._give_way_before is not None and self._woken.is_set() \
                and time.perf_counter() < self._give_way_before and self._input_waiting():
            raise _GaveWay

    def wake(self) -> None:
        self._woken.set()

    def on_input_waiting(self, waiting: Callable[[], bool]) -> None:
        self._input_waiting = waiting

    def live_info(self) -> dict[str, Any]:
        if self._times is None:
            return {}
        return {"forward_ms": self._times.timed(), "gave_way": self.gave_way}

    def _next_forward(self) -> list[Row]:
        """The rows of the next forward: rows that have not stepped yet first, by themselves (a job's
        first step comes at the next boundary, as soon as it would alone), else all the others; of the
        shape of the row with the fewest steps left (the job nearest its end ends first), then the oldest."""
        order = sorted(self._rows, key=lambda r: (r.done > 0, len(r.timesteps) - r.done))   # (stable: oldest first)
        first = order[0]
        return [r for r in order if r.key == first.key and (r.done > 0) == (first.done > 0)]

    def _admit(self) -> None:
        """Queued requests join the loop, oldest first, while they can: up to max_inflight rows, all of
        one adapter set. The first that cannot join stops the others behind it (no overtaking): it
        waits for the loop to drain (another adapter set) or to be empty (a pipeline call)."""
        assert self._loop is not None
        while self._queue and len(self._rows) < self.max_batch and self._pending is None:
            # (an adapter added or removed meanwhile: the loop drains, the new set goes in, then rows join)
            request = self._queue[0]
            if not self._loop_takes(request) or (self._rows and request.adapters != self._loop_adapters):
                return
            self._queue.pop(0)
            if not self._rows:
                if self.stage.cache:            # (a cancelled call never reached the pipeline's own reset)
                    self.pipe.transformer._reset_stateful_cache()
                if self.stage.lora is not None:
                    self._activate(request.adapters)
                self._loop_adapters = request.adapters
            generator = self.torch.Generator(device=self.device)
            if request.seed is not None:
                generator.manual_seed(request.seed)
            else:
                generator.seed()
            started = time.perf_counter()
            try:
                row = self._loop.prepare(request.ctx, self._loop.key(request.params), request.adapters,
                                         request.params, request.negative_prompt, generator)
            except Exception as e:              # noqa: BLE001 - this request's values: it fails alone
                request.ctx.fail(f"{type(e).__name__}: {e}")
                continue
            if self._times is not None:
                self._times.prepared(row.key, time.perf_counter() - started)
            self._rows.append(row)

    def _left(self, row: Row) -> bool:
        """The row's job ended (aborted, cancelled, failed, delivered): it leaves the loop."""
        if not row.ctx.done and row.ctx.cancelled():
            row.ctx.stopped()
        if row.ctx.done:
            assert self._loop is not None
            self._loop.forget(row)
            return True
        return False

    def _loop_deliver(self, row: Row) -> None:
        """Its schedule ended: its own VAE decode, its image out."""
        assert self._loop is not None
        try:
            image = self._loop.decode(row)
        except Exception as e:                  # noqa: BLE001 - this row's decode: it fails alone
            row.ctx.fail(f"{type(e).__name__}: {e}")
            return
        if self._cache is not None:
            row.ctx.usage = {"cache_hits": row.hits, "cache_misses": row.misses}
        row.ctx.segment({"image": image}, is_last=True)
        row.ctx.finish({"image": image, "prompt": row.ctx.inputs["prompt"]})

    def _loop_idle(self) -> None:
        """The loop is empty: the base weights back, removed adapters dropped."""
        self._unfuse()
        self._loop_adapters = ()
        self._retire()
