"""A `[stages.NAME]` table: its engine and model (or function), devices and replicas, placement and
Ray needs, and the tables a stage may carry: `media`, `cache` (a DiT's), `lora`, its tensor keys
(`outputs`, `hidden_layers`, ...), `engine_core`. What each engine takes is read from
engines/capabilities.py; models are looked at on disk (config.json, model_index.json), never loaded.
The table's keys, types and bounds are its model's (schema.py's `StageTable`, which it is read
through); here, what depends on the engine, on other keys or on the disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnid import lora as L
from omnid.config.checker import PRODUCED_KINDS, Checker, check_callable_ref, declared_produces, resolve_path, typename
from omnid.config.schema import (
    BATCHINGS,
    CACHE_DTYPES,
    CACHE_KINDS,
    ENGINE_CORES,
    ENGINES,
    MAX_REPLICAS,
    PLACEMENTS,
    VLLM_LORA_RANKS,
    LoraTable,
    MediaTable,
    StageTable,
    read,
)
from omnid.config_types import LoraConfig, RayNeeds, StageConfig
from omnid.engines.capabilities import TENSOR_OUTPUTS, capabilities, check_param, engines_that
from omnid.media import MEDIA_KINDS, NO_MEDIA, MediaLimits, detect_kinds
from omnid.params import parallel_size

__all__ = ["BATCHINGS", "CACHE_DTYPES", "CACHE_KINDS", "ENGINE_CORES", "ENGINES", "MAX_REPLICAS", "PLACEMENTS",
           "VLLM_LORA_RANKS", "LORA_KEYS", "VLLM_LORA_ARGS", "model_dims", "name_of"]

STAGE_KEYS = tuple(f.alias or k for k, f in StageTable.model_fields.items())     # (the model's keys)
_TENSOR_KEYS = ("outputs", "hidden_layers", "hidden_prompt", "prompt_embeds")
_MARKER_WORDS = {"image": "vision_config (nor image token)", "audio": "audio_config (nor audio token)",
                 "video": "video token"}


def _parse_media(c: Checker, m: MediaTable | None, path: str, engine: str | None, model: Path | None
                 ) -> MediaLimits:
    """`[stages.NAME.media]`: per kind, how many items a job may give (default: 1 for each kind the
    model's config.json shows, else 0), and the limits on each item."""
    path = f"{path}.media"
    takes_media = engine is not None and capabilities(engine).media
    detected = detect_kinds(model) if takes_media else ()
    if m is None:
        return MediaLimits(**{k: 1 for k in detected}, detected=detected) if detected else NO_MEDIA
    if engine is not None and not takes_media:
        c.add(path, f"only {', '.join(engines_that(lambda e: e.media))} stages take media inputs (a {engine} "
                    "stage gets its inputs as they are)")
        return NO_MEDIA
    counts: dict[str, int] = {}
    for kind in MEDIA_KINDS:
        given = getattr(m, kind)
        n = (1 if kind in detected else 0) if given is None else given
        if given is not None and n > 0 and kind not in detected and model is not None \
                and (model / "config.json").is_file():
            c.add(f"{path}.{kind}", f"the model {str(model)!r} takes no {kind} input: its config.json has "
                                    f"no {_MARKER_WORDS[kind]} (set 0, or leave it out)")
        counts[kind] = n
    return MediaLimits(**counts, max_bytes=m.max_bytes, max_pixels=m.max_pixels, max_audio_s=m.max_audio_s,
                       max_video_frames=m.max_video_frames, detected=detected)


def _check_vllm_parallelism(c: Checker, path: str, args: Mapping[str, Any], devices: list[int]) -> None:
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


def _parse_cache(c: Checker, raw: Any, path: str, engine: str | None, model: Path | None) -> dict[str, Any]:
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


def parse_stage(c: Checker, name: str, raw: Any, base: Path) -> StageConfig | None:
    path = f"stages.{name}"
    st = read(c, StageTable, raw, path)
    if st is None:
        return None
    s: dict[str, Any] = raw             # (the keys given, and those the parser checks itself)
    if "engine" not in s:
        c.add(f"{path}.engine", "is required")
    engine: str | None = st.engine
    caps = capabilities(engine) if engine is not None else None
    python_path = tuple(resolve_path(base, p) for p in st.python_path)
    model = _parse_code(c, st, path, base, python_path)
    function, batch_function, sessions = st.function, st.batch_function, st.sessions
    produces = _parse_produces(c, s, path, engine, caps is not None and caps.takes_function,
                               sessions or function or batch_function, python_path)
    devices, replica_devices, replicas = _parse_devices(c, s, path,
                                                        st.replicas if "replicas" in st.model_fields_set else None)
    _check_engine_keys(c, st, path, devices, replica_devices)
    media = _parse_media(c, st.media if "media" in st.model_fields_set else None, path, engine, model)
    engine_core = _engine_only(c, st, "engine_core", path, caps is None or caps.engine_core,
                               "only vllm stages have an engine core to place")
    batching = _engine_only(c, st, "batching", path, caps is None or caps.step_batching,
                            "only diffusers stages choose how they batch")
    placement = _parse_placement(c, s, path, replicas, devices)
    ray = RayNeeds(**st.ray.model_dump())
    outputs, hidden_layers = _parse_tensors(c, s, path, engine, model)
    cache = _parse_cache(c, s.get("cache"), path, engine, model)
    lora = _parse_lora(c, st.lora, path, engine, model, base, st.args, st.defaults)
    if st.lazy and caps is not None and not caps.takes_function:
        c.add(f"{path}.lazy", f"only python stages load lazily; a {engine} stage loads its model at start")
    if engine is None:
        return None
    return StageConfig(
        name=name, engine=engine, model=model, function=function, python_path=python_path,
        devices=tuple(devices), exclusive=st.exclusive, max_inflight=st.max_inflight,
        queue_capacity=st.queue_capacity, shm_pool_mb=st.shm_pool_mb,
        args=dict(st.args), defaults=dict(st.defaults), env=dict(st.env),
        batch_function=batch_function, sessions=sessions, media=media, replicas=replicas,
        replica_devices=replica_devices,
        idle_unload_s=st.idle_unload_s, max_rss_mb=st.max_rss_mb, engine_core=engine_core, batching=batching,
        placement=placement, ray=ray, outputs=outputs, hidden_layers=hidden_layers,
        hidden_prompt=st.hidden_prompt and _tensors(engine), prompt_embeds=st.prompt_embeds and _tensors(engine),
        cache=cache, lazy=st.lazy, lora=lora, produces=produces,
    )


def _parse_code(c: Checker, st: StageTable, path: str, base: Path, python_path: tuple[Path, ...]) -> Path | None:
    """What a stage runs: the model folder its engine loads (with the marker file the engine looks
    for), or a python stage's function, batch_function or sessions class (findable on its
    python_path), the model it may name besides. The model's path, when one is named."""
    engine, model_raw = st.engine, st.model
    function, batch_function, sessions = st.function, st.batch_function, st.sessions
    caps = capabilities(engine) if engine is not None else None
    model: Path | None = None
    if caps is not None and caps.model_marker is not None:
        if model_raw is None:
            c.add(f"{path}.model", f"is required for engine {engine!r}")
        else:
            model = resolve_path(base, model_raw)
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
            check_callable_ref(c, sessions, f"{path}.sessions", python_path)
        if function is not None:
            check_callable_ref(c, function, f"{path}.function", python_path)
        if batch_function is not None:
            check_callable_ref(c, batch_function, f"{path}.batch_function", python_path)
        if model_raw is not None:
            model = resolve_path(base, model_raw)
    return model


def _check_engine_keys(c: Checker, st: StageTable, path: str, devices: list[int],
                       replica_devices: tuple[tuple[int, ...], ...]) -> None:
    """What the stage's engine makes of `max_inflight` (its batch bound), `args` (parallelism and the
    keys omnid sets itself) and `defaults` (the parameters it takes, and their rules)."""
    engine, max_inflight, args = st.engine, st.max_inflight, st.args
    caps = capabilities(engine) if engine is not None else None
    if caps is not None and caps.max_batch is not None and max_inflight > caps.max_batch:
        # up to max_inflight compatible jobs run as one batched pipeline call: keep that call bounded
        c.add(f"{path}.max_inflight", f"engine {engine!r} batches at most {caps.max_batch} jobs in one pipeline "
                                      f"call; must be from 1 to {caps.max_batch}, not {max_inflight}")
    args = st.args
    if caps is not None and caps.parallel:
        for one in (replica_devices or (tuple(devices),)):
            _check_vllm_parallelism(c, path, args, list(one))
    if caps is not None and caps.media:
        if "limit_mm_per_prompt" in args:
            c.add(f"{path}.args.limit_mm_per_prompt", "set the media a job may give in the stage's media table "
                  "instead (media.image, media.audio, media.video): omnid passes them to vLLM as this, and "
                  "checks jobs against them")
    if caps is not None and engine is not None:
        known = caps.params
        for k, v in st.defaults.items():
            if known is not None and k not in known:
                c.add(f"{path}.defaults.{k}",
                      f"unknown parameter for engine {engine!r} (known: {', '.join(sorted(known))})")
            elif (why := check_param(engine, k, v)) is not None:
                c.add(f"{path}.defaults.{k}", f"{why}, not {v!r}")


def _parse_produces(c: Checker, s: Mapping[str, Any], path: str, engine: str | None, python: bool,
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


LORA_KEYS = tuple(LoraTable.model_fields)
VLLM_LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "lora_modules")


def _parse_lora(c: Checker, t: LoraTable | None, path: str, engine: str | None, model: Path | None, base: Path,
                args: Mapping[str, Any], defaults: Mapping[str, Any]) -> LoraConfig | None:
    """`lora = { adapters = { sql = "path" }, max_loras = 4, max_lora_rank = 16 }`: each adapter
    checked (a LoRA, its rank within max_lora_rank, made for the stage's model: `omnid.lora`)."""
    caps = capabilities(engine) if engine is not None else None
    if caps is not None and caps.parallel:
        for key in VLLM_LORA_ARGS:
            if key in args:
                c.add(f"{path}.args.{key}", "set LoRA in the stage's lora table instead (lora.adapters, "
                                            "lora.max_loras, lora.max_lora_rank): omnid turns vLLM's LoRA on with it")
    if t is None:
        for key in ("adapter", "adapters"):
            if key in defaults:
                c.add(f"{path}.defaults.{key}", "the stage has no adapters (no lora table)")
        return None
    path = f"{path}.lora"
    if caps is not None and not caps.lora:
        c.add(path, f"only {', '.join(engines_that(lambda e: e.lora))} stages take LoRA adapters "
                    f"(this one is {engine!r})")
        return None
    max_loras, max_rank = t.max_loras, t.max_lora_rank
    if caps is not None and caps.parallel and max_rank not in VLLM_LORA_RANKS:
        c.add(f"{path}.max_lora_rank", f"vLLM takes one of {', '.join(map(str, VLLM_LORA_RANKS))}, not {max_rank}")
    adapters: dict[str, Path] = {}
    for name, value in t.adapters.items():
        where = f"{path}.adapters.{name}"
        if (why := L.name_problem(name)) is not None:
            c.add(where, why)
            continue
        folder = resolve_path(base, value)
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


def _engine_only(c: Checker, st: StageTable, key: str, path: str, takes: bool, words: str) -> str:
    """`engine_core` ("inline" | "process": a vllm stage's engine core in the worker's thread, or in a
    process of its own) or `batching` ("step" | "call": a diffusers stage's jobs join a batch at a
    denoising step, or only when a pipeline call starts): a key only one engine takes."""
    if key in st.model_fields_set and st.engine is not None and not takes:
        c.add(f"{path}.{key}", f"{words}, not {st.engine!r}")
    return str(getattr(st, key)) if takes else str(StageTable.model_fields[key].default)


def _tensors(engine: str | None) -> bool:
    """Whether a stage of `engine` gives tensors (and takes the tensor keys)."""
    caps = capabilities(engine) if engine is not None else None
    return caps is not None and caps.tensors and caps.gives is not None


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


def _parse_tensors(c: Checker, s: Mapping[str, Any], path: str, engine: str | None, model: Path | None
                   ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A vllm stage's tensor keys: outputs, hidden_layers (hidden_prompt and prompt_embeds, two
    booleans, its model checked)."""
    caps = capabilities(engine) if engine is not None else None
    if caps is None or not caps.tensors or caps.gives is None:
        for key in _TENSOR_KEYS:
            if key in s and engine is not None:
                c.add(f"{path}.{key}", f"only {', '.join(engines_that(lambda e: e.tensors))} stages take {key}, "
                                       f"not {engine!r}")
        return (), (-1,)
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
            c.add(f"{path}.hidden_layers[{i}]", f"must be a layer index (an integer), not {typename(k)}")
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
    return tuple(outputs), tuple(layers) or (-1,)


def _parse_placement(c: Checker, s: Mapping[str, Any], path: str, replicas: int,
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


def _device_list(c: Checker, raw: list[Any], path: str) -> list[int]:
    devices: list[int] = []
    for i, d in enumerate(raw):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            c.add(f"{path}[{i}]", f"must be a GPU index >= 0, not {d if type(d) is int else typename(d)}")
        elif d in devices:
            c.add(f"{path}[{i}]", f"device {d} is given twice")
        else:
            devices.append(d)
    return devices


def _parse_devices(c: Checker, s: Mapping[str, Any], path: str, replicas: int | None
                   ) -> tuple[list[int], tuple[tuple[int, ...], ...], int]:
    """`devices` and `replicas`: (the union of the devices, each replica's own set or (), replicas).

    `devices = [0, 1]`: every replica on GPUs 0 and 1 (one replica: the usual case);
    `devices = [[0], [1]]`: one set per replica, as many sets as `replicas` (which it implies).
    """
    raw = c.get(s, "devices", path, list, [])
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
