"""Per-job engine parameters, as plain tables: which names each engine takes, and the rules for
their values.

The one place these rules live. Each engine's declaration (`omnid.engines.capabilities`) names its
tables, and the per-engine lookups over them (`check_param`, `job_param_problem`, ...) are there:
this module knows no engine. `omnid --check` uses them on a stage's `defaults`, the socket API on a
job's `params` (a 400 at the door rather than a failed job), and the engines on the merged values
they run with. Standard library only: imported by the supervisor, `--check` and the stage workers;
nothing here blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

# Per-job parameters a caller may set, by engine. Checked at the door so a typo
# is a 400 with the list of known names rather than a failed job. `python`
# stages accept anything: the user's function defines its own parameters.
VLLM_PARAMS = frozenset({
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "ignore_eos", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "include_prompt", "prompt_template", "adapter",
})
# vLLM parameters that are omnid's own: consumed by the engine, never passed to SamplingParams.
VLLM_OMNID_PARAMS = ("include_prompt", "prompt_template", "adapter")
DIFFUSERS_PARAMS = frozenset({
    "num_inference_steps", "guidance_scale", "height", "width", "seed",
    "negative_prompt", "eta", "guidance_rescale", "num_images_per_prompt", "adapter", "adapters",
})
# Parameters whose value is an object (checked by their rule, not as a plain value).
OBJECT_PARAMS = frozenset({"adapters"})

_SEED_MAX = 2**63


class Rule:
    """A value rule that also describes itself: called with a value, it says why the value is not
    valid (or None); `schema` is the same rule as JSON Schema (for `GET /v1/pipelines/{name}` and
    the OpenAPI document), built from the very arguments the check uses."""

    def __init__(self, check: Callable[[Any], str | None], schema: Mapping[str, Any]) -> None:
        self.check = check
        self.schema = schema

    def __call__(self, value: Any) -> str | None:
        return self.check(value)

    def __repr__(self) -> str:
        return f"Rule({self.schema!r})"


def _integer(lo: int | None = None, hi: int | None = None, multiple: int = 1) -> Rule:
    schema: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    if multiple != 1:
        schema["multipleOf"] = multiple

    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return "must be an integer"
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            return f"must be from {lo} to {hi}" if hi is not None else f"must be >= {lo}"
        if v % multiple:
            return f"must be a multiple of {multiple}"
        return None
    return Rule(check, schema)


def _number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Rule:
    schema: dict[str, Any] = {"type": "number"}
    if lo is not None:
        schema["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi

    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return "must be a finite number"
        if lo is not None and (v < lo or (lo_open and v == lo)):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and v > hi:
            return f"must be <= {hi}"
        return None
    return Rule(check, schema)


_JSON_TYPES: dict[type, str] = {bool: "boolean", str: "string", int: "integer", float: "number"}


def _of_type(kind: type, name: str) -> Rule:
    return Rule(lambda v: None if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else f"must be {name}",
                {"type": _JSON_TYPES[kind]})


def _check_stop(v: Any) -> str | None:
    ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    if not ok:
        return "must be a string or a list of strings"
    if v == "" or (isinstance(v, list) and "" in v):
        return "must not be or hold an empty string"       # (vLLM refuses it)
    return None


_stop = Rule(_check_stop, {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": {"type": "string", "minLength": 1}}]})


def _check_adapters(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "must be an object of adapter names and weights: {\"style\": 0.8}"
    for name, weight in v.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not -10 <= weight <= 10:
            return f"must give each adapter a weight from -10 to 10 ({name!r}: {weight!r})"
    return None


# An adapter by name (the stage's `lora.adapters`; whether the stage has it is checked by `omnid.lora`).
_adapter = Rule(lambda v: None if isinstance(v, str) and v else "must be an adapter's name",
                {"type": "string", "minLength": 1, "description": "one of the stage's LoRA adapters (its lora table)"})
_adapters = Rule(_check_adapters, {"type": "object", "additionalProperties": {"type": "number", "minimum": -10,
                                                                              "maximum": 10},
                                   "description": "the stage's LoRA adapters to apply, by name, with their weights"})

# Value rules for the known parameters, checked at the door (400) rather than in the engine; each
# engine's declaration (`omnid.engines.capabilities`) names its table.
VLLM_RULES: dict[str, Rule] = {
    "max_tokens": _integer(1), "min_tokens": _integer(0), "temperature": _number(0, 2),
    "top_p": _number(0, 1, lo_open=True), "top_k": _integer(-1), "min_p": _number(0, 1),
    "seed": _integer(0, _SEED_MAX - 1), "stop": _stop, "ignore_eos": _of_type(bool, "true or false"),
    "repetition_penalty": _number(0, lo_open=True), "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2), "include_prompt": _of_type(bool, "true or false"),
    "prompt_template": _of_type(str, "a string"), "adapter": _adapter,
}
DIFFUSERS_RULES: dict[str, Rule] = {
    "num_inference_steps": _integer(1, 1000), "guidance_scale": _number(0),
    "height": _integer(8, 4096, multiple=8), "width": _integer(8, 4096, multiple=8),
    "seed": _integer(0, _SEED_MAX - 1), "negative_prompt": _of_type(str, "a string"),
    "eta": _number(0, 1), "guidance_rescale": _number(0), "num_images_per_prompt": _integer(1, 16),
    "adapter": _adapter, "adapters": _adapters,
}


def token_bounds_problem(stage: str, values: Mapping[str, Any]) -> str | None:
    """vLLM's rule between parameters: `min_tokens` <= `max_tokens`."""
    lo, hi = values.get("min_tokens"), values.get("max_tokens")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        return f"params.{stage}.min_tokens ({lo}) must not be more than max_tokens ({hi})"
    return None


def plain_value(value: Any) -> bool:
    """A JSON scalar (finite numbers only) or a flat list of non-null scalars."""
    if isinstance(value, (str, bool, int)) or value is None:
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(plain_value(v) and not isinstance(v, list) and v is not None for v in value)
    return False


def merged(defaults: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The values a job runs with: the stage's defaults, overridden by the job's params."""
    out = dict(defaults)
    out.update(params)
    return out


# ------------------------------------------------------------------ self-description
# What `GET /v1/pipelines/{name}` and `GET /v1/openapi.json` say a stage accepts is derived from the
# rules above (`omnid.engines.capabilities.describe_stage_params`), so the description and the check
# cannot disagree.

# `plain_value` as JSON Schema: what any parameter (and a python stage's) may hold.
_SCALAR_SCHEMA: dict[str, Any] = {"type": ["string", "number", "integer", "boolean"]}
PLAIN_VALUE_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": ["string", "number", "integer", "boolean", "null"]},
              {"type": "array", "items": _SCALAR_SCHEMA}],
}
ANY_PARAMS = "any (the function reads what it wants)"


def parallel_size(args: Mapping[str, Any]) -> int:
    """How many processes (GPUs) the stage's vLLM args ask for: tensor x pipeline parallel size."""
    size = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = args.get(key)     # (absent, or not a positive integer: 1, which the checker reports)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:  # pragma: no mutate (equivalent: `> 1` skips only a factor of 1)
            size *= value
    return size
