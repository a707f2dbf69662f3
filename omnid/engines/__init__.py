"""Engines: vllm, diffusers, python. Heavy imports happen only in `load_engine`,
inside a stage worker process, never in the supervisor or omnictl. What each engine can do is
declared in `capabilities.py`, which imports none of them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omnid.engines.base import Cancelled, Engine, RequestContext
from omnid.engines.capabilities import CAPABILITIES

if TYPE_CHECKING:
    from omnid.config_types import StageConfig

__all__ = ["Cancelled", "Engine", "RequestContext", "load_engine"]


def load_engine(stage: StageConfig) -> Engine:
    """Build the stage's engine (loads the model; may take minutes on a real checkpoint)."""
    caps = CAPABILITIES.get(stage.engine)
    if caps is None:
        raise ValueError(f"unknown engine {stage.engine!r}")
    module, _, name = caps.engine_class.partition(":")
    engine_class = getattr(importlib.import_module(module), name)
    engine: Engine = engine_class(stage)
    return engine
