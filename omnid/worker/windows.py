"""Streaming edges (`window = N`, or a schedule `window = [4, 8, 16, 25]`): windows built from an
upstream's segments, and streams fed by them.

Runs in a stage worker. `WindowBuilder` is used by the main thread only (segments come from the
engine, inside `step`). `EdgeStream` is filled by the data plane's connection threads (`put`) and
read by the main thread (the stage's function iterating its `InputStream`, omnid.engines.base); its condition variable
is the only thing that blocks, and a cancel wakes it.

- A window is N consecutive segments of one job (with a schedule, the k-th window holds its k-th
  size, the last size repeating), stitched (`stitch`): str and bytes concatenated,
  tensors and arrays concatenated on dim 0, lists extended, anything else the latest value.
  The last window may be shorter and is marked last; when the job ends on an exact multiple of N,
  the last window is empty (it only says "that was all").
- A downstream stage gets each mapped input of a streaming edge as an `InputStream`: iterating it
  yields each window's value for that input, blocks until the next window arrives, ends after the
  last one, and raises `Cancelled` at once when the job is cancelled.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omnid.engines.base import Cancelled


def _concat(prev: Any, value: Any) -> Any:
    """`prev` and `value` joined, for one input across two segments (see the module docstring)."""
    if isinstance(prev, str) and isinstance(value, str):
        return prev + value
    if isinstance(prev, (bytes, bytearray)) and isinstance(value, (bytes, bytearray)):
        return bytes(prev) + bytes(value)
    if isinstance(prev, list) and isinstance(value, list):
        return prev + value
    module = type(value).__module__.split(".")[0]
    if module == "torch" and type(prev) is type(value) and hasattr(value, "dim") and value.dim() > 0:
        import torch
        return torch.cat([prev, value], dim=0)
    if module == "numpy" and type(prev) is type(value) and getattr(value, "ndim", 0) > 0:
        import numpy
        return numpy.concatenate([prev, value], axis=0)
    return value


def stitch(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """One window's value for each output name, from its segments in order."""
    out: dict[str, Any] = {}
    for seg in segments:
        for key, value in seg.items():
            out[key] = _concat(out[key], value) if key in out else value
    return out


class WindowBuilder:
    """Groups one job's segments into windows for one streaming edge (main thread only).

    `sizes`: N (every window N segments) or a schedule (N1, N2, ...): window k holds sizes[k]
    segments, the last size repeating; e.g. (4, 8, 16, 25) gives 4, 8, 16, 25, 25, ...
    """

    def __init__(self, sizes: int | Sequence[int]) -> None:
        self.sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes)
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError(f"window sizes must be > 0, not {self.sizes}")
        self._segments: list[dict[str, Any]] = []
        self.sent = 0               # windows emitted so far
        self.closed = False         # the last window was emitted

    @property
    def size(self) -> int:
        """How many segments the window being built holds when full."""
        return self.sizes[min(self.sent, len(self.sizes) - 1)]

    def add(self, outputs: dict[str, Any], is_last: bool) -> tuple[int, dict[str, Any]] | None:
        """Take one segment; a full (or last) window as (index, stitched values), else None."""
        if self.closed:
            return None
        if outputs:
            self._segments.append(outputs)
        if len(self._segments) < self.size and not is_last:
            return None
        return self._emit(is_last)

    def finish(self, outputs: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """The request completed: the last window, unless one was already marked last.

        An engine that streamed nothing (a plain function) sends its whole outputs as one window.
        """
        if self.closed:
            return None
        if self.sent == 0 and not self._segments:
            self._segments.append(outputs)
        return self._emit(True)

    def _emit(self, last: bool) -> tuple[int, dict[str, Any]]:
        values = stitch(self._segments)
        self._segments = []
        index = self.sent
        self.sent += 1
        self.closed = last
        return index, values


class EdgeStream:
    """One job's windows from one streaming edge, as they arrive; read by the stage's `InputStream`s
    (`omnid.engines.base`: it is their `WindowSource`).

    `capacity` bounds the windows waiting to be read (the per-job backpressure of a stream):
    past it, `put` answers None and the upstream offers the window again later.
    """

    def __init__(self, keys: list[str], capacity: int, is_cancelled: Callable[[], bool]) -> None:
        self._cv = threading.Condition()
        self.keys = tuple(keys)     # the inputs it feeds, one `InputStream` each
        self._queues: dict[str, deque[Any]] = {k: deque() for k in keys}
        self._capacity = max(1, capacity)
        self._is_cancelled = is_cancelled
        self.next_index = 0         # the index of the next window expected
        self.ended = False          # the last window arrived
        self.cancelled = False

    def put(self, index: int, values: Mapping[str, Any], last: bool) -> bool | None:
        """A window arrived (a data-plane thread). True: taken (or taken before); None: no room."""
        with self._cv:
            if index < self.next_index:
                return True                     # a resent window we hold already
            if index > self.next_index or self.ended:
                return None                     # out of order: cannot happen on one connection
            if values and max((len(q) for q in self._queues.values()), default=0) >= self._capacity:
                return None
            for key, q in self._queues.items():
                if key in values:
                    q.append(values[key])
            self.next_index += 1
            self.ended = last
            self._cv.notify_all()
            return True

    def cancel(self) -> None:
        with self._cv:
            self.cancelled = True
            self._cv.notify_all()

    def ready(self, key: str) -> bool:
        """`next()` on this key's stream would not block."""
        with self._cv:
            return bool(self._queues[key]) or self.ended or self.cancelled or self._is_cancelled()

    def take(self, key: str) -> tuple[bool, Any]:
        """The next value for `key`: (True, value), or (False, None) after the last window.

        Blocks until one arrives; raises `Cancelled` when the job is cancelled meanwhile.
        """
        with self._cv:
            while True:
                if self.cancelled or self._is_cancelled():
                    raise Cancelled()
                q = self._queues[key]
                if q:
                    value = q.popleft()
                    self._cv.notify_all()
                    return True, value
                if self.ended:
                    return False, None
                # Woken by put/cancel; the timeout re-checks a cancel that came by the control pipe.
                self._cv.wait(0.05)

    def pending(self) -> int:
        with self._cv:
            return max((len(q) for q in self._queues.values()), default=0)
