"""Engines: vllm, diffusers, python. Heavy imports happen only in `load_engine`,
inside a stage worker process, never in the supervisor or omnictl."""

from __future__ import annotations

from omnid.config import StageConfig
from omnid.engines.base import Cancelled, Engine, RequestContext

__all__ = ["Cancelled", "Engine", "RequestContext", "load_engine"]


def load_engine(stage: StageConfig) -> Engine:
    """Build the stage's engine (loads the model; may take minutes on a real checkpoint)."""
    if stage.engine == "vllm":
        from omnid.engines.vllm_engine import VllmEngine
        return VllmEngine(stage)
    if stage.engine == "diffusers":
        from omnid.engines.diffusers_engine import DiffusersEngine
        return DiffusersEngine(stage)
    if stage.engine == "python":
        from omnid.engines.python_engine import PythonEngine
        return PythonEngine(stage)
    raise ValueError(f"unknown engine {stage.engine!r}")
