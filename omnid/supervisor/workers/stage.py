"""The supervisor's side of one stage worker: spawn, handshake, watch, restart, stop.

Runs in the supervisor process's event-loop thread (the main thread: the kernel's
parent-death signal is tied to the thread that forked, so workers must be spawned
from a thread that lives as long as the daemon). Nothing here blocks: the worker's
control pipe (`ControlPipe`) and its process's exit (`Liveness`) are watched with
`loop.add_reader`, so a worker that dies, during its load or later, is noticed at
once; `start` and `stop` only await (device load locks, READY, the worker's exit).

`StageHandle` keeps the life cycle and composes its parts: `WorkerProcess` (the
process's spawn, its pipes and its end: worker_process.py), `ControlPipe` (the
control pipe's I/O), `Liveness` (its exit noticed at once, a hung worker killed:
liveness.py), `RestartPolicy` (whether and when to restart), `MemoryWatch`
(its RSS against `max_rss_mb`, and the OOM killer's traces: memory_watch.py),
`ProcessSampler` (RSS and CPU for snapshots). Its config is the workers' config in
force (`Live.worker`, live.py). It tells what happens to one `StageListener` (the
scheduler), attached once both exist.

States (`WorkerState`): starting -> waiting_for_device -> loading -> ready <-> busy;
on death: restarting (backoff) -> loading ..., or failed when it keeps crashing or
cannot load; stopped at shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import structlog

from omnid import protocol as P
from omnid.config import Config, StageConfig
from omnid.process_stats import ProcessSampler
from omnid.supervisor.live import Follower, Live
from omnid.supervisor.workers import worker_process
from omnid.supervisor.workers.control_pipe import ControlPipe
from omnid.supervisor.workers.documents import LastRestart, Where, WorkerDoc
from omnid.supervisor.workers.liveness import Liveness
from omnid.supervisor.workers.memory_watch import MemoryWatch
from omnid.supervisor.workers.restart_policy import GiveUp, RestartPolicy
from omnid.supervisor.workers.stage_logs import PipeReader, log_file, stage_log_path
from omnid.supervisor.workers.worker_process import WorkerProcess, kill_group
from omnid.vocabulary import WorkerState

log = structlog.get_logger("omnid.stage")
HEARTBEAT_AGE_MAX_S = 1.0   # a heartbeat's stats are taken as at most this old when read (its `ts` says how old)


class StageListener(Protocol):
    """Who hears what a stage's worker does (the scheduler). Called in the event-loop thread;
    an exception it raises is logged and does not disturb the handle."""

    def on_message(self, handle: StageHandle, msg: object) -> None:
        """A message from the worker (any but `Heartbeat`, `Ready` included), after the handle
        updated its own state from it."""

    def on_exit(self, handle: StageHandle, reason: str) -> None:
        """The worker died (not on a planned stop); called before its restart is scheduled."""

    def on_failed(self, handle: StageHandle, error: str) -> None:
        """The stage is given up for good (sticky, like vLLM's EngineDeadError)."""


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
    if code == P.EXIT_ENGINE_DIED:
        return f"exited as its engine core process died (exit status {code})"
    return f"exited with status {code}"


def error_summary(error: str, limit: int = 600) -> str:
    """The whole exception message, on one line, without its traceback: a load error's first line
    alone ("ValidationError: 1 validation error for ModelConfig") hides its cause."""
    message = error.split("\nTraceback (most recent call last):", 1)[0]
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + " [...]"


def with_root_cause(error: str, root: str | None) -> str:
    """A load error as one line, with the root cause the worker's output named when the error
    itself does not (vLLM's "Engine core initialization failed. See root cause above": the cause
    was printed by its core process)."""
    summary = error_summary(error)
    if root is None or root in error or root.split(": ", 1)[-1] in error:
        return summary
    return f"{summary} (root cause: {root})"


class StageHandle(Follower):
    """One stage worker process and its life cycle. Its `config` is the workers' config in force
    (`Live.worker`; one a reload lets go keeps its own: `Follower`)."""

    def __init__(self, live: Live, name: str, data_dir: Path, jobs_dir: Path,
                 device_locks: dict[int, asyncio.Lock], replica: int = 0, config: Config | None = None) -> None:
        super().__init__(live, config)
        self.replica = replica
        self.name = name
        self.label = P.replica_label(name, replica)   # for logs: `draw`, `draw#1`
        self._stage: tuple[Config, StageConfig] | None = None
        self.data_dir = data_dir
        self.jobs_dir = jobs_dir
        self.device_locks = device_locks
        self.state = WorkerState.STARTING
        self.process: BaseProcess | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self._restart_asked: str | None = None     # the reason of a restart under way: its exit is no error
        self.last_restart: LastRestart | None = None    # the latest restart asked for: its reason, when
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.load_s: float | None = None
        self.info: dict[str, Any] = {}
        self.last_heartbeat = 0.0
        self.stats = P.QueueStats()
        self.stats_at = 0.0                 # when the worker took them (monotonic; 0: not yet)
        self.totals = P.QueueStats()        # counters of earlier incarnations, for metrics
        self.windows: dict[str, int] = {}   # downstream stage -> windows it admitted from this worker
        self.windows_before: dict[str, int] = {}    # the same, of earlier incarnations
        self.running: tuple[str, ...] = ()
        self.gpu_memory_bytes: int | None = None
        self.tracked_jobs = 0
        self.jobs_done = 0                  # counted here, on each Finished: exact, and kept across restarts
        self._listener: StageListener | None = None
        self._pipe: ControlPipe | None = None
        self._log_pipe: PipeReader | None = None    # this incarnation's stdout/stderr (stage_logs.py)
        self._policy = RestartPolicy.from_config(self.config.daemon)
        self._sampler = ProcessSampler()
        self.memory = MemoryWatch(self)     # its RSS (max_rss_mb) and what a SIGKILL nobody here sent means
        self._attempt_over = asyncio.Event()  # the start attempt ended: READY, death, failure or stop
        self._became_ready = False          # this incarnation sent READY
        self._load_error: str | None = None
        self._root_cause: str | None = None     # the last traceback's first exception line, from its output
        self._stopping = False
        self._restart_task: asyncio.Task[None] | None = None
        self._restarting = asyncio.Lock()   # `restart` (asked for: reload, omnictl stage restart)
        self.liveness = Liveness(self, self._on_exit_status)    # its exit, at once; its heartbeats

    def attach(self, listener: StageListener) -> None:
        """From now on, tell `listener` what the worker says and does."""
        self._listener = listener

    @property
    def stage(self) -> StageConfig:
        """This replica's stage definition in its config (`devices`: this replica's own)."""
        config = self.config
        if self._stage is None or self._stage[0] is not config:
            self._stage = (config, config.stages[self.name].for_replica(self.replica))
        return self._stage[1]

    @property
    def rss_restarts(self) -> int:
        return self.memory.rss_restarts

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.is_alive() else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Spawn the worker and wait until the attempt is over (READY, or its death),
        loading one per device at a time."""
        locks = [self.device_locks[d] for d in sorted(self.stage.devices)]
        if any(lock.locked() for lock in locks):
            self.state = WorkerState.WAITING_FOR_DEVICE
        for lock in locks:                 # sorted order: overlapping device sets cannot deadlock
            await lock.acquire()
        try:
            if self._stopping:
                return
            self._spawn()
            await self._wait_attempt()
        finally:
            for lock in reversed(locks):
                lock.release()

    def _spawn(self) -> None:
        spec = P.WorkerSpec(stage=self.name, config=self.config, data_dir=self.data_dir,
                            jobs_dir=self.jobs_dir, parent_pid=os.getpid(), replica=self.replica)
        worker = WorkerProcess(spec, self.label)
        self.state = WorkerState.LOADING
        self._attempt_over.clear()
        self._became_ready = False
        self._load_error = None
        self._root_cause = None
        proc, parent, log_read = worker.start()     # its stdout/stderr: stored and forwarded (stage_logs.py)
        self._close_log_pipe()             # the last incarnation's, if its EOF has not come yet
        daemon = self.config.daemon
        self._log_pipe = PipeReader(log_read, log_file(stage_log_path(daemon.state_dir, self.name, self.replica),
                                                       daemon.log_file_max_bytes, daemon.log_file_keep),
                                    stage=self.name)
        self._log_pipe.start(asyncio.get_running_loop())
        self.process = proc
        self.started_at = time.time()
        self.ready_at = None
        self.last_heartbeat = time.monotonic()
        self._sampler.reset()
        self.memory.spawned(proc.pid)
        self._pipe = ControlPipe(parent, self._on_message)
        self.liveness.watch(proc)
        log.info("stage worker spawned", stage=self.label, pid=proc.pid, devices=list(self.stage.devices),
                 restarts=self.restarts)

    async def _wait_attempt(self) -> None:
        timeout = self.config.daemon.startup_timeout_s
        try:
            await asyncio.wait_for(self._attempt_over.wait(), timeout)
        except asyncio.TimeoutError:
            self.kill(f"did not become ready within {timeout:.0f} s")
            await self._attempt_over.wait()

    # ------------------------------------------------------------------ what the worker says

    def _on_message(self, msg: object) -> None:
        """The worker said something: its handler here (`_HANDLERS`), then the listener, unless
        the message is the handle's alone (`_HANDLE_ONLY`)."""
        handler = _HANDLERS.get(type(msg))
        if handler is not None:
            handler(self, msg)
        if type(msg) not in _HANDLE_ONLY:
            self._notify(type(msg).__name__, lambda listener: listener.on_message(self, msg))

    def _on_batch(self, msg: P.Batch) -> None:
        for one in msg.messages:
            self._on_message(one)

    def _on_heartbeat(self, msg: P.Heartbeat) -> None:
        self.last_heartbeat = time.monotonic()
        self.stats = msg.stats
        # (taken as the worker sent them: a supervisor behind on its messages reads them late; a
        # Ray actor's clock on another host may differ, hence the bound)
        self.stats_at = self.last_heartbeat - min(max(0.0, time.time() - msg.ts), HEARTBEAT_AGE_MAX_S)
        self.running = msg.running
        self.gpu_memory_bytes = msg.gpu_memory_bytes
        self.tracked_jobs = msg.tracked_jobs
        self.windows = dict(msg.windows)
        self.memory.heard(msg.rss_bytes)
        if msg.live_info:
            self.info = {**self.info, **msg.live_info}      # e.g. a python stage's live sessions, kept current
        self._busy_or_ready()

    def _on_ready(self, msg: P.Ready) -> None:
        self._policy.on_ready()
        self.state = WorkerState.READY
        self.ready_at = time.time()
        self.load_s = msg.load_s
        self.info = msg.info
        self.last_heartbeat = time.monotonic()
        self._became_ready = True
        self._attempt_over.set()
        log.info("stage ready", stage=self.label, pid=msg.pid, load_s=round(msg.load_s, 3))

    def _on_load_failed(self, msg: P.LoadFailed) -> None:
        self._load_error = msg.error.strip()

    def _on_started(self, msg: P.Started) -> None:
        self.running = tuple(dict.fromkeys(self.running + (msg.job,)))
        self._busy_or_ready()

    def _on_finished(self, msg: P.Finished) -> None:
        self.jobs_done += 1
        self._on_ended(msg)

    def _on_ended(self, msg: P.Finished | P.Failed | P.Stopped) -> None:
        self.running = tuple(j for j in self.running if j != msg.job)
        self._busy_or_ready()

    def _busy_or_ready(self) -> None:
        if self.state.warm:
            self.state = WorkerState.BUSY if self.running else WorkerState.READY

    def _notify(self, what: str, call: Callable[[StageListener], None]) -> None:
        """Tell the listener; its failure (a full disk, a bug) must not stop this handle."""
        if self._listener is None:
            return
        try:
            call(self._listener)
        except Exception:
            # Not `event=`: that is the name of structlog's message argument.
            log.exception("handling a stage event failed", stage=self.label, what=what)

    # ------------------------------------------------------------------ death and restart

    def _close_log_pipe(self) -> None:
        """Store and forward what the worker wrote before it exited, then stop reading its pipe."""
        log_pipe, self._log_pipe = self._log_pipe, None
        if log_pipe is not None:
            log_pipe.drain()
            log_pipe.close()
            self._root_cause = log_pipe.causes.root_cause()

    def _on_exit_status(self, proc: BaseProcess) -> None:
        """The worker exited (`liveness` read its exit status; it stopped watching it)."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.drain()                # what it said before dying (LoadFailed, Failed ...)
            pipe.close()
        self._close_log_pipe()          # its last lines (a traceback) before the death is logged
        kill_group(proc.pid)            # anything the engine started dies with it
        code = proc.exitcode
        reason = f"worker (pid {proc.pid}) {describe_exit(code)}"
        if code == -signal.SIGKILL and not self.memory.we_killed and proc.pid is not None:
            reason += self.memory.oom_note(proc.pid)
        self._worker_gone(proc.pid, code, reason)

    def _worker_gone(self, pid: int | None, code: int | None, reason: str) -> None:
        """The worker is gone (exit status `code`, None when unknown): a planned stop, or a death
        the listener hears of, followed by a restart (or the stage's failure)."""
        if self._load_error:
            reason += f": {with_root_cause(self._load_error, self._root_cause)}"
        asked, self._restart_asked = self._restart_asked, None
        if not self._stopping and asked is None:    # a planned stop (shutdown, sleep, a restart) is no error
            self.last_error = reason
        self.running = ()
        # Fold this incarnation's counters into the totals, for monotonic metrics.
        self.totals = P.QueueStats(**{k: getattr(self.totals, k) + getattr(self.stats, k)
                                      for k in ("enqueued", "dequeued", "dropped", "blocked_s",
                                                "window_triggers", "cache_hits", "cache_misses")})
        self.stats = P.QueueStats()
        self.stats_at = 0.0
        for dst, n in self.windows.items():
            self.windows_before[dst] = self.windows_before.get(dst, 0) + n
        self.windows = {}
        if self._stopping:
            self.state = WorkerState.STOPPED
            self._attempt_over.set()
            return
        if asked is not None:           # a restart asked for: the next worker starts now
            log.info("stage worker stopped for a restart", stage=self.label, pid=pid, exit=code, reason=asked)
            self._notify("exit", lambda listener: listener.on_exit(self, f"restarted: {asked}"))
            self._attempt_over.set()
            self.state = WorkerState.RESTARTING
            self._restart_task = asyncio.get_running_loop().create_task(self._restart(0.0))
            return
        log.error("stage worker died", stage=self.label, pid=pid, exit=code, reason=reason)
        self._notify("exit", lambda listener: listener.on_exit(self, reason))
        # End the start attempt that is waiting (it holds the device load locks).
        self._attempt_over.set()
        if not self._became_ready and self.restarts == 0:
            self.state = WorkerState.FAILED     # the daemon's first start fails as a whole
            return
        self._schedule_restart(code)

    def _schedule_restart(self, code: int | None) -> None:
        decision = self._policy.on_exit(time.monotonic(), code)
        if isinstance(decision, GiveUp):
            self._fail_for_good(f"{self.last_error} ({decision.reason})")
            return
        self.state = WorkerState.RESTARTING
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(decision.delay_s))

    def _fail_for_good(self, error: str) -> None:
        self.state = WorkerState.FAILED
        self.last_error = error
        self._attempt_over.set()
        log.error("stage failed", stage=self.label, error=error)
        self._notify("failed", lambda listener: listener.on_failed(self, error))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self.restarts += 1
        try:
            await self.start()
        except Exception as e:             # e.g. spawn hit a file-descriptor limit: try again later
            log.exception("restarting the stage worker failed", stage=self.label)
            self.last_error = f"restart failed: {type(e).__name__}: {e}"
            self._schedule_restart(None)

    # ------------------------------------------------------------------ reload and restart

    def reconfigure(self) -> None:
        """A reload put a new workers' config in force: later spawns use it (this stage's definition
        in it may be new: `restart` applies it); the live worker learns the new pipelines and daemon
        settings now."""
        self.follow()
        self.send(P.Reconfigure(self.config))

    async def restart(self, reason: str, idle_timeout: float) -> None:
        """Replace the worker (its definition changed, or `omnictl stage restart`): its running jobs
        get up to `idle_timeout` to finish, then it is stopped and a new one started; a stage given
        up after a crash loop starts afresh. Returns once the new worker is ready (or failed).
        Jobs still running at the kill fail or retry as for any dead worker, with `reason`."""
        async with self._restarting:        # one restart at a time: two would start two workers
            await self._restart_now(reason, idle_timeout)

    async def _restart_now(self, reason: str, idle_timeout: float) -> None:
        deadline = time.monotonic() + idle_timeout
        while self.running and self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._policy = RestartPolicy.from_config(self.config.daemon)   # asked for: past crashes forgiven
        old = self.pid
        log.info("restarting stage", stage=self.label, pid=old, reason=reason)
        self.last_restart = {"reason": reason, "at": time.time()}
        if self.alive:
            # Stopped as at a shutdown (SIGKILL only past stop_grace_s); the exit handler starts the
            # next worker, and logs the exit as the restart it is, not as a death.
            self._restart_asked = reason
            await self._stop_for_restart(f"restarted: {reason}", self.config.daemon.stop_grace_s)
        elif self.state is not WorkerState.RESTARTING:
            self.restarts += 1
            await self.start()
            return
        limit = time.monotonic() + self.config.daemon.startup_timeout_s + 10
        while time.monotonic() < limit and not self._stopping:
            if self.state is WorkerState.FAILED or (self.state.warm and self.pid not in (None, old)):
                return
            await asyncio.sleep(0.05)

    async def _stop_for_restart(self, reason: str, grace: float) -> None:
        """End the worker for a restart: asked to stop (its engine closed), SIGKILLed only past `grace`."""
        proc = self.process
        if proc is None or not self.send(P.Shutdown()):
            self.kill(reason, counts=False)
            return
        await worker_process.end(proc, grace)

    async def wake(self) -> None:
        """Start a new worker after `stop` (its stage slept): as at the daemon's start, with its
        crash history forgotten; one that cannot load is given up (the listener hears it)."""
        if self._restart_task is not None:
            self._restart_task.cancel()
        self._stopping = False
        self._policy = RestartPolicy.from_config(self.config.daemon)
        self.state = WorkerState.STARTING
        await self.start()
        if not self._stopping and self.state is WorkerState.FAILED and not self._became_ready:
            self._fail_for_good(self.last_error or "could not load its engine")

    # ------------------------------------------------------------------ control

    def send(self, msg: object) -> bool:
        """Queue a control message; never blocks the event loop. False when there is no pipe."""
        return self._pipe is not None and self._pipe.send(msg)

    def kill(self, reason: str, counts: bool = True) -> None:
        """SIGKILL the worker (hung, or ignoring a cancel); the sentinel handler restarts it.

        `counts=False`: a kill the supervisor decided on for a job's sake (a cancel the stage
        ignored) does not count toward `max_restarts`.
        """
        proc = self.process
        if proc is not None and self.alive:
            self._policy.note_kill(counts)
            self.memory.we_killed = True
            log.warning("killing stage worker", stage=self.label, pid=proc.pid, reason=reason)
            self._load_error = reason
            kill_group(proc.pid)
            if proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def check_heartbeat(self) -> None:
        """Once a second: a hung worker killed, a lost exit handled (liveness.py), its memory watched."""
        self.liveness.check()
        self.memory.tend()

    async def stop(self, grace: float) -> None:
        """Shutdown: ask politely, wait `grace` seconds, then SIGKILL the process group."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        proc = self.process
        if proc is None or proc.exitcode is not None:
            self._close_log_pipe()
            self.state = WorkerState.STOPPED
            return
        self.send(P.Shutdown())
        # (one still loading, or waiting to, has nothing to finish: no grace)
        await worker_process.end(proc, grace if self.state.warm else 0.0)
        self._close_log_pipe()
        self.state = WorkerState.STOPPED

    # ------------------------------------------------------------------ inspection

    def usage(self) -> int | None:
        """The worker's resident memory with its children's (None: no worker now)."""
        pid = self.pid
        return self._sampler.sample(pid).rss_bytes if pid is not None else None

    def where(self) -> Where:
        """Where the worker runs (`GET /v1/stages`: `placement`, `node`)."""
        return {"placement": "local", "node": None}

    def _sample(self) -> Any:
        return self._sampler.sample(self.pid)

    def snapshot(self) -> WorkerDoc:
        pid = self.pid
        usage = self._sample()
        return {
            "name": self.name, "replica": self.replica, "label": self.label,
            "engine": self.stage.engine, "state": self.state, "pid": pid,
            "devices": list(self.stage.devices), "queue_depth": self.stats.depth,
            "queue_capacity": self.stage.queue_capacity, "max_inflight": self.stage.max_inflight,
            "running": list(self.running), "jobs_done": self.jobs_done,
            "restarts": self.restarts, "rss_restarts": self.rss_restarts, "rss_bytes": usage.rss_bytes, "cpu_percent": usage.cpu_percent,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "uptime_s": round(time.time() - self.ready_at, 3) if self.ready_at and pid else None,
            "load_s": round(self.load_s, 3) if self.load_s is not None else None,
            "spawned_at": self.started_at, "ready_at": self.ready_at, "tracked_jobs": self.tracked_jobs,
            "last_error": self.last_error, "last_restart": self.last_restart,
            "model": str(self.stage.model) if self.stage.model else None,
            "function": self.stage.function, "lazy": self.stage.lazy, "info": self.info,
            "shm": {"capacity_bytes": self.stats.shm_capacity, "used_bytes": self.stats.shm_used,
                    "slots": self.stats.shm_slots},
            **self.where(),
        }


# A worker's message -> what its handle makes of it (called with the handle). The listener hears of
# every message after it, but for a Batch (it hears of each of its messages) and a Heartbeat.
_HANDLERS: dict[type, Callable[[StageHandle, Any], None]] = {
    P.Batch: StageHandle._on_batch,
    P.Heartbeat: StageHandle._on_heartbeat,
    P.Ready: StageHandle._on_ready,
    P.LoadFailed: StageHandle._on_load_failed,
    P.Started: StageHandle._on_started,
    P.Finished: StageHandle._on_finished,
    P.Failed: StageHandle._on_ended,
    P.Stopped: StageHandle._on_ended,
}
_HANDLE_ONLY: frozenset[type] = frozenset({P.Batch, P.Heartbeat})
