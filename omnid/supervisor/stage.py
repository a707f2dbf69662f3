"""The supervisor's side of one stage worker: spawn, handshake, watch, restart.

Runs in the supervisor's event-loop thread (the main thread: the kernel's
parent-death signal is tied to the thread that forked, so workers must be
spawned from a thread that lives as long as the daemon). Nothing here blocks:
the worker's control pipe and its process sentinel are watched with
`loop.add_reader`, so a worker that dies, during its load or later, is noticed
at once.

States: starting -> waiting_for_device -> loading -> ready <-> busy;
on death: restarting (backoff) -> loading ..., or failed when it keeps
crashing or cannot load; stopped at shutdown.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import psutil
import structlog

from omnid import protocol as P
from omnid.config import Config, StageConfig

log = structlog.get_logger("omnid.stage")

_SPAWN = multiprocessing.get_context("spawn")


class StageDead(Exception):
    """The stage is failed for good (sticky, like vLLM's EngineDeadError)."""


def describe_exit(code: int | None) -> str:
    """'exited with status 3' / 'killed by SIGKILL'."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == P.EXIT_LOAD_FAILED:
        return f"could not load its engine (exit status {code})"
    return f"exited with status {code}"


class StageHandle:
    """One stage worker process and its life cycle."""

    def __init__(self, config: Config, stage: StageConfig, data_dir: Any, jobs_dir: Any,
                 device_locks: dict[int, asyncio.Lock],
                 on_message: Callable[["StageHandle", object], None],
                 on_exit: Callable[["StageHandle", str], None]) -> None:
        self.config = config
        self.stage = stage
        self.name = stage.name
        self.data_dir = data_dir
        self.jobs_dir = jobs_dir
        self.device_locks = device_locks
        self.on_message = on_message
        self.on_exit = on_exit
        self.state = "starting"
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.generation = 0
        self.restarts = 0
        self.restart_times: deque[float] = deque()
        self.last_error: str | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.load_s: float | None = None
        self.info: dict[str, Any] = {}
        self.last_heartbeat = 0.0
        self.stats = P.QueueStats()
        self.totals = P.QueueStats()        # counters of earlier incarnations, for metrics
        self.running: tuple[str, ...] = ()
        self.gpu_memory_bytes: int | None = None
        self.tracked_jobs = 0
        self.jobs_done = 0                  # counted here, on each Finished: exact, and kept across restarts
        self.ready_event = asyncio.Event()
        self._load_error: str | None = None
        self._ps: psutil.Process | None = None
        self._stopping = False
        self._restart_task: asyncio.Task[None] | None = None
        self._kill_counts = True            # False when the supervisor kills it on purpose (cancel grace)
        self._load_failures = 0             # consecutive restarts that could not load the engine
        self._outq: deque[object] = deque() # control messages waiting for room in the pipe

    # ------------------------------------------------------------------ start

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.is_alive() else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None

    async def start(self) -> None:
        """Spawn the worker and wait for READY (or its death), loading one per device at a time."""
        locks = [self.device_locks[d] for d in sorted(self.stage.devices)]
        if any(lock.locked() for lock in locks):
            self.state = "waiting_for_device"
        for lock in locks:                 # sorted order: overlapping device sets cannot deadlock
            await lock.acquire()
        try:
            if self._stopping:
                return
            self._spawn()
            await self._wait_ready()
        finally:
            for lock in reversed(locks):
                lock.release()

    def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        parent, child = _SPAWN.Pipe(duplex=True)
        spec = P.WorkerSpec(stage=self.name, config=self.config, data_dir=self.data_dir,
                            jobs_dir=self.jobs_dir, parent_pid=os.getpid())
        from omnid.worker.main import worker_main
        proc = _SPAWN.Process(target=worker_main, args=(spec, child), name=f"omnid-stage-{self.name}",
                              daemon=False)
        self.state = "loading"
        self.ready_event.clear()
        self._load_error = None
        proc.start()
        child.close()
        self.process, self.conn = proc, parent
        self.started_at = time.time()
        self.ready_at = None
        self.last_heartbeat = time.monotonic()
        self._ps = None
        loop.add_reader(parent.fileno(), self._on_readable)
        loop.add_reader(proc.sentinel, self._on_sentinel)
        log.info("stage worker spawned", stage=self.name, pid=proc.pid, devices=list(self.stage.devices),
                 generation=self.generation)

    async def _wait_ready(self) -> None:
        timeout = self.config.daemon.startup_timeout_s
        try:
            await asyncio.wait_for(self.ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            self.kill(f"did not become ready within {timeout:.0f} s")
            await self.ready_event.wait()

    # ------------------------------------------------------------------ events

    def _on_readable(self) -> None:
        conn = self.conn
        if conn is None:
            return
        try:
            while conn.poll():
                msg = conn.recv()
                self._handle(msg)
        except (EOFError, OSError):
            self._detach_conn()

    def _handle(self, msg: object) -> None:
        if isinstance(msg, P.Heartbeat):
            self.last_heartbeat = time.monotonic()
            self.stats = msg.stats
            self.running = msg.running
            self.gpu_memory_bytes = msg.gpu_memory_bytes
            self.tracked_jobs = msg.tracked_jobs
            if self.state in ("ready", "busy"):
                self.state = "busy" if msg.running else "ready"
            return
        if isinstance(msg, P.Ready):
            self._load_failures = 0
            self.state = "ready"
            self.ready_at = time.time()
            self.load_s = msg.load_s
            self.info = msg.info
            self.last_heartbeat = time.monotonic()
            self.ready_event.set()
            log.info("stage ready", stage=self.name, pid=msg.pid, load_s=round(msg.load_s, 3))
        elif isinstance(msg, P.LoadFailed):
            self._load_error = msg.error.strip()
        elif isinstance(msg, P.Started):
            self.running = tuple(dict.fromkeys(self.running + (msg.job,)))
        elif isinstance(msg, (P.Finished, P.Failed, P.Stopped)):
            if isinstance(msg, P.Finished):
                self.jobs_done += 1
            self.running = tuple(j for j in self.running if j != msg.job)
        if self.state in ("ready", "busy") and isinstance(msg, (P.Started, P.Finished, P.Failed, P.Stopped)):
            self.state = "busy" if self.running else "ready"
        self._notify(self.on_message, msg)

    def _notify(self, callback: Callable[["StageHandle", Any], None], arg: Any) -> None:
        """Call the scheduler; its failure (a full disk, a bug) must not stop this handle."""
        try:
            callback(self, arg)
        except Exception:
            log.exception("handling a stage event failed", stage=self.name, event=type(arg).__name__)

    def _detach_conn(self) -> None:
        self._outq.clear()
        if self.conn is not None:
            try:
                loop = asyncio.get_running_loop()
                loop.remove_reader(self.conn.fileno())
                loop.remove_writer(self.conn.fileno())
            except (ValueError, OSError):
                pass
            self.conn.close()
            self.conn = None

    def _on_sentinel(self) -> None:
        proc = self.process
        if proc is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        self._reap(proc, time.monotonic() + 5.0)

    def _reap(self, proc: Any, deadline: float) -> None:
        """The sentinel fires as the worker closes its fds; its exit status follows within
        moments. Poll for it without blocking the event loop."""
        proc.join(timeout=0)
        if proc.exitcode is None and time.monotonic() < deadline:
            asyncio.get_running_loop().call_later(0.005, self._reap, proc, deadline)
            return
        self._on_exit_status(proc)

    def _on_exit_status(self, proc: Any) -> None:
        self._on_readable()             # drain what it said before dying (LoadFailed, Failed ...)
        self._detach_conn()
        self._kill_group(proc.pid)      # anything the engine started dies with it
        code = proc.exitcode
        was_loading = not self.ready_event.is_set()
        reason = f"worker (pid {proc.pid}) {describe_exit(code)}"
        if self._load_error:
            reason += f": {self._load_error.splitlines()[0]}"
        self.last_error = reason
        self.running = ()
        # Fold this incarnation's counters into the totals, for monotonic metrics.
        self.totals = P.QueueStats(**{k: getattr(self.totals, k) + getattr(self.stats, k)
                                      for k in ("enqueued", "dequeued", "dropped", "blocked_s",
                                                "window_triggers")})
        self.stats = P.QueueStats()
        if self._stopping:
            self.state = "stopped"
            self.ready_event.set()
            return
        log.error("stage worker died", stage=self.name, pid=proc.pid, exit=code, reason=reason)
        self._notify(self.on_exit, reason)
        # End the start attempt that is waiting for READY (it holds the device load locks).
        self.ready_event.set()
        if was_loading and self.generation == 0:
            self.state = "failed"          # the daemon's first start fails as a whole
            return
        self._schedule_restart(code)

    def _schedule_restart(self, code: int | None) -> None:
        d = self.config.daemon
        now = time.monotonic()
        if self._kill_counts:              # a kill we ordered (cancel grace) is not a crash
            self.restart_times.append(now)
        self._kill_counts = True
        while self.restart_times and now - self.restart_times[0] > d.restart_window_s:
            self.restart_times.popleft()
        if code == P.EXIT_LOAD_FAILED:
            # One retry: memory held by the dead worker may take a moment to be freed.
            self._load_failures += 1
            if self._load_failures >= 2:
                self._fail_for_good(f"{self.last_error} (not restarting: loading fails)")
                return
        if len(self.restart_times) > d.max_restarts:
            self._fail_for_good(f"{self.last_error} (crashed {len(self.restart_times)} times in "
                                f"{d.restart_window_s:.0f} s; not restarting)")
            return
        delay = min(d.restart_backoff_s * 2 ** (len(self.restart_times) - 1), d.restart_backoff_max_s)
        self.state = "restarting"
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(delay))

    def _fail_for_good(self, error: str) -> None:
        self.state = "failed"
        self.last_error = error
        self.ready_event.set()
        log.error("stage failed", stage=self.name, error=error)
        self._notify(self.on_message, StageDead(error))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self.generation += 1
        self.restarts += 1
        try:
            await self.start()
        except Exception as e:             # e.g. spawn hit a file-descriptor limit: try again later
            log.exception("restarting the stage worker failed", stage=self.name)
            self.last_error = f"restart failed: {type(e).__name__}: {e}"
            self._schedule_restart(None)

    # ------------------------------------------------------------------ control

    def send(self, msg: object) -> bool:
        """Queue a control message; never blocks the event loop (a frozen worker's pipe fills)."""
        if self.conn is None:
            return False
        self._outq.append(msg)
        self._flush()
        return True

    def _flush(self) -> None:
        conn = self.conn
        if conn is None:
            self._outq.clear()
            return
        loop = asyncio.get_running_loop()
        try:
            # Writable means PIPE_BUF bytes are free: one small message goes in whole, at once.
            while self._outq and select.select([], [conn.fileno()], [], 0)[1]:
                conn.send(self._outq.popleft())
        except (OSError, ValueError):
            self._outq.clear()
            return
        if self._outq:
            loop.add_writer(conn.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        if self.conn is not None:
            asyncio.get_running_loop().remove_writer(self.conn.fileno())
        self._flush()

    def _kill_group(self, pid: int | None) -> None:
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self, reason: str, counts: bool = True) -> None:
        """SIGKILL the worker (hung, or ignoring a cancel); the sentinel handler restarts it.

        `counts=False`: a kill the supervisor decided on for a job's sake (a cancel the stage
        ignored) does not count toward `max_restarts`.
        """
        if self.alive and self.process is not None:
            self._kill_counts = counts
            log.warning("killing stage worker", stage=self.name, pid=self.process.pid, reason=reason)
            self._load_error = reason
            self._kill_group(self.process.pid)
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check_heartbeat(self) -> None:
        timeout = self.config.daemon.heartbeat_timeout_s
        if self.state in ("ready", "busy") and self.alive and \
                time.monotonic() - self.last_heartbeat > timeout:
            self.kill(f"hung: no heartbeat for {timeout:g} s")

    async def stop(self, grace: float) -> None:
        """Shutdown: ask politely, wait `grace` seconds, then SIGKILL the process group."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        proc = self.process
        if proc is None or proc.exitcode is not None:
            self.state = "stopped"
            return
        self.send(P.Shutdown())
        if self.state not in ("ready", "busy"):
            grace = 0.0                    # still loading (or waiting to): nothing to finish, no wait
        deadline = time.monotonic() + grace
        while proc.exitcode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.exitcode is None:
            self._kill_group(proc.pid)
            proc.kill()
            while proc.exitcode is None:
                await asyncio.sleep(0.02)
        self._kill_group(proc.pid)
        self.state = "stopped"

    # ------------------------------------------------------------------ inspection

    def snapshot(self) -> dict[str, Any]:
        rss = cpu = None
        pid = self.pid
        if pid is not None:
            try:
                if self._ps is None or self._ps.pid != pid:
                    self._ps = psutil.Process(pid)
                    self._ps.cpu_percent(None)
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
        return {
            "name": self.name, "engine": self.stage.engine, "state": self.state, "pid": pid,
            "devices": list(self.stage.devices), "queue_depth": self.stats.depth,
            "queue_capacity": self.stage.queue_capacity, "max_inflight": self.stage.max_inflight,
            "running": list(self.running), "jobs_done": self.jobs_done,
            "restarts": self.restarts, "rss_bytes": rss, "cpu_percent": cpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "uptime_s": round(time.time() - self.ready_at, 3) if self.ready_at and pid else None,
            "load_s": round(self.load_s, 3) if self.load_s is not None else None,
            "spawned_at": self.started_at, "ready_at": self.ready_at, "tracked_jobs": self.tracked_jobs,
            "last_error": self.last_error, "model": str(self.stage.model) if self.stage.model else None,
            "function": self.stage.function, "info": self.info,
        }
