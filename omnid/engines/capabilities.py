"""What each engine can do, declared without loading it: the one registry of engines.

Standard library only (and `omnid.params`' tables, which know no engine): the supervisor, the API, the OpenAPI document and
`omnid --check` ask these declarations instead of comparing engine names, and none of them imports
an engine module (those run in stage workers). Each engine class points to its declaration
(`Engine.capabilities`); `load_engine` finds the class from `engine_class`.

A new engine: its module (the `Engine` subclass), and one `Capabilities` here, in `CAPABILITIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnid.params import (
    ANY_PARAMS,
    DIFFUSERS_PARAMS,
    DIFFUSERS_RULES,
    OBJECT_PARAMS,
    PLAIN_VALUE_SCHEMA,
    VLLM_PARAMS,
    VLLM_RULES,
    Rule,
    plain_value,
    token_bounds_problem,
)

_TEXT_OUTPUT: dict[str, Any] = {"name": "text", "kind": "text", "file": "text.txt",
                                "content_type": "text/plain; charset=utf-8"}


@dataclass(frozen=True)
class Capabilities:
    """One engine's declaration. The flags say what a stage of this engine can do; the
    supervisor's checks, the API's admission and the self-description read them."""

    name: str                               # the config's `engine = "..."`
    engine_class: str                       # "module:Class", imported only inside a stage worker
    # -- its stage's config
    model_marker: str | None = None         # the file its `model` directory must hold; None: no model needed
    takes_function: bool = False            # a `function` / `batch_function` (and an optional `model`)
    parallel: bool = False                  # splits its model over its devices by `args` (tensor/pipeline parallel)
    max_batch: int | None = None            # the most jobs one call batches (bounds `max_inflight`); None: no bound
    # -- its inputs
    streamed_input: bool = False            # may be fed by a streaming edge (window = N > 0)
    whole_input: str = ""                   # why it may not (said by `--check`)
    text_prompt: bool = False               # as a first stage, needs a text input "prompt" (else 400)
    chat: bool = False                      # a chat (`messages`, JSON text) stands in for the prompt
    context_window: bool = False            # its text prompt must fit the model's max_model_len (measured
                                            # at the door with the model's tokenizer)
    media: bool = False                     # takes media inputs (image, audio, video) within its `media` limits
    tensors: bool = False                   # gives tensors (token ids, hidden states) and takes them as a prompt
    # -- its outputs
    answer: str | None = None               # the kind of answer a last stage gives ("text", "image"); None:
                                            # whatever its function returns
    outputs: tuple[dict[str, Any], ...] | None = None   # the outputs it produces; None: not known beforehand
    gives: tuple[str, ...] | None = None    # the names an edge may map out of it; None: any
    # -- its params
    params: frozenset[str] | None = None    # the per-job parameters it takes (`omnid.params`); None: any
    rules: Mapping[str, Rule] = field(default_factory=dict)    # their value rules, checked at the door
    values_rule: Callable[[str, Mapping[str, Any]], str | None] | None = None    # a rule between them
    sampling: bool = False                  # takes the OpenAI sampling fields (and counts tokens)
    image_size: bool = False                # takes `width` and `height` (the images endpoint's `size`)
    lora: bool = False                      # serves LoRA adapters of its model (a `lora` table; `adapter`)
    # -- its worker
    engine_core: bool = False               # has an engine core to place (`engine_core = "process" | "inline"`)
    step_batching: bool = False             # batches per denoising step or per call (`batching = "step" | "call"`)
    short_steps: bool = False               # a step is one bounded engine step (a decode step of a few ms):
                                            # its worker may keep a busy channel's segments for the next one
    worker_env: tuple[tuple[str, str], ...] = ()    # environment defaults its worker sets before loading it
    preload: tuple[str, ...] = ()           # the heavy modules its load imports, which a CPU worker finds
                                            # imported already (its fork server's, omnid.worker.preload)

    def may_answer(self, kind: str) -> bool:
        """A last stage of this engine may give an answer of `kind` (declared, or not known)."""
        return self.answer is None or self.answer == kind


# What a vllm stage gives besides `text`, computed only when an edge maps them or `outputs` names them.
# `prompt_token_ids`: the prompt as the engine tokenized it (a talker embeds it), in the first segment.
TENSOR_OUTPUTS = ("token_ids", "hidden_states", "prompt_token_ids")
# A vllm stage's prompt as tensors: each stands in for a text "prompt".
TENSOR_PROMPTS = ("prompt_token_ids", "prompt_embeds")

VLLM = Capabilities(
    name="vllm", engine_class="omnid.engines.vllm_engine:VllmEngine", model_marker="config.json", parallel=True,
    whole_input="it needs its whole prompt before it can start generating",
    text_prompt=True, chat=True, context_window=True, media=True, tensors=True, answer="text",
    outputs=({**_TEXT_OUTPUT, "description": "the generated text (streamed as text segments)"},),
    gives=("text", *TENSOR_OUTPUTS), params=VLLM_PARAMS, rules=VLLM_RULES, values_rule=token_bounds_problem,
    sampling=True, engine_core=True, short_steps=True, lora=True,
    # the engine core stays in the worker unless `engine_core = "process"` (the engine sets that itself)
    worker_env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_LOGGING_LEVEL", "WARNING")),
    preload=("torch", "transformers", "vllm.engine.arg_utils", "vllm.v1.engine.llm_engine", "vllm.sampling_params"),
)
# A torch stage's OpenMP threads sleep when they wait, rather than spin (libgomp's default spins first).
# Its cores are shared (the supervisor, the other stages' workers, each with its own team of threads):
# a team whose threads spin waits, at every parallel region, for one the kernel has put aside. Measured on
# 2 shared cores, the tiny SD's 16-step call in a worker's long-lived thread: 5-23 s spinning against
# 0.8-0.9 s sleeping (0.7 s on one thread). A stage's own `env` may set OMP_WAIT_POLICY = "ACTIVE".
TORCH_CPU_ENV = ("OMP_WAIT_POLICY", "PASSIVE")
DIFFUSERS = Capabilities(
    name="diffusers", engine_class="omnid.engines.diffusers_engine:DiffusersEngine",
    model_marker="model_index.json", max_batch=64,
    whole_input="it needs its whole prompt (a diffusion model conditions every step on all of it)",
    text_prompt=True, answer="image",
    outputs=({"name": "image", "kind": "image", "file": "image.png", "content_type": "image/png",
              "description": "the image (image-K.png, one per image, when num_images_per_prompt > 1)"},
             {**_TEXT_OUTPUT, "name": "prompt", "file": "prompt.txt", "description": "the prompt it drew"}),
    params=DIFFUSERS_PARAMS, rules=DIFFUSERS_RULES, image_size=True, lora=True, step_batching=True,
    preload=("torch", "transformers", "diffusers.pipelines.pipeline_utils"),
    worker_env=(TORCH_CPU_ENV,),
)
PYTHON = Capabilities(
    name="python", engine_class="omnid.engines.python_engine:PythonEngine", takes_function=True,
    streamed_input=True, worker_env=(TORCH_CPU_ENV,),
)

# The registry, in the order `--check` lists the engines.
CAPABILITIES: dict[str, Capabilities] = {c.name: c for c in (VLLM, DIFFUSERS, PYTHON)}


def capabilities(engine: str) -> Capabilities:
    """The declaration of `engine` (a name the config accepted)."""
    return CAPABILITIES[engine]


def engines_that(can: Callable[[Capabilities], bool]) -> tuple[str, ...]:
    """The names of the engines whose declaration passes `can`, in the registry's order."""
    return tuple(name for name, caps in CAPABILITIES.items() if can(caps))


# ------------------------------------------------------------------ a stage's params, by its engine
# The per-engine lookups over `omnid.params`' tables: what a job may set, whether a value is valid, and
# how `GET /v1/pipelines/{name}` and the OpenAPI document describe it.

def _caps(engine: str) -> Capabilities | None:
    """The engine's declaration; None for a name no engine has (the config parser says so)."""
    return CAPABILITIES.get(engine)


def check_param(engine: str, key: str, value: Any) -> str | None:
    """Why `value` is not valid for a known parameter of `engine`, or None."""
    caps = _caps(engine)
    rule = caps.rules.get(key) if caps is not None else None
    return rule(value) if rule is not None else None


def stage_accepts(engine: str, defaults: Mapping[str, Any]) -> frozenset[str] | None:
    """Parameter names a job may set on a stage of `engine` with these `defaults`; None means any."""
    caps = _caps(engine)
    if caps is None:
        raise KeyError(engine)
    known = caps.params
    return None if known is None else frozenset(known) | frozenset(defaults)


def job_param_problem(stage: str, engine: str, defaults: Mapping[str, Any], key: str, value: Any) -> str | None:
    """Why a job may not set `key = value` on `stage` (a sentence for a 400), or None."""
    accepted = stage_accepts(engine, defaults)
    if accepted is not None and key not in accepted:
        return f"stage {stage!r} has no parameter {key!r}; known: {', '.join(sorted(accepted))}"
    if not plain_value(value) and key not in OBJECT_PARAMS:
        return f"params.{stage}.{key} must be a string, number, boolean, or a list of those"
    why = check_param(engine, key, value)
    if why is not None:
        return f"params.{stage}.{key} {why}, not {value!r}"
    return None


def values_problem(stage: str, engine: str, values: Mapping[str, Any]) -> str | None:
    """Why the values a job would run with (its stage's defaults and its params, merged) do not
    go together, or None: the rules between parameters the engine declares (vLLM: `min_tokens` <=
    `max_tokens`)."""
    caps = _caps(engine)
    between = caps.values_rule if caps is not None else None
    return between(stage, values) if between is not None else None


def param_schema(engine: str, key: str) -> dict[str, Any]:
    """JSON Schema of one parameter's value: its rule's, else (a name only a stage's defaults
    add, or any name on a python stage) any plain value."""
    caps = _caps(engine)
    rule = caps.rules.get(key) if caps is not None else None
    return dict(rule.schema) if rule is not None else dict(PLAIN_VALUE_SCHEMA)


def describe_stage_params(engine: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """What a job may set on a stage of `engine` with these `defaults`, readably:
    `{"accepts": "listed" | ANY_PARAMS, "params": {name: schema + "default"?}}`."""
    accepted = stage_accepts(engine, defaults)
    names = sorted(defaults) if accepted is None else sorted(accepted)
    params: dict[str, Any] = {}
    for name in names:
        doc = param_schema(engine, name) if accepted is not None else {}
        if name in defaults:
            doc["default"] = defaults[name]
        params[name] = doc
    return {"accepts": "listed" if accepted is not None else ANY_PARAMS, "params": params}


def stage_params_schema(engine: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """JSON Schema of a job's `params.STAGE` object, as `job_param_problem` checks it."""
    described = describe_stage_params(engine, defaults)
    if described["accepts"] != "listed":
        return {"type": "object", "additionalProperties": PLAIN_VALUE_SCHEMA, "description": ANY_PARAMS,
                "properties": {name: {**PLAIN_VALUE_SCHEMA, **doc} for name, doc in described["params"].items()}}
    return {"type": "object", "additionalProperties": False, "properties": described["params"]}
