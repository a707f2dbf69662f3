"""The daemon's TOML configuration: parsing and validation (the types it parses into: config_types.py).

Runs in the supervisor (and in `omnid --check`) before anything starts; the
parsed, frozen `Config` is also handed to every stage worker at spawn, so it
must stay picklable and free of heavy imports. Nothing here blocks except
reading the file.

Validation collects *every* problem with its key path (`stages.draw.model`)
instead of stopping at the first, so one `omnid --check` run shows them all.

Here: `load` and `parse`, and the checks across tables (devices shared between stages, Ray-placed
stages and the daemon's ray_address, the tensors the pipelines ask of a stage). The file's shape is
defined once, in schema.py: a pydantic model per table, which every table is read through, and from
which `json_schema()` (`omnid config-schema`) and `reference()` (the configuration reference) are
generated. Each table has its room: checker.py (Problem, ConfigError, the checker), daemon.py,
stages.py, pipelines.py; their names are handed on from here, as are the parsed config's types.
"""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from omnid.config.checker import Checker, ConfigError, Problem
from omnid.config.daemon import check_listen_keys, is_loopback, parse_daemon
from omnid.config.pipelines import STREAM_ENGINES, parse_pipeline
from omnid.config.schema import ConfigFile, json_schema, reference
from omnid.config.stages import (
    CACHE_DTYPES,
    CACHE_KINDS,
    ENGINE_CORES,
    ENGINES,
    LORA_KEYS,
    MAX_REPLICAS,
    PLACEMENTS,
    VLLM_LORA_ARGS,
    VLLM_LORA_RANKS,
    model_dims,
    name_of,
    parse_stage,
)
from omnid.config.stages import STAGE_KEYS as STAGE_KEYS  # (the docs' config reference is checked against it)

# The parsed config's types (standard library only, so that the engines and the protocol can name
# them from below); named here too, where most readers look for them.
from omnid.config_types import (
    FULL_WINDOW,
    Config,
    DaemonConfig,
    EdgeConfig,
    LoraConfig,
    OwnerPolicy,
    PipelineConfig,
    RayNeeds,
    StageConfig,
    TracingConfig,
)
from omnid.engines.capabilities import TENSOR_OUTPUTS, TENSOR_PROMPTS, capabilities  # (declared with the engines)

__all__ = [
    "load", "parse", "json_schema", "reference", "ConfigError", "Problem", "is_loopback", "ray_available",
    "model_dims", "name_of",
    "ENGINES", "STREAM_ENGINES", "PLACEMENTS", "MAX_REPLICAS", "CACHE_KINDS", "CACHE_DTYPES", "ENGINE_CORES",
    "LORA_KEYS", "STAGE_KEYS", "VLLM_LORA_ARGS", "VLLM_LORA_RANKS", "TENSOR_OUTPUTS", "TENSOR_PROMPTS",
    "FULL_WINDOW", "Config", "DaemonConfig", "EdgeConfig", "LoraConfig", "OwnerPolicy", "PipelineConfig",
    "RayNeeds", "StageConfig", "TracingConfig",
]


def _check_devices(c: Checker, stages: Mapping[str, StageConfig]) -> None:
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


# (here, beside its one reader: a test stands in for it as `omnid.config.ray_available`)
def ray_available() -> bool:
    """Whether the `ray` extra is installed (`pip install omnid[ray]`), without importing it."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def _check_ray(c: Checker, daemon: DaemonConfig, stages: Mapping[str, StageConfig]) -> None:
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
    c = Checker()
    c.unknown(data, ConfigFile.model_fields, "")
    daemon = parse_daemon(c, data.get("daemon", {}), base)
    stages_raw = c.table(data.get("stages", {}), "stages")
    stages: dict[str, StageConfig] = {}
    for name, raw in stages_raw.items():
        if not name.replace("-", "_").isidentifier():
            c.add(f"stages.{name}", "a stage name is letters, digits, '_' and '-'")
            continue
        st = parse_stage(c, name, raw, base)
        if st is not None:
            stages[name] = st
    if not stages_raw:
        c.add("stages", "no stages are defined")
    _check_devices(c, stages)
    _check_ray(c, daemon, stages)
    check_listen_keys(c, daemon)
    pipes_raw = c.table(data.get("pipelines", {}), "pipelines")
    pipelines: dict[str, PipelineConfig] = {}
    for name, raw in pipes_raw.items():
        if not name.replace("-", "_").isidentifier():
            c.add(f"pipelines.{name}", "a pipeline name is letters, digits, '_' and '-'")
            continue
        pl = parse_pipeline(c, name, raw, stages_raw, stages)
        if pl is not None:
            pipelines[name] = pl
    if not pipes_raw:
        c.add("pipelines", "no pipelines are defined")
    _check_transcription(c, daemon, stages, pipelines)
    stages = _derive_tensors(c, stages, pipelines)
    if c.problems:
        raise ConfigError(source, c.problems)
    return Config(source=None, daemon=daemon, stages=stages, pipelines=pipelines)


def _check_transcription(c: Checker, daemon: DaemonConfig, stages: Mapping[str, StageConfig],
                         pipelines: Mapping[str, PipelineConfig]) -> None:
    """`daemon.realtime_transcription` names a pipeline whose first stage takes audio."""
    name = daemon.realtime_transcription
    if name is None:
        return
    p = pipelines.get(name)
    if p is None:
        c.add("daemon.realtime_transcription", f"no pipeline {name!r}")
    elif not any(s in stages and stages[s].media.count("audio") for s in p.sources):
        c.add("daemon.realtime_transcription", f"pipeline {name!r} takes no audio (its first stage's media)")


def _derive_tensors(c: Checker, stages: dict[str, StageConfig],
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
