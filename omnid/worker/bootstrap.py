"""A stage worker process's first moments: its output, its environment (its name and its tie to its
parent are asked of the kernel by `omnid.prctl`).

Used by both kinds of worker, before the engine (or anything heavy) is imported: a local worker
(`omnid.worker.main.worker_main`, a spawned child of the supervisor) and a Ray-placed one
(`omnid.worker.ray_actor.StageActor`). Everything here runs once, in the thread that starts the
worker, and does not block; `clip` is used by any thread.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from omnid import protocol as P
from omnid.engines.capabilities import capabilities


def setup_environment(spec: P.WorkerSpec) -> None:
    """Device visibility and quiet, offline libraries, before any heavy import."""
    stage = spec.config.stages[spec.stage].for_replica(spec.replica)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in stage.devices)
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):   # systemd talks to the supervisor only
        os.environ.pop(var, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for k, v in capabilities(stage.engine).worker_env:
        os.environ.setdefault(k, v)
    for k, v in stage.env.items():
        os.environ[k] = v
    # The stage's python_path serves its function and the transforms of its outgoing edges.
    sys.path[:0] = [str(p) for p in stage.python_path if str(p) not in sys.path]


def clip(text: str, limit: int = 2000) -> str:
    """Keep control messages small: one write into the pipe, read whole by the supervisor."""
    return text if len(text) <= limit else text[:limit] + " [...]"


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
