"""The config file's shape, defined once: a pydantic model per table (`[daemon]`, its `tracing` and
`owners`, `[stages.NAME]` with its `media`, `lora` and `ray`, `[pipelines.NAME]` with its edges and
`realtime`), each key with its type, bounds, default and meaning.

The parser (daemon.py, stages.py, pipelines.py) reads every table through its model (`read`):
pydantic checks the keys, types and bounds, and its errors are said in the house's words, at their
key path (`stages.draw.max_inflight: must be > 0, not 0`), never in pydantic's. A key's default is
the parsed type's (config_types.py; `_DAEMON.max_queued_jobs`), stated there only; a key whose
parsed form differs (a path, an octal mode, `devices`) has its own. What depends on more than one
key, on the engine or on the disk (a model folder, a `module:function`, an edge's stages) stays
with the parser. A key whose per-item checks the parser says itself (`devices`, `window`,
`hidden_layers`, ...) is typed here for the schema and the reference, but not validated twice
(`SkipValidation`).

From the same models: `json_schema()`, the JSON Schema of omnid.toml (`omnid config-schema`,
etc/omnid.schema.json, for editors through taplo), and `reference()`, the rows of the configuration
reference (key, type, default, meaning) that the docs are checked against.

Runs wherever the config is parsed (the supervisor, `omnid --check`); pydantic only, no engine.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, WithJsonSchema, WrapValidator
from pydantic_core import PydanticCustomError

from omnid.config.checker import Checker, typename
from omnid.config_types import (
    OVERLOAD_MODES,
    DaemonConfig,
    LoraConfig,
    Overload,
    OwnerPolicy,
    RayNeeds,
    RealtimeConfig,
    StageConfig,
    TracingConfig,
)
from omnid.engines.capabilities import CAPABILITIES, TENSOR_OUTPUTS, stage_accepts, stage_params_schema
from omnid.media import DEFAULT_MAX_AUDIO_S, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, DEFAULT_MAX_VIDEO_FRAMES

ENGINES = tuple(CAPABILITIES)       # the names `engine = "..."` takes; what each can do: engines/capabilities.py
# The choices of a key, as its type (a test holds each to what its users know: ENGINES, PRODUCED_KINDS, ...)
Engine = Literal["vllm", "diffusers", "python"]
Placement = Literal["local", "ray"]
EngineCore = Literal["inline", "process"]
Batching = Literal["step", "call"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "console", "json"]
OutputKind = Literal["text", "image", "audio", "tensor", "json", "file"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
ENGINE_CORES: tuple[str, ...] = get_args(EngineCore)
BATCHINGS: tuple[str, ...] = get_args(Batching)
MAX_REPLICAS = 64
# vLLM's own choices of max_lora_rank (its LoRAConfig's MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# `cache` of a diffusers stage: its kinds (diffusers' hook configs, named without "Config") and the
# options each takes, by the kind of TOML value: "int", "number", "bool", "string", "range" (two
# integers [lo, hi]), "numbers" / "strings" (arrays of those). Options that are callables or tensors
# in diffusers are left out; the engine fills the timestep callback in. The supervisor checks them
# without importing diffusers.
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


# ------------------------------------------------------------------------- the house's words

def says(message: str | Callable[[Any], str], *, types: bool = False) -> WrapValidator:
    """A key's own words when its value is refused (`message`, or `message(value)`), instead of the
    generic ones; a value of the wrong type keeps the generic "must be a string, not an integer"
    unless `types`."""
    def wrap(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            if not types and all(err["type"].endswith("_type") for err in e.errors()):
                raise
            raise PydanticCustomError("omnid", message(value) if callable(message) else message) from None
    return WrapValidator(wrap)


def _shown(value: Any) -> str:
    """A refused value as a message shows it: a string quoted, a TOML boolean as TOML writes it."""
    return "true" if value is True else "false" if value is False else repr(value)


_KIND_WORDS = {"int_type": "an integer", "float_type": "an integer or a number", "string_type": "a string",
               "bool_type": "a boolean", "dict_type": "a table", "model_type": "a table",
               "model_attributes_type": "a table", "list_type": "an array"}
_BOUND_WORDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
                "less_than_equal": ("le", "<=")}


def _words(err: Any, model: type[BaseModel]) -> str:
    """One pydantic error in the house's words."""
    kind, value = err["type"], err.get("input")
    if kind == "omnid":
        return str(err["msg"])
    if kind in _KIND_WORDS:
        return f"must be {_KIND_WORDS[kind]}, not {typename(value)}"
    if kind in _BOUND_WORDS:
        key, sign = _BOUND_WORDS[kind]
        bound = err["ctx"][key]
        return f"must be {sign} {int(bound) if float(bound).is_integer() else bound}, not {_shown(value)}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        parent = _model_at(model, err["loc"][:-1])
        known = sorted(_keys(parent)) if parent is not None else []
        return f"unknown key (known: {', '.join(known)})"
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}, not {_shown(value)}"
    return f"is not valid: {_shown(value)}"         # (every key above says its own words: a fallback)


def _keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _tables_in(annotation: Any) -> Iterator[Any]:
    """The types an annotation holds (through Annotated, unions, dicts and lists)."""
    yield annotation
    for arg in get_args(annotation):
        if not isinstance(arg, (str, int, float)) and arg is not Ellipsis:
            yield from _tables_in(arg)


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model of the table at `loc` under `model` (a key of a dict of tables skipped)."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in _by_alias(current):
            continue            # a dict's key or a list's index: the table is the same kind
        annotation = _by_alias(current)[part]
        current = next((t for t in _tables_in(annotation) if isinstance(t, type) and issubclass(t, BaseModel)),
                       None)
    return current


def _by_alias(model: type[BaseModel]) -> dict[str, Any]:
    return {f.alias or name: f.annotation for name, f in model.model_fields.items()}


def _where(path: str, loc: tuple[Any, ...]) -> str:
    out = path
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":
            out += f".{part}" if out else str(part)
    return out


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    """Take the value at `loc` out of `data` (a dict's key, a list's item), so that its default stands."""
    *parents, last = [p for p in loc if p != "[key]"] or [None]
    for part in parents:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(data, dict) and last in data:
        del data[last]
    elif isinstance(data, list) and isinstance(last, int) and last < len(data):
        data[last] = _GONE


_GONE = object()


def _sweep(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _sweep(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_sweep(v) for v in data if v is not _GONE]
    return data


T = TypeVar("T", bound=BaseModel)


def read(c: Checker, model: type[T], raw: Any, path: str) -> T | None:
    """`raw` (a TOML table) validated by `model`: every problem added to `c` at its key path, in the
    house's words, unknown keys first; a refused value gives way to its default. None when `raw` is
    not a table."""
    if not isinstance(raw, dict):
        c.add(path, f"must be a table, not {typename(raw)}")
        return None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = sorted(e.errors(include_url=False), key=lambda err: err["type"] != "extra_forbidden")
    data = copy.deepcopy(raw)
    for err in errors:
        c.add(_where(path, err["loc"]), _words(err, model))
        _drop(data, err["loc"])
    try:
        return model.model_validate(_sweep(data))
    except ValidationError:         # (not expected: every refused value was taken out)
        return model()


# ------------------------------------------------------------------------- the tables

def _required(schema: dict[str, Any]) -> None:
    """A key the parser requires, said so in the JSON Schema (in Python it may be absent, so that the
    parser can say it is missing and still check the rest of the table)."""
    schema["omnid_required"] = True


class _Parsed:
    """The defaults of a parsed type's fields (config_types.py, what the daemon runs with), where a key's
    default is stated once: `_DAEMON.max_queued_jobs` is `DaemonConfig.max_queued_jobs`'s, as TOML
    writes it (a tuple as an array, a mapping as a table)."""

    def __init__(self, parsed: Any) -> None:
        self._fields = {f.name: f for f in dataclasses.fields(parsed)}

    def __getattr__(self, name: str) -> Any:
        f = self._fields[name]
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        return list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, Mapping) else value


_DAEMON, _TRACING, _OWNER, _RAY, _LORA, _STAGE, _REALTIME = map(_Parsed, (
    DaemonConfig, TracingConfig, OwnerPolicy, RayNeeds, LoraConfig, StageConfig, RealtimeConfig))


class _Table(BaseModel):
    # strict: TOML's types as they are (a `true` is no number, "5" no integer); a float key takes an integer
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _host_port_ok(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("not HOST:PORT")
    return value


def _check(ok: Callable[[Any], Any]) -> WrapValidator:
    """A check of a value already of its type (ValueError: refused), run inside `says`."""
    def wrap(value: Any, handler: Callable[[Any], Any]) -> Any:
        value = handler(value)
        try:
            ok(value)
        except ValueError:
            raise PydanticCustomError("omnid_check", "refused") from None
        return value
    return WrapValidator(wrap)


def _not_blank(value: str) -> None:
    if not value.strip():
        raise ValueError("blank")


def _what(value: Any) -> str:
    """A refused value: a string quoted, another kind by its name."""
    return repr(value) if isinstance(value, str) else typename(value)


HostPort = Annotated[str, _check(_host_port_ok), says(
    lambda v: f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:9464\"), not {v!r}")]
ListenAddress = Annotated[str, _check(_host_port_ok), says(
    lambda v: f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:8080\"), not {_what(v)}", types=True)]
Origin = Annotated[str, Field(pattern=r"^(\*|https?://[^/\s]+)$"), says(
    lambda v: f"must be an origin like \"https://chat.example.com\" (scheme and host, no path) or \"*\", "
              f"not {v!r}", types=True)]
OwnerName = Annotated[str, Field(pattern=r"^(default|[0-9]+|key:.+)$"),
                      says("must be \"default\", a uid (\"1000\") or \"key:NAME\"")]


class TracingTable(_Table):
    """`[daemon] tracing = { ... }`: OpenTelemetry traces of the jobs, exported over OTLP/HTTP (off
    when the table is absent)."""

    otlp_endpoint: Annotated[str, Field(pattern=r"^https?://[^/\s]+(/\S*)?$"), says(
        lambda v: f"must be an http(s) URL like \"http://127.0.0.1:4318\" (an OTLP/HTTP receiver: an "
                  f"OpenTelemetry Collector, Jaeger), not {v!r}")] = Field(
        default=_TRACING.otlp_endpoint, description="the OTLP/HTTP receiver's base URL; spans go to <it>/v1/traces")
    sample: Annotated[float, Field(ge=0, le=1), says(
        lambda v: f"must be between 0 and 1 (the share of traces kept), not {v}")] = Field(
        default=_TRACING.sample, description="the share of new traces kept (a caller's sampled flag is followed)")
    service_name: Annotated[str, _check(_not_blank), says("must not be empty")] = Field(
        default=_TRACING.service_name, description="`service.name` of the spans (a stage's: \"<it>:<stage>\")")


class OwnerTable(_Table):
    """`[daemon.owners.WHO]`: what one owner ("default", a uid, or "key:NAME") may ask of the queues;
    a key's entry over its uid's over "default"; a key left out is the next one's."""

    weight: float | None = Field(default=None, gt=0, description="its share within a priority level (fair share); 1")
    max_priority: Annotated[int | None, Field(ge=-1_000_000, le=1_000_000), says(
        "must be an integer from -1000000 to 1000000")] = Field(
        default=None, description="the most urgent (lowest) priority its jobs may ask; 0 (root on the socket: any)")
    max_queued: int | None = Field(
        default=None, gt=0, description="its jobs queued at once; past it: 429 with Retry-After")


class DaemonTable(_Table):
    """`[daemon]`: the daemon's sockets, directories, timeouts, logs, retention, TCP listener,
    queues' owners, traces and realtime sessions."""

    socket: str | None = Field(default=None, description="the Unix socket (unset: the default paths)")
    state_dir: str | None = Field(
        default=None, description="the job store, outputs and logs (unset: the default paths)")
    lock_dir: str | None = Field(default=None, description="the GPU lock files (unset: the default paths)")
    socket_mode: Annotated[int | str, SkipValidation] = Field(
        default="0660", description="the socket's permission bits: an octal string (\"0660\") or an integer")
    socket_group: str | None = Field(default=None, description="the socket's group")
    admin_group: str | None = Field(default=None, description="besides root, who may restart, sleep and wake stages")
    max_queued_jobs: int = Field(default=_DAEMON.max_queued_jobs, gt=0, description="per pipeline; past it the API answers 429")
    default_timeout_s: float = Field(
        default=_DAEMON.default_timeout_s, gt=0, description="a job's timeout when neither it nor its pipeline sets one")
    max_request_bytes: int = Field(default=_DAEMON.max_request_bytes, gt=0, description="a request body's limit (413 past it)")
    heartbeat_interval_s: float = Field(default=_DAEMON.heartbeat_interval_s, gt=0, description="how often a worker says it is alive")
    heartbeat_timeout_s: float = Field(
        default=_DAEMON.heartbeat_timeout_s, gt=0, description="a worker silent this long is killed and restarted")
    startup_timeout_s: float = Field(default=_DAEMON.startup_timeout_s, gt=0,
                                     description="how long a stage may take to load before it is given up")
    cancel_grace_s: float = Field(
        default=_DAEMON.cancel_grace_s, gt=0, description="a running job that ignores its cancel this long gets its worker restarted")
    stop_grace_s: float = Field(default=_DAEMON.stop_grace_s, gt=0, description="SIGTERM to SIGKILL, for a worker being stopped")
    drain_timeout_s: float = Field(
        default=_DAEMON.drain_timeout_s, ge=0, description="on SIGTERM, how long running jobs may take to finish")
    restart_backoff_s: float = Field(
        default=_DAEMON.restart_backoff_s, gt=0, description="the first wait before a crashed stage is started again, doubling")
    restart_backoff_max_s: float = Field(default=_DAEMON.restart_backoff_max_s, gt=0, description="... up to this")
    max_restarts: int = Field(
        default=_DAEMON.max_restarts, ge=0, description="more crashes than this within restart_window_s marks the stage failed")
    restart_window_s: float = Field(default=_DAEMON.restart_window_s, gt=0, description="see max_restarts")
    log_level: Annotated[LogLevel, says(f"must be one of {', '.join(get_args(LogLevel))}")] = Field(
        default=_DAEMON.log_level, description="the daemon's log level")
    log_format: Annotated[LogFormat, says(
        "must be \"console\" or \"json\", or \"auto\" (json unless stderr is a terminal)")] = Field(
        default=_DAEMON.log_format, description="auto: JSON lines unless stderr is a terminal; or console, json")
    shm_min_bytes: int = Field(
        default=_DAEMON.shm_min_bytes, gt=0, description="values from this size cross stages through shared memory")
    keep_jobs_days: float = Field(
        default=_DAEMON.keep_jobs_days, ge=0,
        description="finished jobs created longer ago are removed with their events and files (0: off)")
    keep_jobs: int = Field(
        default=_DAEMON.keep_jobs, ge=0, description="finished jobs past this many, oldest first, are removed (0: off)")
    retention_interval_s: float = Field(
        default=_DAEMON.retention_interval_s, gt=0, description="how often retention runs (and once at start)")
    client_idle_timeout_s: float = Field(
        default=_DAEMON.client_idle_timeout_s, gt=0, description="a connection that sends no request this long is closed")
    metrics_listen: HostPort | None = Field(default=None, description="\"127.0.0.1:9464\": /metrics over TCP too")
    log_file_max_bytes: int = Field(
        default=_DAEMON.log_file_max_bytes, gt=0, description="the per-stage and daemon log files rotate at this size")
    log_file_keep: int = Field(default=_DAEMON.log_file_keep, ge=0, description="... keeping this many rotated files")
    ray_address: str | None = Field(
        default=None, description="the Ray cluster of Ray-placed stages: the head's \"HOST:6379\", or \"auto\"")
    preload_workers: bool = Field(
        default=_DAEMON.preload_workers,
        description="a CPU stage's worker is forked from its engine's fork server (libraries imported already) "
                    "instead of spawned bare")
    listen: list[ListenAddress] = Field(
        default=_DAEMON.listen, description="TCP addresses ([\"127.0.0.1:8080\"]) that serve the socket's application, each "
                        "request with an API key")
    allow_origins: list[Origin] = Field(
        default=_DAEMON.allow_origins, description="CORS on the TCP listener: browser origins let in (\"*\": any)")
    metrics_without_key: bool = Field(
        default=_DAEMON.metrics_without_key, description="GET /metrics on the TCP listener answers without a key")
    min_free_mb: int = Field(
        default=_DAEMON.min_free_mb, ge=0, description="below this on the state dir's filesystem the daemon takes no new jobs")
    min_free_inodes: int = Field(default=_DAEMON.min_free_inodes, ge=0, description="... or below this many free inodes")
    ballast_mb: int = Field(
        default=_DAEMON.ballast_mb, ge=0,
        description="space set aside in <state_dir>/ballast, given back when the disk fills (0: none)")
    fair_share: bool = Field(
        default=_DAEMON.fair_share,
        description="within a priority level, stages take jobs in turn across owners, by weight; false: in arrival "
                    "order")
    max_wait_s: float = Field(
        default=_DAEMON.max_wait_s, ge=0,
        description="a job that waited this long in a stage's queue goes ahead of those that have not (0: off)")
    owners: dict[OwnerName, OwnerTable] = Field(
        default={},
        description="[daemon.owners.WHO] (\"default\", a uid, \"key:NAME\"): weight, max_priority, max_queued")
    tracing: TracingTable | None = Field(
        default=None, description="OpenTelemetry traces of the jobs, over OTLP/HTTP (off when absent)")
    max_realtime_sessions: int = Field(default=_DAEMON.max_realtime_sessions, gt=0, description="realtime sessions (/v1/realtime) open at once")
    max_realtime_sessions_per_key: int = Field(default=_DAEMON.max_realtime_sessions_per_key, gt=0, description="... per API key (per uid on the socket)")
    realtime_idle_timeout_s: float = Field(
        default=_DAEMON.realtime_idle_timeout_s, gt=0,
        description="a realtime session with no client event this long (and no response under way) is closed")
    realtime_transcription: str | None = Field(
        default=None,
        description="a pipeline that takes audio and answers in text: it transcribes a realtime session's audio "
                    "turns when the client asks")


class MediaTable(_Table):
    """`[stages.NAME.media]` (vllm stages): how many items of each kind a job may give (default: 1 for
    each kind the model's config.json shows, else 0), and the limits on each item."""

    image: int | None = Field(
        default=None, ge=0, description="images a job may give (default: 1 if the model takes them)")
    audio: int | None = Field(
        default=None, ge=0, description="audio clips a job may give (default: 1 if the model takes them)")
    video: int | None = Field(
        default=None, ge=0, description="videos a job may give (default: 1 if the model takes them)")
    max_bytes: int = Field(default=DEFAULT_MAX_BYTES, gt=0, description="the largest item, in bytes")
    max_pixels: int = Field(
        default=DEFAULT_MAX_PIXELS, gt=0, description="the largest image or video frame, in pixels")
    max_audio_s: float = Field(default=DEFAULT_MAX_AUDIO_S, gt=0, description="the longest audio clip, in seconds")
    max_video_frames: int = Field(default=DEFAULT_MAX_VIDEO_FRAMES, gt=0, description="the most frames of a video")


class LoraTable(_Table):
    """`lora = { adapters = { sql = "path" }, max_loras = 4, max_lora_rank = 16 }` (vllm and
    diffusers stages)."""

    adapters: dict[str, Annotated[str, says(
        lambda v: f"must be a string (the adapter's folder), not {typename(v)}", types=True)]] = Field(
        default=_LORA.adapters, description="the stage's adapters: name -> folder (relative: from the config file's folder)")
    max_loras: int = Field(default=_LORA.max_loras, gt=0, description="vllm: adapters in one batch (vLLM's max_loras)")
    max_lora_rank: int = Field(default=_LORA.max_lora_rank, gt=0, description="the highest rank an adapter may have (vLLM: one of "
                                                     + ", ".join(map(str, VLLM_LORA_RANKS)) + ")")


class RayTable(_Table):
    """`ray = { ... }`: what a Ray-placed stage's worker asks of the cluster."""

    num_cpus: float = Field(default=_RAY.num_cpus, ge=0, description="CPUs of the worker's actor")
    num_gpus: float = Field(default=_RAY.num_gpus, ge=0, description="GPUs of the worker's actor (instead of `devices`)")
    memory_mb: int | None = Field(default=None, gt=0, description="a scheduling hint, in MiB")
    resources: dict[str, Annotated[float, Field(gt=0), says(
        lambda v: f"must be a number > 0, not {_shown(v)}", types=True)]] = Field(
        default=_RAY.resources, description="custom resources: { node2 = 1 }")
    labels: dict[str, str] = Field(default=_RAY.labels, description="a node label selector: { zone = \"b\" }")


def _cache_schema() -> dict[str, Any]:
    """The JSON Schema of `cache`: one object per kind, with its options."""
    value = {"int": {"type": "integer", "minimum": 0}, "number": {"type": "number", "minimum": 0},
             "bool": {"type": "boolean"}, "string": {"type": "string"},
             "range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
             "numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1},
             "strings": {"type": "array", "items": {"type": "string"}}}
    kinds = []
    for kind, options in CACHE_KINDS.items():
        props: dict[str, Any] = {"kind": {"const": kind}}
        props.update({k: value[v] for k, v in options.items()})
        if "taylor_factors_dtype" in props:
            props["taylor_factors_dtype"] = {"enum": list(CACHE_DTYPES)}
        kinds.append({"type": "object", "properties": props, "required": ["kind"], "additionalProperties": False})
    return {"oneOf": kinds, "description": "a DiT cache: its kind and that kind's options"}


def _defaults_by_engine(schema: dict[str, Any]) -> None:
    """A stage's `defaults` in the JSON Schema: the parameters its engine takes, with their rules (the
    ones a job's params are checked by), for each engine that lists them."""
    schema["allOf"] = [
        {"if": {"properties": {"engine": {"const": engine}}, "required": ["engine"]},
         "then": {"properties": {"defaults": stage_params_schema(engine, {})}}}
        for engine in ENGINES if stage_accepts(engine, {}) is not None]


class StageTable(_Table):
    """`[stages.NAME]`: a stage, its engine and model (or function), its workers and devices, and
    what its engine takes besides."""

    model_config = ConfigDict(json_schema_extra=_defaults_by_engine)

    engine: Annotated[Engine | None, says(
        lambda v: f"unknown engine {v!r} (known: {', '.join(ENGINES)})")] = Field(
        default=None, description="vllm, diffusers or python", json_schema_extra=_required)
    model: str | None = Field(default=None, description="a local model directory (required for vllm and diffusers)")
    function: str | None = Field(default=None, description="python stages: `package.module:function`")
    batch_function: str | None = Field(
        default=None, description="python stages: the same, called once for several jobs")
    sessions: str | None = Field(
        default=None,
        description="python stages: `package.module:Class`, whose instance steps every live job's session together")
    produces: Annotated[list[OutputKind] | None, SkipValidation] = Field(
        default=None, description="python stages: the kinds of output it gives; else its function's own `produces`")
    python_path: list[Annotated[str, says(
        lambda v: f"must be a string (a directory), not {typename(v)}", types=True)]] = Field(
        default=[],
        description="folders put first on the worker's sys.path (relative: from the config file's folder)")
    devices: Annotated[list[int] | list[list[int]], SkipValidation] = Field(
        default=[], description="GPU indices ([]: the CPU; [[0], [1]]: one set per replica)")
    exclusive: bool = Field(
        default=_STAGE.exclusive, description="no other stage, nor another replica of it, may share its devices")
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS), says(
        lambda v: f"must be from 1 to {MAX_REPLICAS}, not {v}")] = Field(
        default=1, description="workers of this stage (devices = [[0], [1]]: one per device set)")
    idle_unload_s: float | None = Field(
        default=None, gt=0, description="no work this long: the stage sleeps until a job comes")
    max_inflight: int = Field(default=_STAGE.max_inflight, gt=0, description="jobs inside the stage at once (the engine batches them)")
    queue_capacity: int = Field(default=_STAGE.queue_capacity, gt=0, description="the stage's input queue's high watermark")
    shm_pool_mb: int = Field(
        default=_STAGE.shm_pool_mb, ge=0, description="the stage's shared-memory pool for large inputs (0: none)")
    args: dict[str, Any] = Field(
        default=_STAGE.args,
        description="engine construction arguments: EngineArgs for vLLM; from_pretrained keyword arguments and "
                    "dtype for diffusers")
    defaults: dict[str, Any] = Field(default=_STAGE.defaults, description="per-job parameters, which a job may override")
    env: dict[str, str] = Field(default=_STAGE.env, description="extra environment for the worker")
    placement: Annotated[Placement | list[Placement], SkipValidation] = Field(
        default="local",
        description="\"local\" (the default) or \"ray\": the worker runs as a Ray actor; a list gives one per "
                    "replica")
    ray: RayTable = Field(default=RayTable(), description="a Ray-placed worker's needs")
    media: MediaTable = Field(
        default=MediaTable(), description="vllm stages: the images, audio and video a job may give, and their limits")
    max_rss_mb: int | None = Field(
        default=None, gt=0,
        description="a leak guard: a worker whose resident memory is over it is restarted between jobs")
    engine_core: Annotated[EngineCore, says(
        lambda v: f"must be one of {', '.join(map(repr, ENGINE_CORES))}, not {v!r}")] = Field(
        default=_STAGE.engine_core,
        description="vllm stages: the engine core in a process of its own, or inline in the worker's thread")
    outputs: Annotated[list[str], SkipValidation, WithJsonSchema(
        {"type": "array", "items": {"enum": ["text", *TENSOR_OUTPUTS]}})] = Field(
        default=[], description="vllm stages: the tensors every job gives besides text (token_ids, hidden_states)")
    hidden_layers: Annotated[list[int], SkipValidation] = Field(
        default=_STAGE.hidden_layers,
        description="vllm stages: which hidden states (output_hidden_states indices; -1: after the final norm)")
    hidden_prompt: bool = Field(default=_STAGE.hidden_prompt, description="vllm stages: the prompt's rows of the hidden states too")
    prompt_embeds: bool = Field(
        default=_STAGE.prompt_embeds, description="vllm stages: a job may give embeddings instead of a prompt")
    batching: Annotated[Batching, says(
        lambda v: f"must be one of {', '.join(map(repr, BATCHINGS))}, not {v!r}")] = Field(
        default=_STAGE.batching,
        description="diffusers stages with max_inflight > 1: a job joins the running batch at the next denoising "
                    "step, or \"call\": one pipeline call per batch")
    cache: Annotated[dict[str, Any] | None, SkipValidation, WithJsonSchema(_cache_schema())] = Field(
        default=None,
        description="diffusers DiT stages: { kind = \"first_block\", threshold = 0.5 } and the other kinds")
    lazy: bool = Field(default=_STAGE.lazy, description="python stages: true skips the function's load hook at start")
    lora: LoraTable | None = Field(
        default=None, description="vllm and diffusers stages: LoRA adapters of the stage's model")


class EdgeTable(_Table):
    """An edge of a pipeline: `{ from, to, window, map, transform }`."""

    from_: str | None = Field(
        default=None, alias="from", description="the upstream stage", json_schema_extra=_required)
    to: str | None = Field(default=None, description="the downstream stage", json_schema_extra=_required)
    window: Annotated[int | list[int], SkipValidation] = Field(
        default=-1, description="-1: the downstream starts on the upstream's last segment; N: it streams, N "
                        "segments at a time; [4, 8, 16, 25]: a schedule (the last size repeats)",
        json_schema_extra={"anyOf": [{"type": "integer", "anyOf": [{"const": -1}, {"minimum": 1}]},
                                     {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1}]})
    map: dict[str, Annotated[str, says(
        lambda v: f"must name an upstream output (a string), not {typename(v)}", types=True)]] | None = Field(
        default=None, description="{ downstream_input = \"upstream_output\" } (unset: outputs passed by name)")
    transform: str | None = Field(default=None, description="`module:function` run on what the edge hands on")


class RealtimeTable(_Table):
    """`realtime = { ... }`: a pipeline of streams a listener plays as they come, admitted only while
    its measured capacity keeps the admitted ones on time."""

    overload: Annotated[Overload, says(
        lambda v: f"must be {' or '.join(repr(m) for m in OVERLOAD_MODES)}, not {v!r}")] = Field(
        default=_REALTIME.overload, description="past capacity: \"queue\" (wait, bounded) or \"refuse\" (503 at once)")
    max_waiting_streams: int = Field(default=_REALTIME.max_waiting_streams, ge=0, description="\"queue\": streams that may wait; past it, 503")
    margin: Annotated[float, Field(gt=0, le=1), says(
        lambda v: f"must be in (0, 1], the share of the measured capacity to fill, not {v}")] = Field(
        default=_REALTIME.margin, description="admit while the streams stay under margin x the capacity measured")
    start_slack_s: float = Field(
        default=_REALTIME.start_slack_s, ge=0,
        description="a new stream starts only once every stream that began in the last 3 s holds this much "
                    "audio at its listener, 1 s at most (its start-up burst never starves their ramp; 0: off)")
    warmup: Annotated[dict[str, Any] | bool, says(
        lambda v: f"must be a table or a boolean, not {typename(v)}", types=True)] = Field(
        default=True,
        description="the inputs of the warm-up job run before the pipeline is ready (true: { prompt = \"warm up\" "
                    "}; false: none)")
    warmup_params: dict[str, Any] = Field(default=_REALTIME.warmup_params, description="the warm-up job's params, by stage")


class PipelineTable(_Table):
    """`[pipelines.NAME]`: a pipeline's stages, its edges, its timeout and retries."""

    stages: Annotated[list[str], SkipValidation] = Field(
        default=[],
        description="the pipeline's stages; a chain unless edges says otherwise", json_schema_extra=_required)
    edges: Annotated[list[EdgeTable] | None, SkipValidation] = Field(
        default=None, description="its edges (unset: each stage feeds the next, outputs passed by name)")
    timeout_s: float | None = Field(
        default=None, gt=0, description="a job's timeout (unset: the daemon's default_timeout_s)")
    retries: int = Field(default=0, ge=0, description="how many times a job is retried when a worker dies under it")
    outputs: Annotated[dict[str, list[str]], SkipValidation] = Field(
        default={},
        description="{ STAGE = [\"name\", ...] }: outputs of a stage that is not last kept as the job's too")
    realtime: RealtimeTable | None = Field(
        default=None, description="admission by capacity, for a pipeline of streams")


StageName = Annotated[str, Field(pattern=r"^[A-Za-z_-][A-Za-z0-9_-]*$")]    # (a pipeline's name too)


class ConfigFile(_Table):
    """omnid.toml: the daemon, its stages and its pipelines."""

    daemon: DaemonTable = Field(default=DaemonTable(), description="the daemon's own settings")
    stages: dict[StageName, StageTable] = Field(
        default={}, description="the stages, by name", json_schema_extra=_required)
    pipelines: dict[StageName, PipelineTable] = Field(
        default={}, description="the pipelines, by name", json_schema_extra=_required)


# ------------------------------------------------------------------------- what is generated

def json_schema() -> dict[str, Any]:
    """The JSON Schema of omnid.toml (draft 2020-12), for editors and checkers."""
    schema = ConfigFile.model_json_schema(by_alias=True)
    for table in [schema, *schema.get("$defs", {}).values()]:
        table.pop("title", None)
        props = table.get("properties", {})
        for key, prop in props.items():
            prop.pop("title", None)
            _no_null(prop)
            if isinstance(prop.get("default"), dict) and ("$ref" in prop or "allOf" in prop):
                prop["default"] = {}        # a table left out: every key of it at its default
            if prop.pop("omnid_required", False):
                prop.pop("default", None)
                table.setdefault("required", []).append(key)
    _only_patterns(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "omnid.toml", **schema}


def _only_patterns(node: Any) -> None:
    """A table whose keys have a form (owners, stages, pipelines) takes no key of another form."""
    if isinstance(node, dict):
        if "patternProperties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _only_patterns(value)
    elif isinstance(node, list):
        for value in node:
            _only_patterns(value)


def _no_null(prop: dict[str, Any]) -> None:
    """TOML has no null: `X | None` (a key that may be absent) is X in the schema, and absent has no
    default to show."""
    options = prop.get("anyOf")
    if options is not None:
        kept = [o for o in options if o != {"type": "null"}]
        if len(kept) < len(options):
            del prop["anyOf"]
            prop.update(kept[0] if len(kept) == 1 else {"anyOf": kept})
    if prop.get("default", 0) is None:
        del prop["default"]


def schema_text() -> str:
    """json_schema() as etc/omnid.schema.json holds it."""
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


TABLES: dict[str, type[_Table]] = {
    "[daemon]": DaemonTable, "[daemon.tracing]": TracingTable, "[daemon.owners.WHO]": OwnerTable,
    "[stages.NAME]": StageTable, "[stages.NAME.media]": MediaTable, "[stages.NAME.lora]": LoraTable,
    "[stages.NAME.ray]": RayTable, "[pipelines.NAME]": PipelineTable, "[[pipelines.NAME.edges]]": EdgeTable,
    "[pipelines.NAME.realtime]": RealtimeTable,
}


def reference() -> list[tuple[str, str, str, str, str]]:
    """The configuration reference: (table, key, type, default, meaning) for every key of every table,
    the default as TOML writes it ("" when there is none to write)."""
    rows = []
    for table, model in TABLES.items():
        for name, field in model.model_fields.items():
            key = field.alias or name
            required = field.json_schema_extra is _required
            rows.append((table, key, _type_words(field.annotation), "" if required else _toml(field.default),
                         field.description or ""))
    return rows


def _type_words(annotation: Any) -> str:
    """A key's type as the reference says it: integer, number, string, boolean, table, array of X,
    or its choices ("inline" | "process")."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_words(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_words(a) for a in args if a is not type(None))
    if origin is list:
        return f"array of {_type_words(args[0])}"
    if origin is dict:
        return "table" if args[1] is Any else f"table of {_type_words(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(annotation, "any")


def _toml(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseModel):
        return "{}"
    if isinstance(value, dict) and not value:
        return "{}"
    return json.dumps(value)
