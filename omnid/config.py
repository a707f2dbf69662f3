"""The daemon's TOML configuration: parsing and validation (the types it parses into: config_types.py).

Runs in the supervisor (and in `omnid --check`) before anything starts; the
parsed, frozen `Config` is also handed to every stage worker at spawn, so it
must stay picklable and free of heavy imports. Nothing here blocks except
reading the file.

Validation collects *every* problem with its key path (`stages.draw.model`)
instead of stopping at the first, so one `omnid --check` run shows them all.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omnid import paths
from omnid.keys import KeyFileError, key_path, read_keys
from omnid.media import MEDIA_KINDS, NO_MEDIA, MediaLimits, detect_kinds
# The parsed config's types (standard library only, so that the engines and the protocol can name
# them from below); named here too, where most readers look for them.
from omnid.config_types import (FULL_WINDOW, Config, DaemonConfig, EdgeConfig, OwnerPolicy, PipelineConfig, RayNeeds,
                                StageConfig, TracingConfig)
from omnid.engines.capabilities import CAPABILITIES, capabilities, check_param, engines_that
from omnid.engines.capabilities import TENSOR_OUTPUTS as TENSOR_OUTPUTS     # (declared with the engines;
from omnid.engines.capabilities import TENSOR_PROMPTS as TENSOR_PROMPTS     # named here as before)
from omnid.params import parallel_size
from omnid import lora as L
from omnid.config_types import LoraConfig

ENGINES = tuple(CAPABILITIES)       # the names `engine = "..."` takes; what each can do: engines/capabilities.py
# Engines a streaming edge (window = N > 0) may feed (why the others cannot be: their `whole_input`).
STREAM_ENGINES = engines_that(lambda e: e.streamed_input)

@dataclass(frozen=True)
class Problem:
    """One configuration error, located by its key path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; `problems` lists every reason."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


# --------------------------------------------------------------------------- parsing


class _Checker:
    """Collects problems while reading untrusted TOML data."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def table(self, data: Any, path: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.add(path, f"must be a table, not {_typename(data)}")
            return {}
        return data

    def unknown(self, data: Mapping[str, Any], allowed: Iterable[str], path: str) -> None:
        allowed = set(allowed)
        for key in data:
            if key not in allowed:
                self.add(f"{path}.{key}" if path else key,
                         f"unknown key (known: {', '.join(sorted(allowed))})")

    def get(self, data: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...],
            default: Any = None, *, required: bool = False) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in data:
            if required:
                self.add(full, "is required")
            return default
        value = data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int in Python; a TOML `true` is never a valid number here.
        if isinstance(value, bool) and bool not in kinds:
            self.add(full, f"must be {_kindname(kinds)}, not a boolean")
            return default
        if not isinstance(value, kinds):
            self.add(full, f"must be {_kindname(kinds)}, not {_typename(value)}")
            return default
        return value

    def positive(self, data: Mapping[str, Any], key: str, path: str, default: float | None,
                 *, integer: bool = False, allow_zero: bool = False) -> Any:
        value = self.get(data, key, path, int if integer else (int, float), default)
        if value is not default and (value < 0 or (value == 0 and not allow_zero)):
            self.add(f"{path}.{key}", f"must be {'>= 0' if allow_zero else '> 0'}, not {value}")
            return default
        return value


def _typename(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _kindname(kinds: tuple[type, ...]) -> str:
    names = {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _resolve(base: Path, value: str) -> Path:
    p = Path(os.path.expandvars(os.path.expanduser(value)))
    return p if p.is_absolute() else (base / p)


def _host_port(c: _Checker, value: str | None, path: str) -> tuple[str, int] | None:
    """"127.0.0.1:9464" or "[::1]:9464" -> (host, port)."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        c.add(path, f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:9464\"), not {value!r}")
        return None
    return host, int(port)


def _parse_daemon(c: _Checker, raw: Any, base: Path) -> DaemonConfig:
    d = c.table(raw, "daemon")
    c.unknown(d, DaemonConfig.__dataclass_fields__, "daemon")
    defaults = paths.defaults()
    socket = c.get(d, "socket", "daemon", str)
    state_dir = c.get(d, "state_dir", "daemon", str)
    lock_dir = c.get(d, "lock_dir", "daemon", str)
    mode_raw = c.get(d, "socket_mode", "daemon", (int, str), 0o660)
    socket_mode = 0o660
    if isinstance(mode_raw, str):
        try:
            socket_mode = int(mode_raw, 8)
        except ValueError:
            c.add("daemon.socket_mode", f"must be an octal string like \"0660\", not {mode_raw!r}")
    elif isinstance(mode_raw, int):
        socket_mode = mode_raw
    if not 0 <= socket_mode <= 0o777:
        c.add("daemon.socket_mode", "must be between 0000 and 0777")
    level = c.get(d, "log_level", "daemon", str, "info")
    if level not in ("debug", "info", "warning", "error"):
        c.add("daemon.log_level", "must be one of debug, info, warning, error")
    fmt = c.get(d, "log_format", "daemon", str, "auto")
    if fmt not in ("auto", "console", "json"):
        c.add("daemon.log_format", "must be \"console\" or \"json\", or \"auto\" (json unless stderr is a terminal)")
    return DaemonConfig(
        socket=_resolve(base, socket) if socket else defaults.socket,
        state_dir=_resolve(base, state_dir) if state_dir else defaults.state_dir,
        lock_dir=_resolve(base, lock_dir) if lock_dir else defaults.lock_dir,
        max_queued_jobs=c.positive(d, "max_queued_jobs", "daemon", 256, integer=True),
        default_timeout_s=float(c.positive(d, "default_timeout_s", "daemon", 600.0)),
        socket_mode=socket_mode,
        socket_group=c.get(d, "socket_group", "daemon", str),
        max_request_bytes=c.positive(d, "max_request_bytes", "daemon", 64 << 20, integer=True),
        heartbeat_interval_s=float(c.positive(d, "heartbeat_interval_s", "daemon", 1.0)),
        heartbeat_timeout_s=float(c.positive(d, "heartbeat_timeout_s", "daemon", 30.0)),
        startup_timeout_s=float(c.positive(d, "startup_timeout_s", "daemon", 900.0)),
        cancel_grace_s=float(c.positive(d, "cancel_grace_s", "daemon", 5.0)),
        stop_grace_s=float(c.positive(d, "stop_grace_s", "daemon", 10.0)),
        drain_timeout_s=float(c.positive(d, "drain_timeout_s", "daemon", 60.0, allow_zero=True)),
        admin_group=c.get(d, "admin_group", "daemon", str),
        restart_backoff_s=float(c.positive(d, "restart_backoff_s", "daemon", 1.0)),
        restart_backoff_max_s=float(c.positive(d, "restart_backoff_max_s", "daemon", 30.0)),
        max_restarts=c.positive(d, "max_restarts", "daemon", 5, integer=True, allow_zero=True),
        restart_window_s=float(c.positive(d, "restart_window_s", "daemon", 300.0)),
        log_level=level or "info",
        log_format=fmt or "auto",
        shm_min_bytes=c.positive(d, "shm_min_bytes", "daemon", 1 << 20, integer=True),
        keep_jobs_days=float(c.positive(d, "keep_jobs_days", "daemon", 30.0, allow_zero=True)),
        keep_jobs=c.positive(d, "keep_jobs", "daemon", 10000, integer=True, allow_zero=True),
        retention_interval_s=float(c.positive(d, "retention_interval_s", "daemon", 60.0)),
        client_idle_timeout_s=float(c.positive(d, "client_idle_timeout_s", "daemon", 30.0)),
        metrics_listen=_host_port(c, c.get(d, "metrics_listen", "daemon", str), "daemon.metrics_listen"),
        log_file_max_bytes=c.positive(d, "log_file_max_bytes", "daemon", 10 << 20, integer=True),
        log_file_keep=c.positive(d, "log_file_keep", "daemon", 3, integer=True, allow_zero=True),
        ray_address=c.get(d, "ray_address", "daemon", str),
        preload_workers=bool(c.get(d, "preload_workers", "daemon", bool, True)),
        **_parse_tcp(c, d),
        fair_share=bool(c.get(d, "fair_share", "daemon", bool, True)),
        max_wait_s=float(c.positive(d, "max_wait_s", "daemon", 300.0, allow_zero=True)),
        owners=_parse_owners(c, d),
        min_free_mb=c.positive(d, "min_free_mb", "daemon", 512, integer=True, allow_zero=True),
        min_free_inodes=c.positive(d, "min_free_inodes", "daemon", 1024, integer=True, allow_zero=True),
        ballast_mb=c.positive(d, "ballast_mb", "daemon", 32, integer=True, allow_zero=True),
        tracing=_parse_tracing(c, d.get("tracing")),
        max_realtime_sessions=c.positive(d, "max_realtime_sessions", "daemon", 64, integer=True),
        max_realtime_sessions_per_key=c.positive(d, "max_realtime_sessions_per_key", "daemon", 8, integer=True),
        realtime_idle_timeout_s=float(c.positive(d, "realtime_idle_timeout_s", "daemon", 600.0)),
    )


def _parse_tracing(c: _Checker, raw: Any) -> TracingConfig | None:
    """`[daemon] tracing = { otlp_endpoint, sample, service_name }` (absent: tracing off)."""
    if raw is None:
        return None
    path = "daemon.tracing"
    t = c.table(raw, path)
    c.unknown(t, TracingConfig.__dataclass_fields__, path)
    default = TracingConfig()
    endpoint = c.get(t, "otlp_endpoint", path, str, default.otlp_endpoint)
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", endpoint):
        c.add(f"{path}.otlp_endpoint", f"must be an http(s) URL like \"http://127.0.0.1:4318\" (an OTLP/HTTP "
                                       f"receiver: an OpenTelemetry Collector, Jaeger), not {endpoint!r}")
        endpoint = default.otlp_endpoint
    sample = c.get(t, "sample", path, (int, float), 1.0)
    if not 0.0 <= sample <= 1.0:
        c.add(f"{path}.sample", f"must be between 0 and 1 (the share of traces kept), not {sample}")
        sample = 1.0
    name = c.get(t, "service_name", path, str, default.service_name)
    if not name.strip():
        c.add(f"{path}.service_name", "must not be empty")
        name = default.service_name
    return TracingConfig(otlp_endpoint=endpoint, sample=float(sample), service_name=name)


def _parse_tcp(c: _Checker, d: Mapping[str, Any]) -> dict[str, Any]:
    """`listen`, `allow_origins`, `metrics_without_key`: the TCP listener's keys of `[daemon]`."""
    raw = c.get(d, "listen", "daemon", list, [])
    listen: list[tuple[str, int]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            c.add(f"daemon.listen[{i}]", f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:8080\"), not {_typename(item)}")
            continue
        hp = _host_port(c, item, f"daemon.listen[{i}]")
        if hp is not None and hp in listen:
            c.add(f"daemon.listen[{i}]", f"{item!r} is listed twice")
        elif hp is not None:
            listen.append(hp)
    origins = c.get(d, "allow_origins", "daemon", list, [])
    for i, origin in enumerate(origins):
        if not isinstance(origin, str) or not (origin == "*" or re.match(r"^https?://[^/\s]+$", origin)):
            c.add(f"daemon.allow_origins[{i}]", f"must be an origin like \"https://chat.example.com\" (scheme "
                                                f"and host, no path) or \"*\", not {origin!r}")
    return {"listen": tuple(listen), "allow_origins": tuple(o for o in origins if isinstance(o, str)),
            "metrics_without_key": bool(c.get(d, "metrics_without_key", "daemon", bool, False))}


def _parse_owners(c: _Checker, d: Mapping[str, Any]) -> dict[str, OwnerPolicy]:
    """`[daemon.owners.WHO]`: "default", a uid ("1000") or "key:NAME", each with weight, max_priority, max_queued."""
    raw = c.get(d, "owners", "daemon", dict, {})
    owners: dict[str, OwnerPolicy] = {}
    for who, entry in (raw or {}).items():
        path = f"daemon.owners.{who}"
        if not (who == "default" or who.isdigit() or (who.startswith("key:") and len(who) > 4)):
            c.add(path, "must be \"default\", a uid (\"1000\") or \"key:NAME\"")
            continue
        if not isinstance(entry, dict):
            c.add(path, f"must be a table, not {_typename(entry)}")
            continue
        c.unknown(entry, ("weight", "max_priority", "max_queued"), path)
        weight = c.positive(entry, "weight", path, None)
        top = c.get(entry, "max_priority", path, int, None)
        if isinstance(top, bool) or (top is not None and abs(top) > 1_000_000):
            c.add(f"{path}.max_priority", "must be an integer from -1000000 to 1000000")
            top = None
        owners[who] = OwnerPolicy(weight=None if weight is None else float(weight), max_priority=top,
                                  max_queued=c.positive(entry, "max_queued", path, None, integer=True))
    return owners


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False            # a name: it may resolve to anything


def _check_listen_keys(c: _Checker, daemon: DaemonConfig) -> None:
    """A TCP listener beyond loopback needs API keys first (anyone who reaches it could try)."""
    wide = [f"{h}:{p}" for h, p in daemon.listen if not is_loopback(h)]
    if not wide:
        return
    path = key_path(daemon.state_dir)
    try:
        n = len(read_keys(path))
    except KeyFileError as e:
        c.add("daemon.listen", f"{', '.join(wide)} is not a loopback address, and {e}")
        return
    if not n:
        c.add("daemon.listen", f"{', '.join(wide)} is not a loopback address and there are no API keys "
                               f"({path} has none): add one first (omnictl key add NAME), or listen on "
                               "127.0.0.1 or ::1 only")


_STAGE_KEYS = ("engine", "model", "function", "python_path", "devices", "exclusive",
               "max_inflight", "queue_capacity", "shm_pool_mb", "args", "defaults", "env", "batch_function", "sessions",
               "replicas", "idle_unload_s", "media", "placement", "ray", "max_rss_mb",
               "engine_core", "outputs", "hidden_layers", "hidden_prompt", "prompt_embeds", "cache", "lazy", "lora")
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


def _check_callable_ref(c: _Checker, ref: str, path: str, python_path: tuple[Path, ...]) -> None:
    """`package.module:function`: check the form, and that the module can be found."""
    module, sep, func = ref.partition(":")
    if not sep or not module or not func or not func.isidentifier() or \
            not all(part.isidentifier() for part in module.split(".")):
        c.add(path, f"must be \"package.module:function\", not {ref!r}")
        return
    saved = list(sys.path)
    sys.path[:0] = [str(p) for p in python_path]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = saved
    if not found:
        where = " (searched python_path and sys.path)" if python_path else ""
        c.add(path, f"module {module!r} cannot be found{where}")


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
        max_rss_mb=int(max_rss_mb) if max_rss_mb is not None else None, engine_core=engine_core,
        placement=placement, ray=ray, outputs=outputs, hidden_layers=hidden_layers,
        hidden_prompt=hidden_prompt, prompt_embeds=prompt_embeds, cache=cache, lazy=lazy, lora=lora,
    )


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


def ray_available() -> bool:
    """Whether the `ray` extra is installed (`pip install omnid[ray]`), without importing it."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


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


def _parse_edge(c: _Checker, raw: Any, path: str, members: tuple[str, ...],
                known_stages: Mapping[str, Any]) -> EdgeConfig | None:
    e = c.table(raw, path)
    if not isinstance(raw, dict):
        return None
    c.unknown(e, ("from", "to", "window", "map", "transform"), path)
    src = c.get(e, "from", path, str, required=True)
    dst = c.get(e, "to", path, str, required=True)
    ok = src is not None and dst is not None
    for key, stage in (("from", src), ("to", dst)):
        if stage is None:
            continue
        if stage not in known_stages:
            c.add(f"{path}.{key}", f"unknown stage {stage!r}")
            ok = False
        elif stage not in members:
            c.add(f"{path}.{key}", f"stage {stage!r} is not in this pipeline's stages")
            ok = False
    if ok and src == dst:
        c.add(path, f"an edge from {src!r} to itself is a cycle")
        ok = False
    window, schedule = _parse_window(c, e.get("window", FULL_WINDOW), f"{path}.window")
    if window is None:
        window, ok = FULL_WINDOW, False
    dst_stage = known_stages.get(dst) if isinstance(dst, str) else None
    whole = capabilities(dst_stage.engine).whole_input if isinstance(dst_stage, StageConfig) else ""
    if window > 0 and isinstance(dst_stage, StageConfig) and not capabilities(dst_stage.engine).streamed_input:
        c.add(f"{path}.window", f"stage {dst!r} ({dst_stage.engine}) cannot be fed by a window edge: "
                                f"{whole}. Only {', '.join(STREAM_ENGINES)} stages take streamed inputs; use window = -1")
        ok = False
    mapping = c.get(e, "map", path, dict)
    if mapping is not None:
        for k, v in mapping.items():
            if not isinstance(v, str):
                c.add(f"{path}.map.{k}", f"must name an upstream output (a string), not {_typename(v)}")
                ok = False
    transform = c.get(e, "transform", path, str)
    if transform is not None:
        # A transform runs in the upstream stage's worker, with that stage's python_path.
        src_stage = known_stages.get(src) if isinstance(known_stages, Mapping) else None
        src_path = src_stage.python_path if isinstance(src_stage, StageConfig) else ()
        _check_callable_ref(c, transform, f"{path}.transform", src_path)
    src_stage = known_stages.get(src) if isinstance(src, str) else None
    gives = capabilities(src_stage.engine).gives if isinstance(src_stage, StageConfig) else None
    if mapping is not None and isinstance(src_stage, StageConfig) and gives is not None:
        for k, v in mapping.items():
            if isinstance(v, str) and v not in gives:
                c.add(f"{path}.map.{k}", f"stage {src!r} ({src_stage.engine}) cannot give {v!r}: it gives "
                                         f"{', '.join(gives)}")
                ok = False
    if not ok:
        return None
    return EdgeConfig(src=src, dst=dst, window=window, map=mapping, transform=transform, schedule=schedule)


def _parse_window(c: _Checker, raw: Any, path: str) -> tuple[int | None, tuple[int, ...]]:
    """`window`: -1, N > 0, or a schedule [N1, N2, ...] (the last size repeats): (first, schedule),
    or (None, ()) when it is none of them."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw == FULL_WINDOW or raw > 0:
            return raw, ()
        c.add(path, f"must be -1 (full trigger) or a segment count > 0, not {raw}")
        return None, ()
    if isinstance(raw, list):
        if not raw:
            c.add(path, "a window schedule lists at least one size, e.g. [4, 8, 16, 25]")
            return None, ()
        bad = [i for i, n in enumerate(raw) if not isinstance(n, int) or isinstance(n, bool) or n <= 0]
        for i in bad:
            c.add(f"{path}[{i}]", f"a window size is a segment count > 0, not {raw[i]!r}")
        if bad:
            return None, ()
        return int(raw[0]), tuple(int(n) for n in raw)
    c.add(path, f"must be an integer, not {_typename(raw)} (or a list of integers: a schedule)")
    return None, ()


def _check_tensor_edges(c: _Checker, path: str, edge: EdgeConfig, stages: Mapping[str, StageConfig]) -> None:
    """An edge that hands a vllm stage `prompt_embeds` or `prompt_token_ids` from a vllm stage must
    give what it can take: hidden states of its width (one layer), token ids."""
    src, dst = stages.get(edge.src), stages.get(edge.dst)
    if edge.map is None or src is None or dst is None or not capabilities(dst.engine).tensors \
            or not capabilities(src.engine).tensors:
        return
    for down, up in edge.map.items():
        where = f"{path}.map.{down}"
        if down == "prompt_embeds":
            if up != "hidden_states":
                c.add(where, f"prompt_embeds are (tokens, hidden) rows: map them from \"hidden_states\", not {up!r}")
                continue
            if len(src.hidden_layers) > 1:
                c.add(where, f"stage {edge.src!r} gives {len(src.hidden_layers)} layers (hidden_layers): "
                             "prompt_embeds take one; use a transform to pick it")
            mine, theirs = model_dims(src.model), model_dims(dst.model)
            if mine is not None and theirs is not None and mine[0] != theirs[0]:
                c.add(where, f"stage {edge.src!r} gives hidden states of width {mine[0]}, but the model of "
                             f"stage {edge.dst!r} takes embeddings of width {theirs[0]} (hidden_size in "
                             f"{dst.model}/config.json): use a transform that projects them")
        elif down == "prompt_token_ids" and up not in ("token_ids", "prompt_token_ids"):
            c.add(where, f"prompt_token_ids are token ids: map them from \"token_ids\" (or "
                         f"\"prompt_token_ids\"), not {up!r}")


def _check_media_edges(c: _Checker, path: str, edges: list[EdgeConfig], stages: Mapping[str, StageConfig]) -> None:
    """An edge that hands media (by its map, or a diffusers stage's `image` by name) to a vllm stage
    whose model takes none would fail every job: said now."""
    for edge in edges:
        src, dst = stages.get(edge.src), stages.get(edge.dst)
        if dst is None or not capabilities(dst.engine).media:
            continue
        if edge.map is not None:
            names = [(f"{path}.map.{k}", k) for k in edge.map]
        elif edge.transform is None and src is not None and capabilities(src.engine).answer == "image":
            names = [(path, "image")]           # what a diffusers stage gives, passed on by name
        else:
            names = []
        for where, kind in names:
            if kind in MEDIA_KINDS and dst.media.count(kind) == 0:
                c.add(where, f"stage {edge.dst!r} takes no {kind} input (the media its model takes: "
                             f"{', '.join(dst.media.kinds) or 'none'}; stages.{edge.dst}.media)")


def _find_cycle(stages: tuple[str, ...], edges: list[EdgeConfig]) -> list[str] | None:
    graph = {s: [e.dst for e in edges if e.src == s] for s in stages}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state.get(nxt) is None and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for s in stages:
        if state.get(s) is None and (found := visit(s)):
            return found
    return None


def _parse_pipeline(c: _Checker, name: str, raw: Any, known_stages: Mapping[str, Any],
                    parsed: Mapping[str, StageConfig]) -> PipelineConfig | None:
    path = f"pipelines.{name}"
    p = c.table(raw, path)
    if not isinstance(raw, dict):
        return None
    c.unknown(p, ("stages", "edges", "timeout_s", "retries", "outputs"), path)
    members_raw = c.get(p, "stages", path, list, [], required=True)
    members: list[str] = []
    for i, s in enumerate(members_raw):
        if not isinstance(s, str):
            c.add(f"{path}.stages[{i}]", f"must be a stage name, not {_typename(s)}")
        elif s not in known_stages:
            c.add(f"{path}.stages[{i}]", f"unknown stage {s!r}")
        elif s in members:
            c.add(f"{path}.stages[{i}]", f"stage {s!r} is listed twice")
        else:
            members.append(s)
    if "stages" in p and not members_raw:
        c.add(f"{path}.stages", "must name at least one stage")
    edges_raw = c.get(p, "edges", path, list)
    edges: list[EdgeConfig] = []
    if edges_raw is None:
        # A plain chain: each stage feeds the next, outputs passed by name.
        edges = [EdgeConfig(src=a, dst=b) for a, b in zip(members, members[1:])]
        _check_media_edges(c, f"{path}.stages", edges, parsed)
    else:
        seen: set[tuple[str, str]] = set()
        named: set[str] = set()         # the stages each edge names, those refused too
        for i, raw_edge in enumerate(edges_raw):
            if isinstance(raw_edge, dict):
                named |= {v for k in ("from", "to") if isinstance(v := raw_edge.get(k), str)}
            edge = _parse_edge(c, raw_edge, f"{path}.edges[{i}]", tuple(members),
                               {k: parsed.get(k, v) for k, v in known_stages.items()})
            if edge is None:
                continue
            if (edge.src, edge.dst) in seen:
                c.add(f"{path}.edges[{i}]", f"duplicate edge {edge.src} -> {edge.dst}")
                continue
            seen.add((edge.src, edge.dst))
            edges.append(edge)
            _check_media_edges(c, f"{path}.edges[{i}]", [edge], parsed)
            _check_tensor_edges(c, f"{path}.edges[{i}]", edge, parsed)
        for edge in edges:
            others = [e.src for e in edges if e.dst == edge.dst and e is not edge]
            if edge.window > 0 and others:
                c.add(f"{path}.edges", f"stage {edge.dst!r} is fed by a window edge from {edge.src!r} and also by "
                                       f"{', '.join(repr(o) for o in others)}: a stage fed by a window edge "
                                       "takes no other input (merge them upstream, or use window = -1)")
        cycle = _find_cycle(tuple(members), edges)
        if cycle:
            c.add(f"{path}.edges", f"the edges form a cycle: {' -> '.join(cycle)}")
        elif members and len(members) > 1:
            # (a stage an edge names, refused for another reason, is said once: by that edge)
            linked = {e.src for e in edges} | {e.dst for e in edges} | named
            for s in members:
                if s not in linked:
                    c.add(f"{path}.edges", f"stage {s!r} is in the pipeline but on no edge")
    timeout = c.get(p, "timeout_s", path, (int, float))
    if timeout is not None and timeout <= 0:
        c.add(f"{path}.timeout_s", f"must be > 0, not {timeout}")
        timeout = None
    retries = c.get(p, "retries", path, int, 0)
    if retries < 0:
        c.add(f"{path}.retries", "must be >= 0")
    keep = _parse_kept_outputs(c, p, path, members, edges)
    return PipelineConfig(name=name, stages=tuple(members), edges=tuple(edges),
                          timeout_s=float(timeout) if timeout is not None else None,
                          retries=max(0, retries), keep=keep)


def _parse_kept_outputs(c: _Checker, p: Mapping[str, Any], path: str, members: list[str],
                        edges: list[EdgeConfig]) -> dict[str, tuple[str, ...]]:
    """A pipeline's `outputs = { STAGE = ["name", ...] }`: outputs of stages that are not last,
    kept as the job's too."""
    raw = c.get(p, "outputs", path, dict, {})
    keep: dict[str, tuple[str, ...]] = {}
    for stage, names in raw.items():
        where = f"{path}.outputs.{stage}"
        if stage not in members:
            c.add(where, f"stage {stage!r} is not in the pipeline")
        elif not any(e.src == stage for e in edges):
            c.add(where, f"stage {stage!r} is a last stage: all its outputs are the job's already")
        elif not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            c.add(where, "must be a list of output names, e.g. [\"text\"]")
        else:
            keep[stage] = tuple(dict.fromkeys(names))
    return keep


def _check_devices(c: _Checker, stages: Mapping[str, StageConfig]) -> None:
    users: dict[int, list[StageConfig]] = {}
    for s in stages.values():
        for d in s.devices:
            users.setdefault(d, []).append(s)
    for device, group in sorted(users.items()):
        if len(group) > 1:
            for s in group:
                if s.exclusive:
                    others = ", ".join(o.name for o in group if o is not s)
                    c.add(f"stages.{s.name}.devices",
                          f"device {device} is also given to {others}, but this stage is exclusive")


def _check_ray(c: _Checker, daemon: DaemonConfig, stages: Mapping[str, StageConfig]) -> None:
    """Ray-placed stages need the `ray` extra and a cluster to run on."""
    placed = [s.name for s in stages.values() if "ray" in s.placement]
    if not placed:
        return
    if not ray_available():
        for name in placed:
            c.add(f"stages.{name}.placement", "\"ray\" needs Ray, which is not installed: "
                                             "pip install 'omnid[ray]'")
    if daemon.ray_address is None:
        c.add("daemon.ray_address", f"is required: stage(s) {', '.join(placed)} are placed on Ray "
                                    "(the head's \"HOST:6379\", or \"auto\")")


def parse(data: Mapping[str, Any], *, base: Path, source: str = "<config>") -> Config:
    """Validate already-parsed TOML data; raise ConfigError listing every problem."""
    c = _Checker()
    c.unknown(data, ("daemon", "stages", "pipelines"), "")
    daemon = _parse_daemon(c, data.get("daemon", {}), base)
    stages_raw = c.table(data.get("stages", {}), "stages")
    stages: dict[str, StageConfig] = {}
    for name, raw in stages_raw.items():
        if not name.replace("-", "_").isidentifier():
            c.add(f"stages.{name}", "a stage name is letters, digits, '_' and '-'")
            continue
        st = _parse_stage(c, name, raw, base)
        if st is not None:
            stages[name] = st
    if not stages_raw:
        c.add("stages", "no stages are defined")
    _check_devices(c, stages)
    _check_ray(c, daemon, stages)
    _check_listen_keys(c, daemon)
    pipes_raw = c.table(data.get("pipelines", {}), "pipelines")
    pipelines: dict[str, PipelineConfig] = {}
    for name, raw in pipes_raw.items():
        if not name.replace("-", "_").isidentifier():
            c.add(f"pipelines.{name}", "a pipeline name is letters, digits, '_' and '-'")
            continue
        pl = _parse_pipeline(c, name, raw, stages_raw, stages)
        if pl is not None:
            pipelines[name] = pl
    if not pipes_raw:
        c.add("pipelines", "no pipelines are defined")
    stages = _derive_tensors(c, stages, pipelines)
    if c.problems:
        raise ConfigError(source, c.problems)
    return Config(source=None, daemon=daemon, stages=stages, pipelines=pipelines)


def _derive_tensors(c: _Checker, stages: dict[str, StageConfig],
                    pipelines: Mapping[str, PipelineConfig]) -> dict[str, StageConfig]:
    """Each vllm stage with what the pipelines ask of it: its tensor outputs (`outputs` and every
    edge that maps one out of it) and whether an edge hands it prompt_embeds."""
    out = dict(stages)
    for name, st in stages.items():
        if not capabilities(st.engine).tensors:
            continue
        asked = set(st.outputs)
        embeds = st.prompt_embeds
        for p in pipelines.values():
            asked |= p.asks(name) & set(TENSOR_OUTPUTS)
            embeds = embeds or any(e.map is not None and "prompt_embeds" in e.map for e in p.incoming(name))
        if "hidden_states" in asked and int(st.args.get("pipeline_parallel_size", 1) or 1) > 1:
            c.add(f"stages.{name}.args.pipeline_parallel_size", "hidden states are tapped on the rank that "
                  "holds the whole model: pipeline parallelism cannot give them")
        out[name] = replace(st, tensor_outputs=frozenset(asked), takes_embeds=embeds)
    return out


def load(path: Path) -> Config:
    """Read and validate a config file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(str(path), [Problem("(file)", f"cannot read: {e.strerror or e}")]) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), [Problem("(file)", f"not valid TOML: {e}")]) from None
    cfg = parse(data, base=path.resolve().parent, source=str(path))
    return Config(source=path.resolve(), daemon=cfg.daemon, stages=cfg.stages, pipelines=cfg.pipelines)
