"""Python stage functions of the GPU check (`tests/gpu/check.py`), imported inside stage workers.

Each returns what it saw as a small JSON text output (`info`), so the check reads it with one
`GET .../outputs/info`. On a host without CUDA (the check's `--dry-run`) they run on the CPU.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

_KEPT: list[Any] = []           # `hold` keeps its allocation for the worker's life
_HELD: dict[str, Any] = {}      # `take` with `keep`: the last tensor it received, and its checksum


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _uuid(index: int) -> str:
    import torch
    return str(torch.cuda.get_device_properties(index).uuid)


def visible(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """What this worker sees: CUDA_VISIBLE_DEVICES, and the GPUs torch finds."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"info": json.dumps({"cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), "count": count,
                                "uuids": [_uuid(i) for i in range(count)], "pid": os.getpid()})}


def hold(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Allocate `mib` MiB on the stage's device once, and keep it for the worker's life."""
    import torch
    mib = int(params.get("mib", 1024))
    if not _KEPT:
        _KEPT.append(torch.ones(mib << 20, dtype=torch.uint8, device=_device()))
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    return {"info": json.dumps({"pid": os.getpid(), "reserved": reserved, "mib": mib})}


def make(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """A tensor of `mib` MiB on this stage's GPU, its checksum, when it was ready (monotonic clock,
    the same in every process), and how long an in-process device copy of it takes here.
    `mib` 0: only the allocated bytes, before (a probe of what stays allocated)."""
    import torch
    mib = float(params.get("mib", 256))
    device = _device()
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    if mib <= 0:
        return {"info": json.dumps({"make_allocated": allocated})}
    n = int(mib * (1 << 20))
    t = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    checksum = int(t.sum(dtype=torch.int64).item())
    copy_s = _device_copy_s(t)
    if device == "cuda":
        torch.cuda.synchronize()
    info = {"sum": checksum, "t_ready": time.monotonic(), "copy_s": copy_s, "make_allocated": allocated,
            "gpu": _uuid(t.device.index or 0) if device == "cuda" else "cpu"}
    return {"t": t, "info": json.dumps(info)}


def _device_copy_s(t: Any) -> float:
    """The median of 5 in-process copies of `t` into a new tensor on its device (CUDA events)."""
    import torch
    if t.device.type != "cuda":
        start = time.perf_counter()
        t.clone()
        return time.perf_counter() - start
    dst = torch.empty_like(t)
    dst.copy_(t)                    # warm-up
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(t)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    del dst
    return sorted(times)[2]


def take(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Receive `make`'s tensor: when it arrived, where it is, whether its checksum holds.
    `keep`: keep it (for the worker's life); `verify`: check the kept one's checksum again."""
    import torch
    arrived = time.monotonic()
    info = json.loads(inputs["info"])
    t = inputs.get("t")
    if t is None:                   # the probe: what stays allocated here
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if params.get("verify") and _HELD:
            info["kept_ok"] = int(_HELD["t"].sum(dtype=torch.int64).item()) == _HELD["sum"]
        return {"info": json.dumps({**info, "take_allocated": allocated})}
    ok = int(t.sum(dtype=torch.int64).item()) == info["sum"]
    if params.get("keep"):
        _HELD.update(t=t, sum=info["sum"])
    on = _uuid(t.device.index or 0) if t.device.type == "cuda" else "cpu"
    del t
    inputs.pop("t")
    return {"info": json.dumps({**info, "arrived": arrived, "handoff_s": arrived - info["t_ready"],
                                "checksum_ok": ok, "on": on})}
