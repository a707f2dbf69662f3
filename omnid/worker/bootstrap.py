"""A stage worker's start-up, one for both kinds of worker: a local one (`worker_main`, the entry
point of a process the supervisor spawns) and a Ray-placed one (`omnid.worker.ray_actor`'s
`RayStart`, inside its actor).

`Start.run` is the start-up, in order: the process's own set-up (its tie to its parent, its output,
its name), its environment (before anything heavy is imported), its logging, a `StageWorker` and its
control thread, the engine (and the data plane that feeds it), `Ready` (or `LoadFailed`), the
heartbeat, and the busy loop; the process exits when the loop ends. What differs between the two
kinds is a hook each (`Start`'s methods that say "where this worker runs"); `LocalStart` is the
local worker's, `RayStart` the Ray actor's.

Everything here runs once, in the thread that starts the worker (a local worker's main thread, the
actor's `stage-main`), and does not block until the busy loop. The process's name and its tie to its
parent are asked of the kernel by `omnid.prctl`.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from omnid import protocol as P
from omnid.dataplane import cuda_ipc
from omnid.dataplane.listener import Listener
from omnid.dataplane.shm import ShmPool
from omnid.engines.capabilities import capabilities
from omnid.prctl import die_with_parent, set_process_name
from omnid.worker.main import StageWorker
from omnid.worker.reporter import ControlChannel, clip


def worker_main(spec: P.WorkerSpec, conn: Connection, log_pipe: Connection | None = None) -> None:
    """A local worker's entry point (spawned). `log_pipe`: the write end of this stage's stdout/stderr pipe."""
    LocalStart(spec, conn, log_pipe).run()


class Start:
    """A stage worker's start-up (`run`); a subclass says where the worker runs (the hooks)."""

    def __init__(self, spec: P.WorkerSpec, conn: ControlChannel) -> None:
        self.spec = spec
        self.conn = conn

    def run(self) -> NoReturn:
        label = P.replica_label(self.spec.stage, self.spec.replica)
        log_format = self.own_process()             # before anything is printed
        set_process_name(f"omnid:{label}")
        spec = self.spec = self.environment(self.spec)
        from omnid import logs
        logs.configure(spec.config.daemon.log_level, log_format, process=f"stage:{label}",
                       stage=spec.stage)             # every record, the engine's too: structlog, `stage=NAME`
        if spec.replica:
            import structlog
            structlog.contextvars.bind_contextvars(replica=spec.replica)
        worker = self.make_worker(spec)
        threading.Thread(target=worker.control_loop, name="control", daemon=True).start()
        t0 = time.monotonic()
        try:
            from omnid.engines import load_engine
            worker.engine = load_engine(worker.stage)
            logs.adopt_library_loggers()               # the loggers the engine's libraries set up on import
            self.open_data_plane(worker)
        except BaseException as e:
            tb = traceback.format_exc(limit=-3)
            worker.send(P.LoadFailed(error=clip(f"{type(e).__name__}: {e}\n{tb}")))
            self.load_failed()
            os._exit(P.EXIT_LOAD_FAILED)
        info = dict(worker.engine.info())
        self.ready(worker, info)
        freeze_heap()
        worker.mark_ready()
        worker.send(P.Ready(pid=os.getpid(), load_s=time.monotonic() - t0, info=info))
        threading.Thread(target=worker.heartbeat_loop, name="heartbeat", daemon=True).start()
        self.serving()
        try:
            worker.run()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        if worker.tracer is not None:
            worker.tracer.shutdown()        # its last spans go out (bounded by the export timeout)
        self.stopped(worker)
        os._exit(0)

    # ------------------------------------------------------------------ where this worker runs

    def own_process(self) -> str:
        """The process's own set-up, first of all: where its output goes. Returns the log format."""
        raise NotImplementedError

    def environment(self, spec: P.WorkerSpec) -> P.WorkerSpec:
        """Set up the process's environment (`setup_environment`); the spec as this worker sees it."""
        setup_environment(spec)
        return spec

    def make_worker(self, spec: P.WorkerSpec) -> StageWorker:
        return StageWorker(spec, self.conn)

    def open_data_plane(self, worker: StageWorker) -> None:
        """Once the engine is loaded: how its inputs will come (not served before `ready`)."""

    def load_failed(self) -> None:
        """`LoadFailed` was sent: the process exits next."""

    def ready(self, worker: StageWorker, info: dict[str, Any]) -> None:
        """The engine is loaded (its `info`, which `Ready` carries, is sent next): serve its inputs."""

    def serving(self) -> None:
        """`Ready` was sent and the heartbeat runs; the busy loop runs next."""

    def stopped(self, worker: StageWorker) -> None:
        """The busy loop ended (a planned stop): the process exits next."""


class LocalStart(Start):
    """A local worker: a process the supervisor spawned, tied to it (PR_SET_PDEATHSIG, and EOF on the
    control pipe), its fds 1 and 2 the stage's log pipe (`capture_output`), its inputs through its
    own data-plane listener."""

    def __init__(self, spec: P.WorkerSpec, conn: Connection, log_pipe: Connection | None) -> None:
        super().__init__(spec, conn)
        self._pipe = conn
        self.log_pipe = log_pipe
        self.listener: Listener | None = None

    def own_process(self) -> str:
        die_with_parent(self.spec.parent_pid)
        log_format = capture_output(self.log_pipe, self.spec.config.daemon.log_format)
        os.setpgrp()                                   # our own group: the supervisor signals the whole tree
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the supervisor's to handle
        return log_format

    def open_data_plane(self, worker: StageWorker) -> None:
        stage, spec = worker.stage, self.spec
        if stage.shm_pool_mb:
            worker.pool = ShmPool(stage.name, stage.shm_pool_mb << 20)
        # A stage on GPUs tells its senders which (by UUID): a CUDA tensor on one of them comes by
        # CUDA IPC, one copy on that GPU (omnid.dataplane.cuda_ipc); any other is staged through the pool.
        self.listener = worker.listener = Listener(spec.socket_for(P.address(spec.stage, spec.replica)), worker.admit,
                                                   worker.pool, device="cuda" if stage.devices else None,
                                                   gpus=cuda_ipc.visible_gpus if stage.devices else None)

    def load_failed(self) -> None:
        self._pipe.close()

    def ready(self, worker: StageWorker, info: dict[str, Any]) -> None:
        assert self.listener is not None
        self.listener.start()


# Offline, quiet libraries: every worker's environment defaults (the fork server's too: omnid.worker.preload).
QUIET_ENV = (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
             ("TRANSFORMERS_VERBOSITY", "error"), ("DIFFUSERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"))


def setup_environment(spec: P.WorkerSpec) -> None:
    """Device visibility and quiet, offline libraries, before any heavy import."""
    stage = spec.config.stages[spec.stage].for_replica(spec.replica)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in stage.devices)
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):   # systemd talks to the supervisor only
        os.environ.pop(var, None)
    for k, v in QUIET_ENV:
        os.environ.setdefault(k, v)
    for k, v in capabilities(stage.engine).worker_env:
        os.environ.setdefault(k, v)
    for k, v in stage.env.items():
        os.environ[k] = v
    # The stage's python_path serves its function and the transforms of its outgoing edges.
    sys.path[:0] = [str(p) for p in stage.python_path if str(p) not in sys.path]


def capture_output(log_pipe: Connection | None, log_format: str) -> str:
    """fds 1 and 2 -> the stage's log pipe, whose lines the supervisor stores in the stage's log file
    and forwards, unchanged, to its own stderr (supervisor/stage_logs.py). Returns the log format to
    use: the one the daemon's stderr calls for (`auto` looks at it here, before it is replaced).

    Without a pipe (a caller of its own): stdout joins stderr, one stream as before.
    """
    from omnid import logs
    fmt, journald = logs.resolve_format(log_format, sys.stderr)
    if log_pipe is None:
        os.dup2(2, 1)
        return fmt
    os.dup2(log_pipe.fileno(), 1)
    os.dup2(log_pipe.fileno(), 2)
    log_pipe.close()
    if journald:
        # Our lines reach journald through the supervisor unchanged: this pipe is the journal stream
        # for us and our engine's children (`logs.on_journald` then writes the `<N>` priority prefixes).
        st = os.fstat(2)
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    import io
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)   # a `print` reaches `omnictl logs -f` at once
    return fmt


def freeze_heap() -> None:
    """What this process has made so far, out of the cyclic collector's sight: a worker's loaded engine
    before its first job (here), a fork server's imports before it forks (preload.py). The loaded
    engine (its modules, the model's modules and parameters: hundreds of thousands of objects) lives
    as long as the worker, and a full collection then walks only what serving made. Measured on the
    demo's omni stages: unfrozen, a full collection stood a talker's or code2wav's busy loop 200-320
    ms, and the thinker's worker 450-590 ms (once mid-stream: every stream's next packet that late);
    frozen, no pause over 2 ms while streams played. vLLM's own engine core freezes its start the
    same way (`freeze_gc_heap`)."""
    gc.collect()
    gc.freeze()
