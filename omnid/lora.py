"""LoRA adapters of a stage: what a folder holds, read without torch (standard library only, and typing_extensions' TypedDict).

A stage's `lora = { adapters = { sql = "path" }, max_loras = 4, max_lora_rank = 16 }` names its
adapters (`config_types.LoraConfig`). `omnid --check`, the run-time `POST /v1/stages/{name}/adapters`
and the engines ask this module what an adapter folder is:

- a PEFT adapter (`adapter_config.json` and `adapter_model.safetensors`): what vLLM serves, and what
  diffusers loads too;
- a diffusers LoRA (`pytorch_lora_weights.safetensors`, as `save_lora_weights` writes it).

Its rank is read from the weights' shapes (a safetensors file starts with a JSON header: names,
dtypes, shapes), and it matches its base model when every module it adapts is a weight of the base
model with the shape the adapter's two matrices make (`[out, r] @ [r, in]`), read the same way from
the model's own safetensors files. Nothing here imports torch or blocks for long (headers only).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typing_extensions import TypedDict

from omnid.config_types import Config, PipelineConfig, StageConfig

PEFT_CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors")
MAX_HEADER = 100 << 20          # a safetensors header larger than this is not one

# An adapter's name: it becomes a model id `stage:name` and a parameter value.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class AdapterError(ValueError):
    """What is wrong with an adapter folder (a sentence)."""


@dataclass(frozen=True)
class AdapterInfo:
    path: Path
    weights: Path
    rank: int
    modules: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]   # module -> (A's shape, B's shape)
    base: str | None = None         # its adapter_config.json's base_model_name_or_path


def header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: {tensor name: {"dtype", "shape", "data_offsets"}} (and "__metadata__")."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER:
            raise AdapterError(f"{path} is not a safetensors file (header size {size})")
        try:
            data = json.loads(f.read(size))
        except ValueError:
            raise AdapterError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path} is not a safetensors file")
    return data


_LORA_KEY = re.compile(r"^(?P<module>.+?)\.(?:lora_A|lora_B|lora\.down|lora\.up|lora_down|lora_up)"
                       r"(?:\.[A-Za-z0-9_]+)?\.weight$")


def _module_parts(key: str) -> tuple[str, str] | None:
    m = _LORA_KEY.match(key)
    if m is None:
        return None
    which = "A" if any(s in key for s in (".lora_A", ".lora.down", ".lora_down")) else "B"
    return m.group("module"), which


def inspect(path: Path) -> AdapterInfo:
    """What the adapter folder (or file) `path` holds; AdapterError when it holds no LoRA adapter."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        weights = path
    elif path.is_dir():
        found = [path / n for n in WEIGHT_FILES if (path / n).is_file()]
        if not found:
            raise AdapterError(f"{str(path)!r} holds no LoRA adapter (no {' or '.join(WEIGHT_FILES)})")
        weights = found[0]
    else:
        raise AdapterError(f"{str(path)!r} does not exist" if not path.exists() else
                           f"{str(path)!r} is not an adapter folder nor a .safetensors file")
    base = None
    config_file = (path if path.is_dir() else path.parent) / PEFT_CONFIG
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise AdapterError(f"{config_file} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise AdapterError(f"{config_file} is not a JSON object")
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{str(path)!r} is a {config.get('peft_type')} adapter, not a LoRA")
        b = config.get("base_model_name_or_path")
        base = b if isinstance(b, str) and b else None
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, value in header(weights).items():
        parts = _module_parts(key) if isinstance(value, dict) else None
        if parts is None:
            continue
        shape = tuple(int(x) for x in value.get("shape", ()))
        modules.setdefault(parts[0], {})[parts[1]] = shape
    pairs = {m: (s["A"], s["B"]) for m, s in modules.items() if "A" in s and "B" in s}
    if not pairs:
        raise AdapterError(f"{str(weights)!r} holds no LoRA weights (no lora_A/lora_B pairs)")
    rank = max(a[0] for a, _ in pairs.values() if a)
    return AdapterInfo(path=path, weights=weights, rank=rank, modules=pairs, base=base)


def _model_weights(model: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """{component ("" for a plain model): {weight name: shape}} of a model folder's safetensors files
    (a diffusers pipeline's components are its subfolders)."""
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for file in sorted(model.glob("*.safetensors")) + sorted(model.glob("*/*.safetensors")):
        component = "" if file.parent == model else file.parent.name
        try:
            h = header(file)
        except (AdapterError, OSError):
            continue
        shapes = out.setdefault(component, {})
        for name, value in h.items():
            if isinstance(value, dict) and "shape" in value:
                shapes[name] = tuple(int(x) for x in value["shape"])
    return out


def _find_weight(module: str, weights: dict[str, dict[str, tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The base weight's shape of an adapted `module` (PEFT's `base_model.model.` prefix, a diffusers
    component prefix such as `unet.`, dropped as needed)."""
    name = module
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    component, _, rest = name.partition(".")
    candidates = [("", name), (component, rest)]
    for comp, key in candidates:
        shapes = weights.get(comp)
        if shapes is None:
            continue
        for k in (f"{key}.weight", f"{key}.base_layer.weight"):
            if k in shapes:
                return shapes[k]
    return None


def base_problem(info: AdapterInfo, model: Path) -> str | None:
    """Why the adapter does not fit the base model in `model` (or None): a module it adapts that the
    model does not have, or whose weight's shape is not the adapter's `[out, in]`."""
    weights = _model_weights(Path(model))
    if not weights:
        return None         # nothing to compare with (weights in another format): vLLM or diffusers will say
    for module, (a, b) in sorted(info.modules.items()):
        shape = _find_weight(module, weights)
        if shape is None:
            return f"it adapts {module!r}, which the model in {str(model)!r} does not have: another base model?"
        if len(a) < 2 or len(b) < 2:
            continue
        want = (b[0], a[1])
        if tuple(shape[:2]) != want:
            return (f"its {module!r} is for a weight of shape {list(want)}, but the model in {str(model)!r} "
                    f"has {list(shape[:2])}: another base model")
    return None


def check(path: Path, model: Path | None, max_rank: int) -> AdapterInfo:
    """The adapter at `path`, checked for a stage: it holds one, its rank is within `max_rank`, and it
    fits the stage's `model`; AdapterError says what is wrong."""
    info = inspect(path)
    if info.rank > max_rank:
        raise AdapterError(f"its rank is {info.rank}, above the stage's max_lora_rank ({max_rank})")
    if model is not None:
        why = base_problem(info, model)
        if why is not None:
            raise AdapterError(why)
    return info


def name_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not NAME.match(name):
        return (f"an adapter's name is 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit), "
                f"not {name!r}")
    return None


def job_adapters(params: Any) -> dict[str, float]:
    """The adapters a job's merged params ask for, with their weights: `adapter` (one, weight 1) and
    `adapters` ({name: weight}); {}: the base model."""
    out: dict[str, float] = {}
    one = params.get("adapter") if hasattr(params, "get") else None
    if isinstance(one, str) and one:
        out[one] = 1.0
    many = params.get("adapters") if hasattr(params, "get") else None
    if isinstance(many, dict):
        for name, weight in many.items():
            out[str(name)] = float(weight)
    return out


def adapter_problem(stage: str, engine: str, adapters: Any, key: str, value: Any) -> str | None:
    """Why `params.STAGE.KEY = value` names an adapter the stage does not have (a sentence naming the
    parameter), or None. `adapters`: the stage's adapters in force, by name."""
    names = [value] if key == "adapter" else (list(value) if isinstance(value, dict) else [])
    for name in names:
        if not isinstance(name, str) or name not in adapters:
            known = ", ".join(sorted(adapters)) or "none"
            return f"params.{stage}.{key}: stage {stage!r} has no adapter {name!r} (its adapters: {known})"
    return None


class AdapterRef(TypedDict):
    name: str
    path: str


class LoraView(TypedDict):
    """a stage's LoRA: its base model and its adapters in force"""

    base: str | None
    adapters: list[AdapterRef]
    max_loras: int
    max_lora_rank: int


def describe(stage: StageConfig) -> LoraView | None:
    """A stage's LoRA as the API shows it (`GET /v1/stages`, `/v1/pipelines`, `omnictl pipelines`):
    its base model and its adapters in force; None without a `lora` table."""
    if stage.lora is None:
        return None
    return {"base": str(stage.model) if stage.model is not None else None,
            "adapters": [{"name": n, "path": str(p)} for n, p in sorted(stage.adapters.items())],
            "max_loras": stage.lora.max_loras, "max_lora_rank": stage.lora.max_lora_rank}


def adapter_stage(config: Config, p: PipelineConfig) -> str | None:
    """The stage whose adapters a pipeline's OpenAI models name (`PIPELINE:ADAPTER`): its last stage
    with a `lora` table."""
    return next((s for s in reversed(p.stages) if config.stages[s].lora is not None), None)


def pipeline_adapters(config: Config, p: PipelineConfig) -> list[str]:
    """The adapters of a pipeline's adapter stage, sorted (none without one)."""
    stage = adapter_stage(config, p)
    return sorted(config.stages[stage].adapters) if stage is not None else []
