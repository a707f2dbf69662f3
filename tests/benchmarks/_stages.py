"""Python stage functions for the benchmarks (imported inside stage workers, never by pytest).

A stage's config names them as `_stages:NAME` with `python_path = [tests/benchmarks]`.
Heavy imports (torch) happen inside the functions that need them, so the no-op stages stay light.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any


def noop(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Does nothing; hands on a tiny output (so a 3-stage chain carries something)."""
    return {"text": "x"}


def sleep(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Works `seconds` (time.sleep in 10 ms slices, checking for a cancel)."""
    seconds = float(params.get("seconds", 0.25))
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if ctx.cancelled():
            return {}
        time.sleep(min(0.01, left))
    return {"text": "slept"}


def consume_windows(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any]]:
    """A streaming consumer: one text segment per window of `text` it receives, `work_s` of work each.

    Fed by a `window = N` edge, `text` is an iterable of windows; fed by a `window = -1` edge it is
    the whole text at once, which counts as one window.
    """
    work = float(params.get("work_s", 0.002))
    text = inputs.get("text", "")
    windows = [text] if isinstance(text, str) else text
    for piece in windows:
        time.sleep(work)
        yield {"text": str(piece)}


def segments(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any]]:
    """A text stream as fast as it can go: `n` segments of one short word each."""
    for i in range(int(params.get("n", 4000))):
        yield {"text": f"w{i % 10} "}


def tensor_make(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Makes a float16 tensor of `mb` MiB; times an in-process clone of it; hands it on.

    `t_sent` is the wall clock just before returning: what follows (pickling, the socket, the
    next stage unpickling it) is the hand-off that `tensor_take` times.
    """
    import torch

    mb = int(params.get("mb", 256))
    rows = mb * (1 << 20) // (2 * 1024 * 1024)
    t = torch.ones((rows, 1024, 1024), dtype=torch.float16)
    clones = []
    for _ in range(int(params.get("clones", 3))):
        t0 = time.perf_counter()
        c = t.clone()
        clones.append(time.perf_counter() - t0)
        del c
    return {"tensor": t, "clone_s": sorted(clones)[len(clones) // 2], "t_sent": time.time()}


def tensor_take(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Receives the tensor: reports how long since `tensor_make` returned it, and its size."""
    now = time.time()
    t = inputs["tensor"]
    return {"handoff_s": now - float(inputs["t_sent"]), "clone_s": float(inputs["clone_s"]),
            "nbytes": int(t.numel() * t.element_size()), "dtype": str(t.dtype)}


def burn(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """CPU-bound work: spins until this process has used `cpu_s` seconds of CPU (a model's forward
    pass stands in here; the GIL keeps it to one core per worker)."""
    cpu_s = float(params.get("cpu_s", 0.2))
    end = time.process_time() + cpu_s
    x = 0
    while time.process_time() < end:
        for i in range(2000):
            x += i * i
    return {"text": str(x % 7)}


def consume_states(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any]]:
    """A consumer of hidden states: one segment per window of `states` ({"rows": N}), `work_s` each.

    Fed by a `window = N` edge (or a schedule), `states` is an iterable of (rows, hidden) tensors;
    by a `window = -1` edge, the whole tensor, which counts as one window.
    """
    work = float(params.get("work_s", 0.002))
    states = inputs["states"]
    windows = [states] if hasattr(states, "shape") else states
    for piece in windows:
        time.sleep(work)
        yield {"rows": int(piece.shape[0])}
