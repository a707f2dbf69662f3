"""Memory and CPU use of a stage worker and its children, for `GET /v1/stages`.

Runs in the supervisor process's event-loop thread, when the API builds a stage snapshot (and in a
Ray-placed worker's `usage` thread, which samples its own process on its node).
It reads /proc through psutil: short, non-blocking file reads, no waiting on the worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int | None:
    """A process's own resident memory (one read of /proc/PID/statm, no psutil object); None when
    it is gone. The supervisor's once-a-second look at a worker, and a worker's look at itself."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) a process and its living descendants have used: a worker's
    heartbeat reads its own (a vLLM stage's core runs in a child). 0.0 when it cannot be read."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except psutil.Error:
        return 0.0


@dataclass(frozen=True)
class ProcessSample:
    rss_bytes: int | None = None        # the worker's RSS plus that of all its descendants
    cpu_percent: float | None = None    # the worker's own CPU use since the previous sample


class ProcessSampler:
    """Keeps the `psutil.Process` of the current worker, so CPU use is measured between samples."""

    def __init__(self) -> None:
        self._ps: psutil.Process | None = None

    def reset(self) -> None:
        """A new worker: forget the old one's CPU baseline."""
        self._ps = None

    def sample(self, pid: int | None) -> ProcessSample:
        """RSS and CPU of `pid` (None when it is gone or cannot be read)."""
        if pid is None:
            return ProcessSample()
        rss: int | None = None
        cpu: float | None = None
        try:
            if self._ps is None or self._ps.pid != pid:
                self._ps = psutil.Process(pid)
                self._ps.cpu_percent(None)      # the first call only sets the baseline
            with self._ps.oneshot():
                rss = self._ps.memory_info().rss
                cpu = self._ps.cpu_percent(None)
                for child in self._ps.children(recursive=True):
                    try:
                        rss += child.memory_info().rss
                    except psutil.Error:
                        pass
        except psutil.Error:
            pass
        return ProcessSample(rss_bytes=rss, cpu_percent=cpu)
