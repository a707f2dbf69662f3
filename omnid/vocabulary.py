"""The words omnid and its clients share: states, event types, error codes, and the job record.

Imported by the supervisor, the stage workers and `omnictl`'s client library alike, so it uses
the standard library only (and `typing_extensions`' TypedDict, which pydantic reads on Python 3.11)
and does no work at import. Nothing here runs in a thread of its own or blocks.

Where to add things:
- a job state, a stage-run state or a worker state: the enums below (their values are the
  strings the API, the database and `omnictl` show);
- an event type: `EventType` (the scheduler emits it, `omnictl` renders it);
- an API error code: `ErrorCode` (the socket API answers it, `omnictl` and tests match on it);
- a field of a job: `JobRecord` / `StageRun` / `JobError` (their `to_doc` and `from_doc` follow
  the fields); a field of an event: `EventFields`.

These classes are the one definition of the job document and its events: the API's JSON is made
from their fields (`to_doc`), and the OpenAPI document's `Job`, `StageRun`, `JobError`, `Output`
and `Event` schemas are generated from them (supervisor/http/openapi_schemas.py, through pydantic,
which reads their types, and their attribute docstrings as the fields' descriptions; nothing here
imports it).

Every state change of a job or of a stage run goes through `JobRecord.set_state` /
`StageRun.set_state`, which also stamp the times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from typing_extensions import NotRequired, Required, TypedDict


class JobState(StrEnum):
    """A job's state. The last four are terminal: a job in one of them never changes again."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT})
LIVE_JOB_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})


class StageRunState(StrEnum):
    """One job's progress through one stage of its pipeline."""

    PENDING = "pending"          # its inputs are not there yet
    QUEUED = "queued"            # in the stage's input queue (or being re-sent after a restart)
    RUNNING = "running"          # in the engine
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"      # stopped because the job ended (cancel, timeout, a failure elsewhere)

    @property
    def busy(self) -> bool:
        """The stage may be working on the job (or about to: a queued item's Started may be on its way)."""
        return self in (StageRunState.QUEUED, StageRunState.RUNNING)

    @property
    def open(self) -> bool:
        """Not finished in this stage, one way or another."""
        return self in (StageRunState.PENDING, StageRunState.QUEUED, StageRunState.RUNNING)


class WorkerState(StrEnum):
    """A stage worker's life cycle, as `GET /v1/stages` and `/v1/ready` report it.

    starting -> waiting_for_device -> loading -> ready <-> busy; on death: restarting
    (backoff) -> loading ..., or failed when it keeps crashing or cannot load; stopped at shutdown.

    A stage (all its replicas) is also `degraded`: some replicas serve, others are down; and
    `sleeping`: idle for `idle_unload_s` (or put to sleep by hand), its workers stopped until a job
    wakes it.
    """

    STARTING = "starting"
    WAITING_FOR_DEVICE = "waiting_for_device"
    LOADING = "loading"
    READY = "ready"
    BUSY = "busy"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"
    DEGRADED = "degraded"           # a stage: some replicas serve, some are down
    SLEEPING = "sleeping"           # a stage (or replica): stopped while idle; the next job wakes it

    @property
    def warm(self) -> bool:
        """The engine is loaded and the worker takes jobs."""
        return self in WARM_WORKER_STATES

    @property
    def serving(self) -> bool:
        """A stage that takes jobs now or on demand: warm, degraded (some replicas up) or sleeping."""
        return self.warm or self in (WorkerState.DEGRADED, WorkerState.SLEEPING)


WARM_WORKER_STATES = frozenset({WorkerState.READY, WorkerState.BUSY})


class SleepState(StrEnum):
    """A stage's sleep (`idle_unload_s`, or `omnictl stage sleep`), as the supervisor keeps it.

    awake -> dozing (its workers stopping; a job that comes now wakes it again) -> asleep (its
    workers stopped, its GPUs let go) -> waking (its workers loading again) -> awake. What the API
    shows of it is `WorkerState.SLEEPING` (and `starting` once a wake is asked for).
    """

    AWAKE = "awake"
    DOZING = "dozing"
    ASLEEP = "asleep"
    WAKING = "waking"


class DaemonState(StrEnum):
    """The daemon's life: starting (until every stage's first workers are up; then a degraded stage
    counts as ready) -> serving -> draining (SIGTERM: no new job, the running ones finish) -> stopping
    (the workers stop; new jobs are turned away). A stop during the start goes to stopping at once."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


class EventType(StrEnum):
    """The `type` of a job's events (`GET /v1/jobs/{id}/events`)."""

    STATE = "state"                      # state (and error, when it ended badly)
    STAGE_STARTED = "stage_started"      # stage
    PROGRESS = "progress"                # stage, done, total
    SEGMENT = "segment"                  # stage, index, is_last, text?, audio_s? (seconds of WAV audio),
                                         # finish_reason? (a vllm stage's last segment)
    OUTPUT = "output"                    # name, file, kind, content_type, size, stage
    STAGE_FINISHED = "stage_finished"    # stage, elapsed_s
    ERROR = "error"                      # stage, code, message
    STAGE_WAKING = "stage_waking"        # stage: it was asleep; the job waits while it loads
    STAGE_AWAKE = "stage_awake"          # stage, load_s: it is awake again


class ErrorCode(StrEnum):
    """`error.code` of API replies, and of a failed job's `error`."""

    # requests the API refuses
    BAD_JSON = "bad_json"
    INVALID_REQUEST = "invalid_request"
    INVALID_INPUT = "invalid_input"
    MISSING_INPUT = "missing_input"
    INVALID_PARAM = "invalid_param"
    INVALID_MEDIA = "invalid_media"             # not an image / WAV, over a limit, more items than allowed
    MEDIA_NOT_ACCEPTED = "media_not_accepted"   # a media input for a stage whose model takes none
    PROMPT_TOO_LONG = "prompt_too_long"         # a text prompt over a first stage's max_model_len, in tokens
    UNKNOWN_PIPELINE = "unknown_pipeline"
    UNKNOWN_JOB = "unknown_job"
    AMBIGUOUS_JOB = "ambiguous_job"
    UNKNOWN_OUTPUT = "unknown_output"
    OUTPUT_GONE = "output_gone"
    JOB_NOT_FINISHED = "job_not_finished"
    NOT_YOURS = "not_yours"
    NO_CREDENTIALS = "no_credentials"
    TOO_LARGE = "too_large"
    QUEUE_FULL = "queue_full"
    OVER_CAPACITY = "over_capacity"    # 503: a real-time pipeline's streams fill its measured capacity
    SHUTTING_DOWN = "shutting_down"
    NOT_ADMIN = "not_admin"             # root or daemon.admin_group only (stage restart)
    UNKNOWN_STAGE = "unknown_stage"
    STAGE_BUSY = "stage_busy"           # a stage with jobs in progress is not put to sleep
    DRAINING = "draining"               # SIGTERM: no new jobs; running ones finish, queued ones wait for the next start
    INSUFFICIENT_STORAGE = "insufficient_storage"   # 507: the state dir is under daemon.min_free_mb (or cannot write)
    DISK_FULL = "disk_full"             # /v1/ready's reason while the state dir is short (and submits get 507)
    TOO_MANY_CONNECTIONS = "too_many_connections"   # 503: more clients than the open-files limit leaves room for
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    HTTP_ERROR = "http_error"
    INTERNAL_ERROR = "internal_error"
    # why a job ended badly (also STAGE_FAILED: a stage given up for good refuses new jobs with it)
    STAGE_FAILED = "stage_failed"
    INPUT_REJECTED = "input_rejected"   # the stage's engine refused the job's input (the caller's fault, not
                                        # the stage's: a 400 on the OpenAI paths)
    WORKER_DIED = "worker_died"
    EDGE_FAILED = "edge_failed"
    OUTPUT_FAILED = "output_failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    DAEMON_STOPPING = "daemon_stopping"
    DAEMON_RESTARTED = "daemon_restarted"
    WAKE_FAILED = "wake_failed"         # a sleeping stage could not be loaded again
    # the TCP listener's door (supervisor/access.py)
    INVALID_API_KEY = "invalid_api_key"         # 401: no key, or not one of the daemon's
    RATE_LIMITED = "rate_limited"               # 429: a key's requests per second or live jobs
    UNKNOWN_KEY = "unknown_key"
    KEY_EXISTS = "key_exists"
    SOCKET_ONLY = "socket_only"                 # 403: API keys are managed over the Unix socket only
    # the OpenAI-compatible paths' own (supervisor/http/openai/)
    MODEL_NOT_FOUND = "model_not_found"         # 404: no pipeline of that name
    MODEL_NOT_SUPPORTED = "model_not_supported"  # 400: the pipeline does not produce what the path gives
    NO_IMAGE = "no_image"                       # 500: an image pipeline's job produced none
    # who goes first (omnid/fair_queue.py)
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"   # 403: more urgent than the owner's max_priority
    OWNER_QUEUE_FULL = "owner_queue_full"           # 429: the owner's max_queued jobs are queued already
    # a stage's LoRA adapters at run time (supervisor/http/api/adapters.py)
    UNKNOWN_ADAPTER = "unknown_adapter"         # 404: the stage has no adapter of that name
    ADAPTER_EXISTS = "adapter_exists"           # 409: it has one already (remove it first)
    INVALID_ADAPTER = "invalid_adapter"         # 400: no LoRA there, a rank too high, another base; 409: no lora table


# ------------------------------------------------------------------------------ the job record


class StageProgress(TypedDict):
    """A stage's `progress` in the job document: steps done, of how many (null: unknown)."""

    done: int
    total: NotRequired[int | None]


class JobOutput(TypedDict):
    """One output file of a job: an item of its document's `outputs`, and its `output` event."""

    name: str
    file: str
    kind: str
    content_type: str
    size: NotRequired[int]
    stage: NotRequired[str]


@dataclass
class StageRun:
    """One job's run through one stage: `stages.NAME` in the job document."""

    state: StageRunState = StageRunState.PENDING
    progress: StageProgress | None = None
    started_at: float | None = None
    finished_at: float | None = None
    elapsed_s: float | None = None
    segments: int = 0
    replica: int | None = None
    """which replica of the stage serves the job (chosen by load at submit)"""

    def set_state(self, state: StageRunState, now: float) -> None:
        """Change state, stamping `started_at` on running and `finished_at` when it ends."""
        self.state = state
        if state is StageRunState.RUNNING:
            self.started_at = now
        elif not state.open:
            self.finished_at = now

    def to_doc(self) -> dict[str, Any]:
        doc = self.__dict__.copy()          # (its fields, in order: a copy is quicker than a literal of them)
        doc["state"] = str(self.state)
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> StageRun:
        fields = _known(cls, doc)
        fields["state"] = _RUN_STATES.get(doc["state"]) or StageRunState(doc["state"])
        fields["segments"] = int(doc.get("segments", 0))
        return cls(**fields)


JOB_LINKS = ("self", "events", "cancel", "outputs")


def job_links(job_id: str) -> dict[str, str]:
    """The paths of a job, as a 201 names them (`outputs`: the prefix of `/outputs/{name}`)."""
    base = f"/v1/jobs/{job_id}"
    return {"self": base, "events": f"{base}/events", "cancel": f"{base}/cancel", "outputs": f"{base}/outputs"}


@dataclass(frozen=True)
class JobError:
    """Why a job ended badly: its document's and its last state event's `error`,
    `{"code", "message", "stage"}` (`stage`: where it happened, when one stage is to blame)."""

    code: ErrorCode
    message: str
    stage: str | None = None

    def to_doc(self) -> dict[str, Any]:
        doc = self.__dict__.copy()
        doc["code"] = str(self.code)
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> JobError:
        try:
            code = ErrorCode(str(doc.get("code")))
        except ValueError:          # (a code this version no longer has, in an old record)
            code = ErrorCode.INTERNAL_ERROR
        return cls(code, str(doc.get("message") or ""), doc.get("stage"))


@dataclass(kw_only=True)
class JobRecord:
    """A job as the API shows it and the store keeps it."""

    # Its fields, in this order, are its document's keys (`to_doc`): the order is part of the API's bytes.

    id: str
    pipeline: str
    state: JobState = JobState.QUEUED
    owner_uid: int
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    timeout_s: float
    inputs: dict[str, Any]
    """a summary: long texts clipped, files as name and size"""
    params: dict[str, dict[str, Any]]
    stages: dict[str, StageRun]
    outputs: list[JobOutput] = field(default_factory=list)
    error: JobError | None = None
    priority: int = 0
    """lower runs earlier"""
    key: str | None = None
    """the API key it came with (TCP); fair share's owner"""

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def set_state(self, state: JobState, now: float, error: JobError | None = None) -> None:
        """Change state, stamping `started_at` on running and `finished_at` (and `error`) at the end."""
        self.state = state
        if state is JobState.RUNNING:
            self.started_at = now
        elif state.terminal:
            self.finished_at = now
            self.error = error

    def to_doc(self) -> dict[str, Any]:
        doc = self.__dict__.copy()          # its fields, in order
        doc["state"] = str(self.state)
        doc["stages"] = {name: run.to_doc() for name, run in self.stages.items()}
        doc["error"] = self.error.to_doc() if self.error else None
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> JobRecord:
        fields = _known(cls, doc)
        fields["state"] = _JOB_STATES.get(doc["state"]) or JobState(doc["state"])
        fields["owner_uid"] = int(doc["owner_uid"])
        fields["stages"] = {n: StageRun.from_doc(s) for n, s in doc["stages"].items()}
        fields["outputs"] = list(doc.get("outputs") or [])
        fields["error"] = JobError.from_doc(doc["error"]) if doc.get("error") else None
        fields["priority"] = int(doc.get("priority") or 0)
        return cls(**fields)


def _known(cls: type, doc: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a stored document that are fields of `cls` (an older record may lack some: their
    defaults stand; a key this version no longer has is dropped)."""
    names = _FIELD_NAMES[cls]
    return dict(doc) if doc.keys() <= names else {k: v for k, v in doc.items() if k in names}


_FIELD_NAMES: dict[type, frozenset[str]] = {cls: frozenset(f.name for f in fields(cls)) for cls in (StageRun, JobRecord)}
# (a dict finds a state by its value in a tenth of the time the enum's call takes: a record read back
# from the store has one per stage)
_JOB_STATES = {str(s): s for s in JobState}
_RUN_STATES = {str(s): s for s in StageRunState}


# ------------------------------------------------------------------------------ the events


class EventFields(TypedDict, total=False):
    """What a job's event says besides its `type`, `job` and `ts` (`EventStream.emit`'s keywords); which
    type says what: `EventType`."""

    stage: str
    state: JobState
    error: dict[str, Any] | None
    """state, when the job ended badly: why"""
    done: int
    total: int | None
    index: int
    is_last: bool
    text: str
    audio_s: float
    """seconds of the segment's WAV audio"""
    code: ErrorCode
    message: str
    elapsed_s: float | None
    wake_s: float | None
    usage: dict[str, int]
    finish_reason: str
    """stage_finished of a vllm stage, and its last segment: why its answer ended, "stop" (an end token, a stop string) or
    "length" (max_tokens, or the context window full)"""
    trace_id: str
    """state queued, with tracing on: the job's trace"""
    name: str
    file: str
    kind: str
    content_type: str
    size: int


class Event(EventFields, total=False):
    """A job's event (`GET /v1/jobs/{id}/events`, the job store's `events`)."""

    type: Required[EventType]
    job: Required[str]
    ts: Required[float]
