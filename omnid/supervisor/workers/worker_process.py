"""A local stage worker's process, as its handle (stage.py) starts and ends it: the spawn with
its two pipes (control, and the worker's stdout/stderr), the SIGKILL of its process group, and the
stop (asked, a grace period, then killed).

Runs in the supervisor's main thread (spawned from the thread that lives as long as the daemon:
the kernel's parent-death signal is tied to it); `end` only awaits, polling the exit status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from omnid import protocol as P
from omnid.engines.capabilities import capabilities
from omnid.stage_entry import stage_main
from omnid.supervisor.workers.fork_servers import ServerProcess, server_for

_SPAWN = multiprocessing.get_context("spawn")


def forked(spec: P.WorkerSpec) -> bool:
    """Whether this worker is forked from its engine's fork server (fork_servers.py), with the
    engine's libraries imported already: a CPU stage with no `env` of its own (or of an engine that
    preloads nothing). Spawned bare otherwise: a GPU stage (its devices must be set before CUDA is
    looked at), a stage whose `env` a preloaded library may have read as it was imported, every
    stage with `preload_workers = false`."""
    stage = spec.config.stages[spec.stage].for_replica(spec.replica)
    # (an engine that preloads nothing, python's, imports nothing a stage's `env` could be late for)
    late_env = bool(stage.env) and bool(capabilities(stage.engine).preload)
    return spec.config.daemon.preload_workers and not stage.devices and not late_env


def kill_group(pid: int | None) -> None:
    """SIGKILL the worker's process group: anything its engine started dies with it."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class WorkerProcess:
    """One worker process, made and not started yet; `start` starts it."""

    def __init__(self, spec: P.WorkerSpec, label: str) -> None:
        make: Callable[..., BaseProcess] = _SPAWN.Process
        if forked(spec):
            engine = spec.config.stages[spec.stage].engine
            make = functools.partial(ServerProcess, engine=engine)
            spec = dataclasses.replace(spec, parent_pid=server_for(engine).start())
        self.control, self._child = multiprocessing.Pipe(duplex=True)
        # The worker's fds 1 and 2: an OS pipe whose write end goes over as a Connection (passed as an
        # fd by the start method, like the control pipe's end); the handle stores and forwards its lines.
        self.log_read, self._log_write = multiprocessing.Pipe(duplex=False)
        self.process = make(target=stage_main, args=(spec, self._child, self._log_write),
                            name=f"omnid-stage-{label}", daemon=False)

    def start(self) -> tuple[BaseProcess, Connection, Connection]:
        """Start it: (the process, our end of its control pipe, the read end of its stdout/stderr).
        A start that fails closes every pipe."""
        try:
            self.process.start()
        except BaseException:
            for conn in (self.control, self._child, self.log_read, self._log_write):
                conn.close()
            raise
        self._child.close()
        self._log_write.close()     # the worker's (and its children's) copies alone: EOF when they are gone
        return self.process, self.control, self.log_read


async def end(proc: BaseProcess, grace: float) -> None:
    """Wait up to `grace` seconds for a worker asked to stop, then SIGKILL its process group; returns
    once it has exited (and its group is killed)."""
    deadline = time.monotonic() + grace
    while proc.exitcode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if proc.exitcode is None:
        kill_group(proc.pid)
        proc.kill()
        while proc.exitcode is None:
            await asyncio.sleep(0.02)
    kill_group(proc.pid)
