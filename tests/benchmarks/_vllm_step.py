"""What _tap_step.py and _plain_step.py share: one in-process CPU vLLM engine of omnid's, and its
decode steps timed.

Imported by those scripts only, each run as a subprocess (never by the suite). Importing this sets
the engine's environment (in-process core, CPU, offline); `omnid` is imported only when
`vllm_engine` is called, so _plain_step.py can first put another tree's on sys.path.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# tests/ last: omnidtest (standard library only) must not bring in an `omnid` before the caller's
sys.path.append(str(Path(__file__).resolve().parent.parent))
from omnidtest import TINY_LLM_ARGS  # noqa: E402


def vllm_engine(model: str, batch: int, tokens: int, **extra: Any) -> Any:
    """omnid's `VllmEngine` for a stage `bench` on `model`: `batch` at a time, `tokens` greedy tokens
    a request, never stopping early; `extra`: further StageConfig fields."""
    from omnid.config import StageConfig
    from omnid.engines.vllm_engine import VllmEngine

    return VllmEngine(StageConfig(name="bench", engine="vllm", model=Path(model), max_inflight=batch,
                                  args={"max_model_len": 512, **TINY_LLM_ARGS},
                                  defaults={"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
                                  **extra))


def timed_batch(engine: Any, jobs: list[str], what: str = "", **request: Any) -> tuple[list[Any], float]:
    """One request a job name (prompt "a lighthouse I"; `request`: RequestContext's other fields),
    run to its end: the requests, and the CPU ms per decode step (the steps after the prefill; the
    CPU time of this process, where the engine runs: other processes on a shared machine slow the
    wall clock of a step far more than its CPU time). Exits unless every request finished."""
    from omnid.engines.base import RequestContext

    ctxs = [RequestContext(job=job, stage="bench", inputs={"prompt": f"a lighthouse {i}"}, params={}, **request)
            for i, job in enumerate(jobs)]
    for ctx in ctxs:
        engine.add(ctx)
    engine.step()                               # the prefill
    steps, t0 = 0, time.process_time()
    while engine.has_work():
        engine.step()
        steps += 1
    cpu = time.process_time() - t0
    if not all(ctx.outcome == "finished" for ctx in ctxs):
        raise SystemExit(f"{what}{[ctx.error for ctx in ctxs]}")
    return ctxs, 1000 * cpu / max(1, steps)
