"""Whether one stage worker still lives, as its handle (stage.py, known here as `Living`) watches it:
a local worker's exit noticed at once (its pidfd, else its sentinel, readable on the event loop),
an exit whose wake was lost found by the once-a-second check, and a worker whose heartbeats
stopped killed as hung.

Runs in the supervisor's event-loop thread; nothing blocks: the exit descriptor is watched with
`loop.add_reader`, and the exit status, which follows the wake within moments, is polled with
`call_later`. Dead means an exit status (`omnid.procwatch.exit_of`): a wake without one (a
descriptor closed and reused) is logged and waited out. What the death means (the reason, the
restart) is the handle's: it hears of each exit once, through `exited`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Protocol

import structlog

from omnid.config import Config
from omnid.procwatch import PidFd, exit_of
from omnid.vocabulary import WorkerState

log = structlog.get_logger("omnid.stage")


class Living(Protocol):
    """What the watch reads of its handle (`StageHandle`, stage.py), and the one thing it asks of
    it: the kill of a worker that stopped sending heartbeats."""

    @property
    def label(self) -> str: ...

    @property
    def state(self) -> WorkerState: ...

    @property
    def alive(self) -> bool: ...

    @property
    def last_heartbeat(self) -> float:
        """When the worker last said something (monotonic)."""

    @property
    def config(self) -> Config: ...

    def kill(self, reason: str, counts: bool = True) -> None: ...


class Liveness:
    """Watches one handle's worker, one incarnation at a time (`watch` on each spawn); `exited`
    hears of each incarnation's exit once, with its exit status there to read."""

    def __init__(self, handle: Living, exited: Callable[[BaseProcess], None]) -> None:
        self._handle = handle
        self._exited = exited
        self._proc: BaseProcess | None = None       # the incarnation watched
        self._pidfd: PidFd | None = None            # its pidfd, where the kernel has them
        self._watched_fd: int | None = None         # the descriptor whose wake means "look for its exit"
        self._handled: BaseProcess | None = None    # the incarnation whose exit was handled

    def watch(self, proc: BaseProcess) -> None:
        """Wake when the worker exits: its pidfd (readable exactly then), else its sentinel."""
        self._proc = proc
        self._pidfd = PidFd(proc.pid) if proc.pid is not None else None
        fd = self._pidfd.fd if self._pidfd is not None and self._pidfd.fd is not None else proc.sentinel
        self._watched_fd = fd
        asyncio.get_running_loop().add_reader(fd, self._on_wake)

    def check(self) -> None:
        """Once a second: a warm worker silent for `heartbeat_timeout_s` is killed as hung; an exit
        whose wake was lost (its descriptor closed under us) is handled now."""
        handle = self._handle
        timeout = handle.config.daemon.heartbeat_timeout_s
        if handle.state.warm and handle.alive and time.monotonic() - handle.last_heartbeat > timeout:
            handle.kill(f"hung: no heartbeat for {timeout:g} s")
        proc = self._proc
        if proc is not None and self._handled is not proc and exit_of(proc) is not None:
            self._exit(proc)

    def _unwatch(self) -> None:
        fd, self._watched_fd = self._watched_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
        if self._pidfd is not None:
            self._pidfd.close()
            self._pidfd = None

    def _on_wake(self) -> None:
        proc = self._proc
        fd, self._watched_fd = self._watched_fd, None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
        if proc is None:
            return
        self._reap(proc, time.monotonic() + 5.0)

    def _reap(self, proc: BaseProcess, deadline: float) -> None:
        """The sentinel fires as the worker closes its fds; its exit status follows within
        moments. Poll for it without blocking the event loop. Dead means an exit status: a wake
        without one (a descriptor closed and reused) is logged and waited out."""
        if proc is not self._proc or self._handled is proc:
            return                      # handled already (the heartbeat check found its exit)
        if exit_of(proc) is None:
            if time.monotonic() < deadline:
                asyncio.get_running_loop().call_later(0.005, self._reap, proc, deadline)
                return
            log.warning("the stage worker's exit watch woke, but the worker has not exited; watching on",
                        stage=self._handle.label, pid=proc.pid)
            if self._pidfd is not None:
                self._pidfd.reopen()
                fd = self._pidfd.fd
            else:
                fd = None
            if fd is not None:
                self._watched_fd = fd
                asyncio.get_running_loop().add_reader(fd, self._on_wake)
            return                      # (without a pidfd: `check` looks every second)
        proc.join(timeout=0)            # multiprocessing reaps it and keeps its exit code
        self._exit(proc)

    def _exit(self, proc: BaseProcess) -> None:
        self._handled = proc
        self._unwatch()
        self._exited(proc)
