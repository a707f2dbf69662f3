"""A `[stages.NAME]` table: its engine and model (or function), devices and replicas, placement and
Ray needs, and the tables a stage may carry: `media`, `cache` (a DiT's), `lora`, its tensor keys
(`outputs`, `hidden_layers`, ...), `engine_core`. What each engine takes is read from
engines/capabilities.py; models are looked at on disk (config.json, model_index.json), never loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnid import lora as L
from omnid.config.checker import PRODUCED_KINDS, _check_callable_ref, _Checker, _resolve, _typename, declared_produces
from omnid.config_types import LoraConfig, RayNeeds, StageConfig
from omnid.engines.capabilities import CAPABILITIES, TENSOR_OUTPUTS, capabilities, check_param, engines_that
from omnid.media import MEDIA_KINDS, NO_MEDIA, MediaLimits, detect_kinds
from omnid.params import parallel_size

ENGINES = tuple(CAPABILITIES)       # the names `engine = "..."` takes; what each can do: engines/capabilities.py
_STAGE_KEYS = ("engine", "model", "function", "python_path", "devices", "exclusive",
               "max_inflight", "queue_capacity", "shm_pool_mb", "args", "defaults", "env", "batch_function", "sessions",
               "replicas", "idle_unload_s", "media", "placement", "ray", "max_rss_mb",
               "engine_core", "outputs", "hidden_layers", "hidden_prompt", "prompt_embeds", "cache", "lazy", "lora",
               "produces", "batching")
_TENSOR_KEYS = ("outputs", "hidden_layers", "hidden_prompt", "prompt_embeds")
PLACEMENTS = ("local", "ray")
MAX_REPLICAS = 64
_MEDIA_KEYS = (*MEDIA_KINDS, "max_bytes", "max_pixels", "max_audio_s", "max_video_frames")
_MARKER_WORDS = {"image": "vision_config (nor image token)", "audio": "audio_config (nor audio token)",
                 "video": "video token"}


def _parse_media(c: _Checker, raw: Any, path: str, engine: str | None, model: Path | None) -> MediaLimits:
    """`[stages.NAME.media]`: per kind, how many items a job may give (default: 1 for each kind the
    model's config.json shows, else 0), and the limits on each item."""
    path = f"{path}.media"
    takes_media = engine is not None and capabilities(engine).media
    detected = detect_kinds(model) if takes_media else ()
    if raw is None:
        return MediaLimits(**{k: 1 for k in detected}, detected=detected) if detected else NO_MEDIA
    m = c.table(raw, path)
    if engine is not None and not takes_media:
        c.add(path, f"only {', '.join(engines_that(lambda e: e.media))} stages take media inputs (a {engine} "
                    "stage gets its inputs as they are)")
        return NO_MEDIA
    c.unknown(m, _MEDIA_KEYS, path)
    counts: dict[str, int] = {}
    for kind in MEDIA_KINDS:
        n = c.positive(m, kind, path, 1 if kind in detected else 0, integer=True, allow_zero=True)
        if kind in m and n > 0 and kind not in detected and model is not None and (model / "config.json").is_file():
            c.add(f"{path}.{kind}", f"the model {str(model)!r} takes no {kind} input: its config.json has "
                                    f"no {_MARKER_WORDS[kind]} (set 0, or leave it out)")
        counts[kind] = n
    return MediaLimits(
        **counts,
        max_bytes=c.positive(m, "max_bytes", path, NO_MEDIA.max_bytes, integer=True),
        max_pixels=c.positive(m, "max_pixels", path, NO_MEDIA.max_pixels, integer=True),
        max_audio_s=float(c.positive(m, "max_audio_s", path, NO_MEDIA.max_audio_s)),
        max_video_frames=c.positive(m, "max_video_frames", path, NO_MEDIA.max_video_frames, integer=True),
        detected=detected,
    )


def _check_vllm_parallelism(c: _Checker, path: str, args: Mapping[str, Any], devices: list[int]) -> None:
    """Tensor/pipeline parallelism needs one process per GPU: not the in-process `uni` executor, and
    as many devices as processes."""
    size = parallel_size(args)
    if size <= 1:
        return
    backend = args.get("distributed_executor_backend")
    if backend == "uni":
        c.add(f"{path}.args.distributed_executor_backend",
              f"\"uni\" runs the model in one process, but tensor/pipeline parallelism asks for {size}: "
              "set \"mp\" (or leave it out: omnid picks \"mp\" then)")
    if devices and len(devices) < size:
        c.add(f"{path}.devices", f"tensor/pipeline parallelism of {size} needs {size} GPUs, but the stage has "
                                 f"{len(devices)} ({devices})")


# `cache` of a diffusers stage: its kinds (diffusers' hook configs, named without "Config") and the
# options each takes, by the kind of TOML value: "int", "number", "bool", "string", "range" (two
# integers [lo, hi]), "numbers" / "strings" (arrays of those). Options that are callables or tensors
# in diffusers are left out; the engine fills the timestep callback in. The supervisor checks them
# here without importing diffusers.
CACHE_KINDS: dict[str, dict[str, str]] = {
    "first_block": {"threshold": "number"},
    "mag_cache": {"threshold": "number", "max_skip_steps": "int", "retention_ratio": "number",
                  "num_inference_steps": "int", "mag_ratios": "numbers", "calibrate": "bool"},
    "taylorseer": {"cache_interval": "int", "disable_cache_before_step": "int", "disable_cache_after_step": "int",
                   "max_order": "int", "taylor_factors_dtype": "string", "skip_predict_identifiers": "strings",
                   "cache_identifiers": "strings", "use_lite_mode": "bool"},
    "pyramid_attention_broadcast": {
        "spatial_attention_block_skip_range": "int", "temporal_attention_block_skip_range": "int",
        "cross_attention_block_skip_range": "int", "spatial_attention_timestep_skip_range": "range",
        "temporal_attention_timestep_skip_range": "range", "cross_attention_timestep_skip_range": "range"},
    "faster_cache": {
        "spatial_attention_block_skip_range": "int", "temporal_attention_block_skip_range": "int",
        "spatial_attention_timestep_skip_range": "range", "temporal_attention_timestep_skip_range": "range",
        "low_frequency_weight_update_timestep_range": "range",
        "high_frequency_weight_update_timestep_range": "range", "alpha_low_frequency": "number",
        "alpha_high_frequency": "number", "unconditional_batch_skip_range": "int",
        "unconditional_batch_timestep_skip_range": "range", "tensor_format": "string",
        "is_guidance_distilled": "bool"},
    "sea_cache": {"threshold": "number", "residual_order": "int", "retention_steps": "int", "cache_end_steps": "int",
                  "max_consecutive_cached": "int", "power_exp": "number"},
}
CACHE_DTYPES = ("float32", "float16", "bfloat16")
_CACHE_VALUE_WORDS = {"int": "an integer", "number": "a number", "bool": "true or false", "string": "a string",
                      "range": "two integers [lo, hi]", "numbers": "an array of numbers",
                      "strings": "an array of strings"}


def _cache_value_ok(kind: str, value: Any) -> bool:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == "number":
        return number(value) and value >= 0
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "range":
        return isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value) and value[0] <= value[1]
    if kind == "numbers":
        return isinstance(value, list) and bool(value) and all(number(v) for v in value)
    return isinstance(value, list) and all(isinstance(v, str) for v in value)      # strings


def _model_index(model: Path | None) -> dict[str, Any] | None:
    """A diffusers model's model_index.json (its pipeline class and components), or None."""
    if model is None:
        return None
    try:
        index = json.loads((model / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def _names_component(entry: Any) -> bool:
    """A model_index.json entry that names a component: ["diffusers", "FluxTransformer2DModel"]."""
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def _parse_cache(c: _Checker, raw: Any, path: str, engine: str | None, model: Path | None) -> dict[str, Any]:
    """`cache = { kind = "first_block", threshold = 0.2 }`: one of CACHE_KINDS and its options, on a
    diffusers stage whose pipeline has a `transformer` (a DiT; its model_index.json says so)."""
    path = f"{path}.cache"
    if raw is None:
        return {}
    t = c.table(raw, path)
    if not isinstance(raw, dict):
        return {}
    if engine is not None and engine != "diffusers":
        c.add(path, f"only diffusers stages take a cache (this one is {engine!r})")
        return {}
    kind = c.get(t, "kind", path, str, required=True)
    if kind is None:
        return {}
    options = CACHE_KINDS.get(kind)
    if options is None:
        c.add(f"{path}.kind", f"unknown cache kind {kind!r} (known: {', '.join(CACHE_KINDS)})")
        return {}
    ok = True
    for key, value in t.items():
        if key == "kind":
            continue
        want = options.get(key)
        if want is None:
            c.add(f"{path}.{key}", f"unknown option for cache kind {kind!r} (known: {', '.join(sorted(options))})")
            ok = False
        elif not _cache_value_ok(want, value):
            bound = " (>= 0)" if want in ("int", "number") else ""
            c.add(f"{path}.{key}", f"must be {_CACHE_VALUE_WORDS[want]}{bound}, not {value!r}")
            ok = False
        elif key == "taylor_factors_dtype" and value not in CACHE_DTYPES:
            c.add(f"{path}.{key}", f"must be one of {', '.join(CACHE_DTYPES)}, not {value!r}")
            ok = False
    if kind == "mag_cache" and "mag_ratios" not in t and not t.get("calibrate"):
        c.add(path, "cache kind 'mag_cache' needs mag_ratios (the model's, from a calibrate = true run) or "
                    "calibrate = true")
        ok = False
    index = _model_index(model)
    if index is not None and not _names_component(index.get("transformer")):
        denoiser = "a unet" if _names_component(index.get("unet")) else "no transformer"
        c.add(path, f"cache kind {kind!r} needs a DiT pipeline (one with a transformer), but "
                    f"{str(model)!r} is a {index.get('_class_name', 'pipeline')} with {denoiser}")
        ok = False
    return dict(t) if ok else {}


def _parse_stage(c: _Checker, name: str, raw: Any, base: Path) -> StageConfig | None:
    path = f"stages.{name}"
    s = c.table(raw, path)
    if not isinstance(raw, dict):      # an empty table still needs its keys checked
        return None
    c.unknown(s, _STAGE_KEYS, path)
    engine = c.get(s, "engine", path, str, required=True)
    if engine is not None and engine not in ENGINES:
        c.add(f"{path}.engine", f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
        engine = None
    python_path_raw = c.get(s, "python_path", path, list, [])
    for i, p in enumerate(python_path_raw):
        if not isinstance(p, str):
            c.add(f"{path}.python_path[{i}]", f"must be a string (a directory), not {_typename(p)}")
    python_path = tuple(_resolve(base, p) for p in python_path_raw if isinstance(p, str))
    model: Path | None = None
    model_raw = c.get(s, "model", path, str)
    function = c.get(s, "function", path, str)
    batch_function = c.get(s, "batch_function", path, str)
    sessions = c.get(s, "sessions", path, str)
    caps = capabilities(engine) if engine is not None else None
    if caps is not None and caps.model_marker is not None:
        if model_raw is None:
            c.add(f"{path}.model", f"is required for engine {engine!r}")
        else:
            model = _resolve(base, model_raw)
            marker = caps.model_marker
            if not model.is_dir():
                c.add(f"{path}.model", f"directory {str(model)!r} does not exist")
            elif not (model / marker).is_file():
                c.add(f"{path}.model", f"{str(model)!r} has no {marker}; is it a {engine} model?")
        if function is not None:
            c.add(f"{path}.function", f"only python stages take a function, not {engine!r}")
        if batch_function is not None:
            c.add(f"{path}.batch_function", f"only python stages take a batch_function, not {engine!r}")
        if sessions is not None:
            c.add(f"{path}.sessions", f"only python stages take sessions, not {engine!r}")
    elif caps is not None and caps.takes_function:
        if sessions is not None and (function is not None or batch_function is not None):
            c.add(f"{path}.sessions", "a stage that steps sessions takes no function nor batch_function: "
                                      "its class's open and step serve every job")
        elif function is None and batch_function is None and sessions is None:     # one of them
            c.add(f"{path}.function", f"is required for engine {engine!r} (or a batch_function, or sessions)")
        if sessions is not None:
            _check_callable_ref(c, sessions, f"{path}.sessions", python_path)
        if function is not None:
            _check_callable_ref(c, function, f"{path}.function", python_path)
        if batch_function is not None:
            _check_callable_ref(c, batch_function, f"{path}.batch_function", python_path)
        if model_raw is not None:
            model = _resolve(base, model_raw)
    produces = _parse_produces(c, s, path, engine, caps is not None and caps.takes_function,
                               sessions or function or batch_function, python_path)
    devices, replica_devices, replicas = _parse_devices(c, s, path)
    max_inflight = c.positive(s, "max_inflight", path, 1, integer=True)
    if caps is not None and caps.max_batch is not None and max_inflight > caps.max_batch:
        # up to max_inflight compatible jobs run as one batched pipeline call: keep that call bounded
        c.add(f"{path}.max_inflight", f"engine {engine!r} batches at most {caps.max_batch} jobs in one pipeline "
                                      f"call; must be from 1 to {caps.max_batch}, not {max_inflight}")
    args = c.get(s, "args", path, dict, {})
    if caps is not None and caps.parallel:
        for one in (replica_devices or (tuple(devices),)):
            _check_vllm_parallelism(c, path, args, list(one))
    if caps is not None and caps.media:
        if "limit_mm_per_prompt" in args:
            c.add(f"{path}.args.limit_mm_per_prompt", "set the media a job may give in the stage's media table "
                  "instead (media.image, media.audio, media.video): omnid passes them to vLLM as this, and "
                  "checks jobs against them")
    media = _parse_media(c, s.get("media"), path, engine, model)
    defaults = c.get(s, "defaults", path, dict, {})
    env = c.get(s, "env", path, dict, {})
    for k, v in env.items():
        if not isinstance(v, str):
            c.add(f"{path}.env.{k}", f"must be a string, not {_typename(v)}")
    if caps is not None:
        known = caps.params
        for k, v in defaults.items():
            if known is not None and k not in known:
                c.add(f"{path}.defaults.{k}",
                      f"unknown parameter for engine {engine!r} (known: {', '.join(sorted(known))})")
            elif (why := check_param(engine, k, v)) is not None:
                c.add(f"{path}.defaults.{k}", f"{why}, not {v!r}")
    exclusive = bool(c.get(s, "exclusive", path, bool, False))
    queue_capacity = c.positive(s, "queue_capacity", path, 4, integer=True)
    shm_pool_mb = c.positive(s, "shm_pool_mb", path, 1024, integer=True, allow_zero=True)
    idle_unload_s = c.positive(s, "idle_unload_s", path, None)
    max_rss_mb = c.positive(s, "max_rss_mb", path, None, integer=True)
    engine_core = _parse_engine_core(c, s, path, engine)
    batching = _parse_batching(c, s, path, engine)
    placement = _parse_placement(c, s, path, replicas, devices)
    ray = _parse_ray_needs(c, s, path)
    outputs, hidden_layers, hidden_prompt, prompt_embeds = _parse_tensors(c, s, path, engine, model, args)
    cache = _parse_cache(c, s.get("cache"), path, engine, model)
    lora = _parse_lora(c, s.get("lora"), path, engine, model, base, args, defaults)
    lazy = bool(c.get(s, "lazy", path, bool, False))
    if lazy and caps is not None and not caps.takes_function:
        c.add(f"{path}.lazy", f"only python stages load lazily; a {engine} stage loads its model at start")
    if engine is None:
        return None
    return StageConfig(
        name=name, engine=engine, model=model, function=function, python_path=python_path,
        devices=tuple(devices), exclusive=exclusive, max_inflight=max_inflight,
        queue_capacity=queue_capacity, shm_pool_mb=shm_pool_mb,
        args=dict(args), defaults=dict(defaults), env={k: str(v) for k, v in env.items()},
        batch_function=batch_function, sessions=sessions, media=media, replicas=replicas, replica_devices=replica_devices,
        idle_unload_s=float(idle_unload_s) if idle_unload_s is not None else None,
        max_rss_mb=int(max_rss_mb) if max_rss_mb is not None else None, engine_core=engine_core, batching=batching,
        placement=placement, ray=ray, outputs=outputs, hidden_layers=hidden_layers,
        hidden_prompt=hidden_prompt, prompt_embeds=prompt_embeds, cache=cache, lazy=lazy, lora=lora,
        produces=produces,
    )


def _parse_produces(c: _Checker, s: dict[str, Any], path: str, engine: str | None, python: bool,
                    ref: str | None, python_path: tuple[Path, ...]) -> tuple[str, ...] | None:
    """A python stage's kinds of output: its `produces` key, else what its function or class declares
    (`declared_produces`); None when neither says."""
    raw = s.get("produces")
    where = f"{path}.produces"
    if raw is not None and not python:
        c.add(where, f"only python stages say what they produce; a {engine} stage's engine says it")
        return None
    if raw is None and python and ref is not None and ":" in ref:
        declared = declared_produces(ref, python_path)
        raw, where = (list(declared), f"{path} ({ref}.produces)") if declared is not None else (None, where)
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(k, str) and k in PRODUCED_KINDS for k in raw):
        c.add(where, f"must be a non-empty list of output kinds ({', '.join(PRODUCED_KINDS)}), not {raw!r}")
        return None
    return tuple(sorted(set(raw)))


# vLLM's own choices of max_lora_rank (its LoRAConfig's MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_KEYS = ("adapters", "max_loras", "max_lora_rank")
VLLM_LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "lora_modules")


def _parse_lora(c: _Checker, raw: Any, path: str, engine: str | None, model: Path | None, base: Path,
                args: Mapping[str, Any], defaults: Mapping[str, Any]) -> LoraConfig | None:
    """`lora = { adapters = { sql = "path" }, max_loras = 4, max_lora_rank = 16 }`: each adapter
    checked (a LoRA, its rank within max_lora_rank, made for the stage's model: `omnid.lora`)."""
    caps = capabilities(engine) if engine is not None else None
    if caps is not None and caps.parallel:
        for key in VLLM_LORA_ARGS:
            if key in args:
                c.add(f"{path}.args.{key}", "set LoRA in the stage's lora table instead (lora.adapters, "
                                            "lora.max_loras, lora.max_lora_rank): omnid turns vLLM's LoRA on with it")
    if raw is None:
        for key in ("adapter", "adapters"):
            if key in defaults:
                c.add(f"{path}.defaults.{key}", "the stage has no adapters (no lora table)")
        return None
    path = f"{path}.lora"
    t = c.table(raw, path)
    c.unknown(t, LORA_KEYS, path)
    if caps is not None and not caps.lora:
        c.add(path, f"only {', '.join(engines_that(lambda e: e.lora))} stages take LoRA adapters "
                    f"(this one is {engine!r})")
        return None
    max_loras = c.positive(t, "max_loras", path, 4, integer=True)
    max_rank = c.positive(t, "max_lora_rank", path, 16, integer=True)
    if caps is not None and caps.parallel and max_rank not in VLLM_LORA_RANKS:
        c.add(f"{path}.max_lora_rank", f"vLLM takes one of {', '.join(map(str, VLLM_LORA_RANKS))}, not {max_rank}")
    adapters: dict[str, Path] = {}
    for name, value in c.get(t, "adapters", path, dict, {}).items():
        where = f"{path}.adapters.{name}"
        if (why := L.name_problem(name)) is not None:
            c.add(where, why)
            continue
        if not isinstance(value, str):
            c.add(where, f"must be a string (the adapter's folder), not {_typename(value)}")
            continue
        folder = _resolve(base, value)
        try:
            L.check(folder, model if model is not None and model.is_dir() else None, max_rank)
        except (L.AdapterError, OSError) as e:
            c.add(where, str(e))
            continue
        adapters[name] = folder
    lora = LoraConfig(adapters=adapters, max_loras=max_loras, max_lora_rank=max_rank)
    for key in ("adapter", "adapters"):
        if key in defaults and (why := L.adapter_problem(name_of(path), engine or "", adapters, key, defaults[key])):
            c.add(f"{path.rpartition('.')[0]}.defaults.{key}", why)
    return lora


def name_of(path: str) -> str:
    """`stages.NAME.lora` -> NAME."""
    return path.split(".")[1]


ENGINE_CORES = ("inline", "process")


def _parse_engine_core(c: _Checker, s: Mapping[str, Any], path: str, engine: str | None) -> str:
    """`engine_core = "inline" | "process"`: a vllm stage's engine core in the worker's thread, or in
    a process of its own."""
    where = c.get(s, "engine_core", path, str, "process")
    if "engine_core" in s and engine is not None and not capabilities(engine).engine_core:
        c.add(f"{path}.engine_core", f"only vllm stages have an engine core to place, not {engine!r}")
    elif where not in ENGINE_CORES:
        c.add(f"{path}.engine_core", f"must be one of {', '.join(map(repr, ENGINE_CORES))}, not {where!r}")
    return where if where in ENGINE_CORES else "process"


BATCHINGS = ("step", "call")


def _parse_batching(c: _Checker, s: Mapping[str, Any], path: str, engine: str | None) -> str:
    """`batching = "step" | "call"`: a diffusers stage's jobs join a batch at a denoising step, or
    only when a pipeline call starts."""
    how = c.get(s, "batching", path, str, "step")
    if "batching" in s and engine is not None and not capabilities(engine).step_batching:
        c.add(f"{path}.batching", f"only diffusers stages choose how they batch, not {engine!r}")
    elif how not in BATCHINGS:
        c.add(f"{path}.batching", f"must be one of {', '.join(map(repr, BATCHINGS))}, not {how!r}")
    return how if how in BATCHINGS else "step"


def model_dims(model: Path | None) -> tuple[int, int] | None:
    """(hidden size, decoder layers) from a model's config.json (its text model's, for a multimodal
    one); None when it does not say."""
    if model is None:
        return None
    try:
        import json
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (cfg, cfg.get("text_config"), cfg.get("thinker_config", {}).get("text_config")):
        if isinstance(part, dict) and isinstance(part.get("hidden_size"), int) \
                and isinstance(part.get("num_hidden_layers"), int):
            return int(part["hidden_size"]), int(part["num_hidden_layers"])
    return None


def _parse_tensors(c: _Checker, s: Mapping[str, Any], path: str, engine: str | None, model: Path | None,
                   args: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[int, ...], bool, bool]:
    """A vllm stage's tensor keys: outputs, hidden_layers, hidden_prompt, prompt_embeds."""
    caps = capabilities(engine) if engine is not None else None
    if caps is None or not caps.tensors or caps.gives is None:
        for key in _TENSOR_KEYS:
            if key in s and engine is not None:
                c.add(f"{path}.{key}", f"only {', '.join(engines_that(lambda e: e.tensors))} stages take {key}, "
                                       f"not {engine!r}")
        return (), (-1,), False, False
    outputs_raw = c.get(s, "outputs", path, list, [])
    outputs: list[str] = []
    for i, name in enumerate(outputs_raw):
        if name == "text":
            continue                    # always given
        if name not in TENSOR_OUTPUTS:
            c.add(f"{path}.outputs[{i}]", f"a {engine} stage gives {', '.join(caps.gives)}, not {name!r}")
        elif name not in outputs:
            outputs.append(name)
    layers_raw = c.get(s, "hidden_layers", path, list, [-1])
    dims = model_dims(model)
    layers: list[int] = []
    if not layers_raw:
        c.add(f"{path}.hidden_layers", "must name at least one layer (-1: the last)")
    for i, k in enumerate(layers_raw):
        if not isinstance(k, int) or isinstance(k, bool):
            c.add(f"{path}.hidden_layers[{i}]", f"must be a layer index (an integer), not {_typename(k)}")
        elif k == 0:
            c.add(f"{path}.hidden_layers[{i}]", "0 would be the input embeddings; layers count from 1 "
                                                "(transformers' output_hidden_states), -1 is the last")
        elif dims is not None and not -dims[1] <= k <= dims[1]:
            c.add(f"{path}.hidden_layers[{i}]", f"the model has {dims[1]} layers: 1..{dims[1]} or "
                                                f"-1..-{dims[1]}, not {k}")
        elif k in layers:
            c.add(f"{path}.hidden_layers[{i}]", f"layer {k} is listed twice")
        else:
            layers.append(k)
    hidden_prompt = bool(c.get(s, "hidden_prompt", path, bool, False))
    prompt_embeds = bool(c.get(s, "prompt_embeds", path, bool, False))
    return tuple(outputs), tuple(layers) or (-1,), hidden_prompt, prompt_embeds


def _parse_placement(c: _Checker, s: Mapping[str, Any], path: str, replicas: int,
                     devices: list[int]) -> tuple[str, ...]:
    """`placement`: "local" (the default), "ray", or one of them per replica."""
    raw = c.get(s, "placement", path, (str, list))
    if raw is None:
        return ()
    values = [raw] if isinstance(raw, str) else raw
    out: list[str] = []
    for i, v in enumerate(values):
        where = f"{path}.placement" + (f"[{i}]" if isinstance(raw, list) else "")
        if v not in PLACEMENTS:
            c.add(where, f"must be one of {', '.join(repr(p) for p in PLACEMENTS)}, not {v!r}")
            return ()
        out.append(v)
    if isinstance(raw, list) and len(out) != replicas:
        c.add(f"{path}.placement", f"gives {len(out)} placements (one per replica), but replicas = {replicas}")
        return ()
    if "ray" in out and devices:
        c.add(f"{path}.devices", "a Ray-placed stage gets its GPUs from Ray: set ray.num_gpus instead of "
                                 "devices (GPU indices of this machine)")
    return tuple(out) if "ray" in out else ()


def _parse_ray_needs(c: _Checker, s: Mapping[str, Any], path: str) -> RayNeeds:
    """`ray = { num_cpus, num_gpus, memory_mb, resources = {...}, labels = {...} }`."""
    if "ray" not in s:
        return RayNeeds()
    where = f"{path}.ray"
    r = c.table(s["ray"], where)
    c.unknown(r, ("num_cpus", "num_gpus", "memory_mb", "resources", "labels"), where)
    resources = c.get(r, "resources", where, dict, {})
    for k, v in resources.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            c.add(f"{where}.resources.{k}", f"must be a number > 0, not {v!r}")
    labels = c.get(r, "labels", where, dict, {})
    for k, v in labels.items():
        if not isinstance(v, str):
            c.add(f"{where}.labels.{k}", f"must be a string, not {_typename(v)}")
    memory = c.positive(r, "memory_mb", where, None, integer=True)
    return RayNeeds(num_cpus=float(c.positive(r, "num_cpus", where, 1.0, allow_zero=True)),
                    num_gpus=float(c.positive(r, "num_gpus", where, 0.0, allow_zero=True)),
                    memory_mb=memory,
                    resources={k: float(v) for k, v in resources.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0},
                    labels={k: v for k, v in labels.items() if isinstance(v, str)})


def _device_list(c: _Checker, raw: list[Any], path: str) -> list[int]:
    devices: list[int] = []
    for i, d in enumerate(raw):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            c.add(f"{path}[{i}]", f"must be a GPU index >= 0, not {d!r}")
        elif d in devices:
            c.add(f"{path}[{i}]", f"device {d} is given twice")
        else:
            devices.append(d)
    return devices


def _parse_devices(c: _Checker, s: Mapping[str, Any], path: str
                   ) -> tuple[list[int], tuple[tuple[int, ...], ...], int]:
    """`devices` and `replicas`: (the union of the devices, each replica's own set or (), replicas).

    `devices = [0, 1]`: every replica on GPUs 0 and 1 (one replica: the usual case);
    `devices = [[0], [1]]`: one set per replica, as many sets as `replicas` (which it implies).
    """
    raw = c.get(s, "devices", path, list, [])
    replicas = c.positive(s, "replicas", path, None, integer=True)
    if replicas is not None and replicas > MAX_REPLICAS:
        c.add(f"{path}.replicas", f"must be from 1 to {MAX_REPLICAS}, not {replicas}")
        replicas = MAX_REPLICAS
    if raw and all(isinstance(d, list) for d in raw):
        sets = [_device_list(c, d, f"{path}.devices[{i}]") for i, d in enumerate(raw)]
        if replicas is not None and replicas != len(sets):
            c.add(f"{path}.devices", f"gives {len(sets)} device sets (one per replica), but replicas = {replicas}")
        for i, one in enumerate(sets):
            if not one:
                c.add(f"{path}.devices[{i}]", "a replica's device set is empty (leave `devices` out for the CPU)")
        union = sorted({d for one in sets for d in one})
        shared = sorted(d for d in union if sum(d in one for one in sets) > 1)
        if shared and s.get("exclusive") is True:
            c.add(f"{path}.devices", f"device(s) {shared} are given to more than one replica, "
                                     "but the stage is exclusive")
        return union, tuple(tuple(one) for one in sets), len(sets)
    if any(isinstance(d, list) for d in raw):
        c.add(f"{path}.devices", "is either a list of GPU indexes ([0, 1]) or one list per replica "
                                 "([[0], [1]]), not a mix")
        return [], (), replicas or 1
    devices = _device_list(c, raw, f"{path}.devices")
    if devices and (replicas or 1) > 1 and s.get("exclusive") is True:
        c.add(f"{path}.devices", f"all {replicas} replicas would share device(s) {devices}, but the stage is "
                                 "exclusive: give each replica its own set (devices = [[0], [1]])")
    return devices, (), replicas or 1
