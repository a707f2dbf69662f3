"""When a dead stage worker is restarted, and when its stage is given up for good.

Pure logic: no asyncio, no processes, no clock of its own (every call takes `now`, a
`time.monotonic()` reading). It runs in whichever thread calls it (in the daemon: the
supervisor process's event-loop thread, from `StageHandle`) and blocks on nothing.

The rules, as `[daemon]` configures them:
- a crash is remembered for `restart_window_s` seconds; with `max_restarts = N` the worker
  is restarted N times, and the (N+1)-th crash within the window gives the stage up;
- a kill the supervisor ordered for a job's sake (a cancel the stage ignored past its
  grace) is not a crash: it is restarted, but not counted;
- a worker that exits with `protocol.EXIT_LOAD_FAILED` gets exactly one more try (memory
  held by the dead worker may take a moment to be freed); a second such exit in a row
  (no READY between them) gives the stage up;
- the restart waits `min(restart_backoff_s * 2**(n-1), restart_backoff_max_s)`, n being the
  crashes now in the window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from omnid import protocol as P
from omnid.config import DaemonConfig


@dataclass(frozen=True)
class Restart:
    """Restart the worker after `delay_s` seconds."""

    delay_s: float
    crashes: int            # crashes in the window, this one included when it counted


@dataclass(frozen=True)
class GiveUp:
    """Do not restart: the stage is failed for good. `reason` ends its error message."""

    reason: str             # "not restarting: loading fails" / "crashed N times in W s; not restarting"


RestartDecision = Restart | GiveUp


class RestartPolicy:
    """Crash counting in a sliding window, the load-failure retry, and the backoff."""

    def __init__(self, max_restarts: int, restart_window_s: float, restart_backoff_s: float,
                 restart_backoff_max_s: float) -> None:
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self._crash_times: deque[float] = deque()   # monotonic times of the crashes in the window
        self._next_exit_counts = True               # False after a kill ordered for a cancel's grace
        self._load_failures = 0                     # EXIT_LOAD_FAILED exits since the last READY

    @classmethod
    def from_config(cls, daemon: DaemonConfig) -> RestartPolicy:
        return cls(max_restarts=daemon.max_restarts, restart_window_s=daemon.restart_window_s,
                   restart_backoff_s=daemon.restart_backoff_s,
                   restart_backoff_max_s=daemon.restart_backoff_max_s)

    @property
    def crashes(self) -> int:
        """Crashes remembered in the window (as of the last `on_exit`)."""
        return len(self._crash_times)

    def note_kill(self, counts: bool) -> None:
        """The supervisor is killing the worker; `counts=False`: its exit is not a crash."""
        self._next_exit_counts = counts

    def on_ready(self) -> None:
        """The worker loaded its engine: the load-failure retry is available again."""
        self._load_failures = 0

    def on_exit(self, now: float, exit_code: int | None) -> RestartDecision:
        """The worker died (or could not be spawned: `exit_code=None`): restart it, or give up."""
        if self._next_exit_counts:
            self._crash_times.append(now)
        self._next_exit_counts = True
        while self._crash_times and now - self._crash_times[0] > self.restart_window_s:
            self._crash_times.popleft()
        if exit_code == P.EXIT_LOAD_FAILED:
            self._load_failures += 1
            if self._load_failures >= 2:
                return GiveUp("not restarting: loading fails")
        n = len(self._crash_times)
        if n > self.max_restarts:
            return GiveUp(f"crashed {n} times in {self.restart_window_s:.0f} s; not restarting")
        delay = min(self.restart_backoff_s * 2 ** (n - 1), self.restart_backoff_max_s)
        return Restart(delay_s=delay, crashes=n)
