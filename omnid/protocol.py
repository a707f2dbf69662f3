"""Messages between the supervisor and its stage workers (the control plane).

Both processes import this module; it must stay free of heavy imports. Every
message is a small frozen dataclass pickled over the worker's duplex control
pipe. Payloads (a stage's inputs and outputs) never travel here: they go from
stage to stage over the data plane (`omnid.dataplane`).

Supervisor -> worker: `Cancel`, `Forget`, `Resend`, `Reroute`, `Shutdown`, `Reconfigure`.
Worker -> supervisor: `Ready`, `LoadFailed`, `Heartbeat`, and the per-job
events `Admitted`, `Started`, `Progress`, `Segment`, `Output`, `Finished`,
`Failed`, `Stopped`, `Delivered`, `ResendMissing`; the main thread's messages
of one engine step travel together in a `Batch` (one pipe write, not one per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnid.config_types import Config
from omnid.vocabulary import ErrorCode

# A worker that cannot load its engine exits with this code, so the supervisor
# knows a restart would fail the same way (gunicorn's WORKER_BOOT_ERROR).
EXIT_LOAD_FAILED = 3
# A worker that saw its parent die exits with this code.
EXIT_ORPHANED = 4
EXIT_ENGINE_DIED = 5      # a vllm stage's engine core process died (engine_core = "process")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a stage worker needs, handed over at spawn (pickled once)."""

    stage: str
    config: Config
    data_dir: Path          # where every stage's data-plane socket lives
    jobs_dir: Path          # where sink stages write a job's outputs
    parent_pid: int
    replica: int = 0        # which of the stage's replicas this worker is

    def socket_for(self, address: str) -> Path:
        """The data-plane socket of a worker, by its `address(stage, replica)`."""
        return socket_path(self.data_dir, address)


def address(stage: str, replica: int = 0) -> str:
    """How the data plane names one replica of a stage: `draw.0`, `draw.1` (stage names have no dots)."""
    return f"{stage}.{replica}"


def parse_address(address: str) -> tuple[str, int]:
    """(stage, replica) of an `address(stage, replica)`."""
    stage, _, replica = address.rpartition(".")
    return stage, int(replica)


def socket_path(data_dir: Path, address: str) -> Path:
    return data_dir / f"{address}.sock"


def replica_label(stage: str, replica: int) -> str:
    """How logs and process titles name a replica: the stage's name alone for the first, `draw#1` after."""
    return stage if replica == 0 else f"{stage}#{replica}"


# --------------------------------------------------------------- supervisor -> worker


@dataclass(frozen=True)
class Cancel:
    """Stop this job: drop it if queued, abort it if running (idempotent)."""

    job: str
    reason: str = "cancelled"


@dataclass(frozen=True)
class Forget:
    """The job is terminal: drop every piece of state kept for it."""

    job: str


@dataclass(frozen=True)
class Resend:
    """Send this job's outputs to `dst` again (`dst` lost them when its worker died)."""

    job: str
    dst: str
    replica: int = 0        # the replica of `dst` the job goes to now


@dataclass(frozen=True)
class Reroute:
    """The job's work for stage `stage` goes to its replica `replica` from now on (the one it was
    given is down for good): hand-offs and windows not yet admitted go there."""

    job: str
    stage: str
    replica: int


@dataclass(frozen=True)
class Deadline:
    """A stream's listener runs out of audio at `at` (wall clock, time.time()), from the audio sent
    so far: a stage steps the jobs that run dry first before the others (`RequestContext.deadline`)."""

    job: str
    at: float


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Reconfigure:
    """The daemon reloaded its config: the pipelines (by the key jobs name them with) and daemon
    settings this worker uses from now on. The worker's own stage definition is unchanged (a
    changed stage gets a new worker instead)."""

    config: Config


# --------------------------------------------------------------- worker -> supervisor


@dataclass(frozen=True)
class Ready:
    pid: int
    load_s: float
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadFailed:
    error: str


@dataclass(frozen=True)
class QueueStats:
    """Cumulative counters of one worker's life (reset when it restarts)."""

    enqueued: int = 0
    dequeued: int = 0
    dropped: int = 0
    depth: int = 0
    blocked_s: float = 0.0          # time this stage spent blocked on a downstream watermark
    window_triggers: int = 0        # hand-offs sent downstream
    shm_capacity: int = 0           # the stage's shared-memory pool: its size,
    shm_used: int = 0               # the bytes in slots taken,
    shm_slots: int = 0              # and how many slots are taken (0 once every job's values are gone)
    cache_hits: int = 0             # a diffusers stage's DiT cache: transformer calls that skipped the
    cache_misses: int = 0           # remaining blocks, and calls that ran them all
    busy_s: float = 0.0             # wall seconds the engine spent stepping (not waiting for input)
    cpu_s: float = 0.0              # CPU seconds of the worker and its children (a vLLM core's process) since Ready


@dataclass(frozen=True)
class Heartbeat:
    ts: float
    stats: QueueStats
    running: tuple[str, ...] = ()
    gpu_memory_bytes: int | None = None
    tracked_jobs: int = 0           # jobs this worker still keeps state for (0 once all are forgotten)
    windows: tuple[tuple[str, int], ...] = ()   # (downstream stage, windows it admitted) since the start
    rss_bytes: int | None = None    # the worker's own resident memory, as it read it (what an OOM report gives)
    live_info: dict[str, Any] = field(default_factory=dict)   # the engine's changing facts (Engine.live_info)


@dataclass(frozen=True)
class Batch:
    """Several messages of one worker in one pipe write (what one engine step said), in order."""

    messages: tuple[object, ...]


@dataclass(frozen=True)
class Admitted:
    """The job's input for this stage entered its input queue (from `src`)."""

    job: str
    src: str | None
    depth: int


@dataclass(frozen=True)
class Started:
    job: str


@dataclass(frozen=True)
class Progress:
    job: str
    done: int
    total: int


@dataclass(frozen=True)
class Segment:
    job: str
    index: int
    is_last: bool
    text: str | None = None
    count: int = 1                  # segments coalesced into this one (their texts joined)
    audio_s: float = 0.0            # seconds of WAV audio the segment(s) carried (omnid.engines.base.audio_seconds)
    finish_reason: str | None = None    # the last segment of a text engine's answer: why it ended


@dataclass(frozen=True)
class Output:
    """A sink stage wrote one of the job's outputs into the job's folder."""

    job: str
    name: str
    file: str
    kind: str
    content_type: str
    size: int


@dataclass(frozen=True)
class Finished:
    job: str
    elapsed_s: float
    usage: dict[str, int] | None = None     # an engine's counts (vLLM: prompt and completion tokens)
    finish_reason: str | None = None        # why a text engine ended its answer ("stop", "length")


@dataclass(frozen=True)
class Delivered:
    """This stage's outputs for the job were admitted by downstream stage `dst`."""

    job: str
    dst: str


@dataclass(frozen=True)
class Failed:
    """A per-job error: the job fails, the engine keeps serving others."""

    job: str
    error: str
    code: ErrorCode = ErrorCode.STAGE_FAILED


@dataclass(frozen=True)
class ResendMissing:
    """This worker holds no outputs of the job for `dst` (it restarted since): compute them again."""

    job: str
    dst: str


@dataclass(frozen=True)
class Stopped:
    """A cancelled job's work has stopped in this stage."""

    job: str


# ------------------------------------------------------------------ a Ray-placed worker and its handle
# (worker/ray_actor.py, the actor; supervisor/workers/ray_stage.py, its handle in the supervisor)

# What the actor's `admit` answers (the handle's bridge turns it into the data plane's acknowledgements).
ADMITTED, DROPPED, FULL, CLOSING = "A", "D", "F", "C"
EXITING = "exiting"     # the worker's last message after a planned stop (Shutdown)
PLAIN = "plain"         # a request answer: send it again as a plain pickle (the receiver has no pool)


@dataclass(frozen=True)
class LogLines:
    """Lines the worker wrote to its stdout or stderr (its engine's too), for the supervisor, which
    keeps them in the stage's log file (`omnictl logs`) and forwards them to its own stderr."""

    lines: tuple[bytes, ...]


@dataclass(frozen=True)
class Usage:
    """The actor process's resident memory (with its children's) and CPU use, sampled on its node
    (the supervisor cannot: the process may be on another machine)."""

    rss_bytes: int | None
    cpu_percent: float | None
