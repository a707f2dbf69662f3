"""The parsed configuration's types: frozen dataclasses, what `omnid.config` parses a TOML file into.

Standard library only (and `omnid.media`'s limits; typing_extensions' TypedDict for the documents
the API makes of them): every process reads them, and the engines and the control protocol name them
from below the parser (`omnid.config`, which also names them, imports the engines' declarations). The
parsed `Config` is handed to every stage worker at spawn, so it must stay picklable. Nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from typing_extensions import TypedDict

from omnid.media import NO_MEDIA, MediaLimits

FULL_WINDOW = -1                        # an edge's `window` for a full trigger (no streaming)


@dataclass(frozen=True)
class OwnerPolicy:
    """What one owner may ask of the queues (`[daemon.owners.WHO]`: "default", a uid, or "key:NAME";
    a key's entry over its uid's over "default"; a field left out is the next one's)."""

    weight: float | None = None         # its share within a priority level (fair share); 1
    max_priority: int | None = None     # the most urgent (lowest) priority its jobs may ask; 0 (root on the socket: any)
    max_queued: int | None = None       # its jobs queued at once; past it: 429 with Retry-After (none)


@dataclass(frozen=True)
class TracingConfig:
    """`[daemon] tracing = { ... }`: OpenTelemetry traces of the jobs, exported over OTLP/HTTP (off
    when the table is absent). Every process exports its own spans (the supervisor's job spans, each
    stage worker's stage spans, a vLLM stage's engine its request spans) to `otlp_endpoint`."""

    otlp_endpoint: str = "http://127.0.0.1:4318"   # the receiver's base URL; spans go to <it>/v1/traces
    sample: float = 1.0             # the share of new traces kept (a caller's sampled flag is followed)
    service_name: str = "omnid"     # `service.name` of the spans (a stage's: "<it>:<stage>")

    @property
    def traces_url(self) -> str:
        base = self.otlp_endpoint.rstrip("/")
        return base if base.endswith("/v1/traces") else base + "/v1/traces"


@dataclass(frozen=True)
class DaemonConfig:
    socket: Path
    state_dir: Path
    lock_dir: Path
    max_queued_jobs: int = 256
    default_timeout_s: float = 600.0
    socket_mode: int = 0o660
    socket_group: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    startup_timeout_s: float = 900.0
    cancel_grace_s: float = 5.0
    stop_grace_s: float = 10.0
    drain_timeout_s: float = 60.0           # SIGTERM: how long running jobs may take to finish
    admin_group: str | None = None          # besides root, who may restart stages
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    log_level: str = "info"
    log_format: str = "auto"                # auto: json unless stderr is a terminal (journald: json); console; json
    shm_min_bytes: int = 1 << 20            # values from this size cross stages through shared memory
    keep_jobs_days: float = 30.0            # retention: finished jobs created longer ago are removed (0: off)
    keep_jobs: int = 10000                  # retention: finished jobs past this many, oldest first, removed (0: off)
    retention_interval_s: float = 60.0      # how often retention runs (and once at start)
    client_idle_timeout_s: float = 30.0     # a connection with no request (or half of one) this long is closed
    metrics_listen: tuple[str, int] | None = None   # ("127.0.0.1", 9464): /metrics over TCP too (off)
    log_file_max_bytes: int = 10 << 20      # <state_dir>/logs: each stage's and the daemon's file rotates at this size
    log_file_keep: int = 3                  # ... keeping this many rotated files (.1 .2 .3) besides the current one
    ray_address: str | None = None          # the Ray cluster of `placement = "ray"` stages ("HOST:6379", "auto")
    # A CPU stage's worker (no `devices`, no `env` of its own) is forked from a server that has its
    # engine's libraries imported already (omnid.worker.preload), not spawned bare: ~12 CPU-s less a vLLM start.
    preload_workers: bool = True
    # The TCP listener (off): the socket's application on these addresses, each request with an API key.
    listen: tuple[tuple[str, int], ...] = ()
    allow_origins: tuple[str, ...] = ()     # CORS on the TCP listener: browser origins let in ("*": any); off
    metrics_without_key: bool = False       # GET /metrics on the TCP listener answers without a key
    # Resources (omnid.supervisor.resources): below either floor on the state dir's filesystem, /v1/ready
    # is 503 `disk_full` and submits get 507; `ballast_mb` is set aside in <state_dir>/ballast and given
    # back when a write of the store finds the disk full, so rm, retention and a restart still work.
    min_free_mb: int = 512
    min_free_inodes: int = 1024
    ballast_mb: int = 32
    # Who goes first (omnid/fair_queue.py): fair share between owners within a priority level, the
    # bound on a job's wait in one queue, and each owner's policy ("default", "UID", "key:NAME").
    fair_share: bool = True
    max_wait_s: float = 300.0
    owners: Mapping[str, OwnerPolicy] = field(default_factory=dict)

    tracing: TracingConfig | None = None    # OpenTelemetry traces (omnid.tracing); None: off
    # OpenAI's Realtime API (GET /v1/realtime): sessions open at once, in all and per key (per uid on
    # the socket); a session with no client event this long (and no response under way) is closed.
    max_realtime_sessions: int = 64
    max_realtime_sessions_per_key: int = 8
    realtime_idle_timeout_s: float = 600.0
    # the pipeline that transcribes a session's audio turns when a client asks (input transcription);
    # None: a session's `transcription` stays null
    realtime_transcription: str | None = None

    def owner_policy(self, uid: int, key: str | None, socket: bool) -> tuple[float, int | None, int | None]:
        """(weight, max_priority, max_queued) of a caller: its key's entry, its uid's, "default"."""
        entries = [self.owners.get(f"key:{key}") if key else None, self.owners.get(str(uid)), self.owners.get("default")]
        found = [e for e in entries if e is not None]
        weight = next((e.weight for e in found if e.weight is not None), 1.0)
        root = socket and uid == 0          # root on the socket: bound only by an entry of its own ("0")
        own = [e for e in entries[:2] if e is not None] if root else found
        top = next((e.max_priority for e in own if e.max_priority is not None), None if root else 0)
        queued = next((e.max_queued for e in found if e.max_queued is not None), None)
        return weight, top, queued


@dataclass(frozen=True)
class RayNeeds:
    """What a Ray-placed stage worker asks of the cluster (its actor's resource options)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_mb: int | None = None                                    # a scheduling hint, in MiB
    resources: Mapping[str, float] = field(default_factory=dict)    # custom resources: {"node2": 1}
    labels: Mapping[str, str] = field(default_factory=dict)         # a node label selector: {"zone": "b"}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_mb:
            opts["memory"] = self.memory_mb << 20
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.labels:
            opts["label_selector"] = dict(self.labels)
        return opts


@dataclass(frozen=True)
class LoraConfig:
    """A stage's `lora` table: its adapters (name -> folder) and vLLM's LoRA limits.

    `adapters` is not part of the stage's definition when comparing (`compare=False`): adapters come
    and go at run time (`POST /v1/stages/{name}/adapters`) and by a reload without a new worker; the
    worker learns the set in force from its `Reconfigure`."""

    adapters: Mapping[str, Path] = field(default_factory=dict, compare=False)
    max_loras: int = 4              # vllm: adapters in one batch (vLLM's max_loras)
    max_lora_rank: int = 16         # the highest rank an adapter may have (vLLM's max_lora_rank)


@dataclass(frozen=True)
class StageConfig:
    name: str
    engine: str
    model: Path | None = None
    function: str | None = None
    python_path: tuple[Path, ...] = ()
    devices: tuple[int, ...] = ()
    exclusive: bool = False
    max_inflight: int = 1
    queue_capacity: int = 4
    shm_pool_mb: int = 1024                 # the stage's shared-memory pool for large inputs (0: none)
    args: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    # python stages: `package.module:function` called once for up to max_inflight queued requests,
    # fn(inputs: list[dict], params: list[dict], ctxs: list[RequestContext]) -> list[dict | Exception]
    batch_function: str | None = None
    # python stages: `package.module:Class` whose instance steps many jobs' sessions together
    # (`open` a session per job, `step` them all as one batch): omnid.engines.python_sessions
    sessions: str | None = None
    # python stages: the kinds of output it gives ("text", "audio", ...), known before any job runs:
    # its `produces` key, else its function's (or class's) own `produces` attribute, read from its source
    produces: tuple[str, ...] | None = None
    # Capacity: `replicas` workers of this stage, each with its own device set (`replica_devices`,
    # from `devices = [[0], [1]]`; empty: every replica gets `devices`). `devices` is their union.
    replicas: int = 1
    replica_devices: tuple[tuple[int, ...], ...] = ()
    idle_unload_s: float | None = None      # no work this long: the workers stop (sleeping) until a job comes
    lazy: bool = False                      # python: its function's `load` hook is not called at start (the
                                            # function loads what it needs on its first job)
    max_rss_mb: int | None = None           # a leak guard: a worker over this RSS is restarted between jobs
    # vllm stages: where vLLM's engine core (scheduler and forward) runs: "inline", in the worker's own
    # thread between omnid's work, or "process", a child process of the worker that steps while the
    # worker turns the last step's outputs into segments (how `vllm serve` runs it)
    engine_core: str = "process"
    # diffusers stages with max_inflight > 1: "step", a job joins the running batch at the next
    # denoising step (omnid's own loop, for the pipelines it drives), or "call", one pipeline call per batch
    batching: str = "step"
    # vllm stages: the media (image, audio, video) a job may give it, and their limits
    media: MediaLimits = NO_MEDIA
    # `placement = "ray"`: the workers run as Ray actors (`ray`: their resource needs); a list gives one
    # placement per replica ("local" or "ray"). Empty: every replica is a local process.
    placement: tuple[str, ...] = ()
    ray: RayNeeds = field(default_factory=RayNeeds)
    # vllm stages, tensors: `outputs` (what every job gives besides text: token_ids, hidden_states),
    # `hidden_layers` (transformers' output_hidden_states indices; -1: after the final norm),
    # `hidden_prompt` (the prompt's rows too), `prompt_embeds` (a job may give embeddings).
    outputs: tuple[str, ...] = ()
    hidden_layers: tuple[int, ...] = (-1,)
    hidden_prompt: bool = False
    prompt_embeds: bool = False
    # Derived at parse time from every pipeline: the tensor outputs some edge (or `outputs`) asks of
    # this stage, and whether some edge hands it prompt_embeds. A change restarts the worker.
    tensor_outputs: frozenset[str] = frozenset()
    takes_embeds: bool = False
    # diffusers stages: a DiT cache (`cache = { kind = "first_block", threshold = 0.2 }`), checked
    # against CACHE_KINDS; empty: none. The engine maps it onto diffusers' own cache config.
    cache: Mapping[str, Any] = field(default_factory=dict)
    # vllm and diffusers stages: LoRA adapters (`lora = { adapters = {...}, max_loras, max_lora_rank }`);
    # None: none (vLLM's LoRA off)
    lora: LoraConfig | None = None

    @property
    def adapters(self) -> Mapping[str, Path]:
        """The stage's adapters in force, by name (none without a `lora` table)."""
        return self.lora.adapters if self.lora is not None else {}

    def with_adapters(self, adapters: Mapping[str, Path]) -> StageConfig:
        """This stage with another adapter set (run-time adds and removes)."""
        return replace(self, lora=replace(self.lora or LoraConfig(), adapters=dict(adapters)))

    def placement_of(self, replica: int) -> str:
        """"local" or "ray": where replica `replica`'s worker runs."""
        if not self.placement:
            return "local"
        return self.placement[replica] if len(self.placement) > 1 else self.placement[0]

    def devices_of(self, replica: int) -> tuple[int, ...]:
        """The GPUs replica `replica` runs on."""
        return self.replica_devices[replica] if self.replica_devices else self.devices

    def for_replica(self, replica: int) -> StageConfig:
        """This stage as one replica's worker sees it: `devices` are that replica's own."""
        if not self.replica_devices:
            return self
        return replace(self, devices=self.devices_of(replica), replica_devices=())

    def same_worker(self, other: StageConfig, replica: int) -> bool:
        """Would replica `replica` of `other` be the same worker as of this one? (A reload that
        changes only `replicas`, `idle_unload_s` or other replicas' devices keeps it running.)"""
        if replica >= other.replicas or replica >= self.replicas:
            return False
        fleet = ("replicas", "replica_devices", "idle_unload_s", "devices", "max_rss_mb")
        mine = replace(self, **{k: getattr(other, k) for k in fleet})
        return mine == other and self.devices_of(replica) == other.devices_of(replica)


# An edge as the API shows it (GET /v1/pipelines): `window` -1 (full trigger), N (segments per window)
# or a schedule [N1, N2, ...] (the last repeats). ("from" is a keyword: the functional form.)
EdgeDoc = TypedDict("EdgeDoc", {"from": str, "to": str, "window": int | list[int], "map": dict[str, str] | None,
                                "transform": str | None})


class PipelineDoc(TypedDict):
    """A pipeline as the API shows it (GET /v1/pipelines, and the start of GET /v1/pipelines/{name})."""

    name: str
    stages: list[str]
    edges: list[EdgeDoc]
    sources: list[str]
    """its stages fed by the job's own inputs"""
    sinks: list[str]
    """its stages whose outputs are the job's"""
    kept_outputs: dict[str, list[str]]
    """the config's `outputs`: outputs of stages that are not last kept as the job's too"""
    timeout_s: float | None
    retries: int


@dataclass(frozen=True)
class EdgeConfig:
    src: str
    dst: str
    window: int = FULL_WINDOW           # -1: full trigger; else the (first) window's segment count
    map: Mapping[str, str] | None = None
    transform: str | None = None
    # `window = [4, 8, 16, 25]`: the window sizes in order, the last one repeating (`window` is
    # the first); empty for `window = N`.
    schedule: tuple[int, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        """The window sizes of a streaming edge, in order; the last one repeats."""
        return self.schedule or (self.window,)

    def as_api(self) -> EdgeDoc:
        return {"from": self.src, "to": self.dst, "window": list(self.schedule) if self.schedule else self.window,
                "map": dict(self.map) if self.map is not None else None,
                "transform": self.transform}


Overload = Literal["queue", "refuse"]
OVERLOAD_MODES: tuple[str, ...] = get_args(Overload)


@dataclass(frozen=True)
class RealtimeConfig:
    """`[pipelines.X] realtime = { ... }`: the pipeline's jobs are streams a listener plays as they
    come, admitted only while the pipeline's measured capacity keeps the admitted ones on time
    (omnid/supervisor/jobs/admission_gate.py)."""

    overload: Overload = "queue"        # past capacity: "queue" (wait, bounded) or "refuse" (503 at once)
    max_waiting_streams: int = 16       # "queue": streams that may wait; past it, 503 as in "refuse"
    margin: float = 0.9                 # admit while the streams stay under margin x the capacity measured
    start_slack_s: float = 0.0          # a new stream starts only once every running one that began less
                                        # than RAMP_S ago holds this much audio at its listener, or
                                        # MAX_HOLD_S has passed (0: off)
    warmup: Mapping[str, Any] | None = field(default_factory=lambda: {"prompt": "warm up"})
                                        # the inputs of the warm-up job run before the pipeline is ready
                                        # (and after a restart of one of its stages); None: no warm-up
    warmup_params: Mapping[str, Any] = field(default_factory=dict)




@dataclass(frozen=True)
class PipelineConfig:
    name: str
    stages: tuple[str, ...]
    edges: tuple[EdgeConfig, ...]
    timeout_s: float | None = None
    retries: int = 0
    # `outputs = { thinker = ["text"] }`: outputs of stages that are not last kept as the job's too,
    # by name (an omni pipeline's text, while its last stage gives the audio).
    keep: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    realtime: RealtimeConfig | None = None      # admission by capacity, for a pipeline of streams
    # The key the workers know this definition by, when a reload changed the pipeline (`name~N`); set
    # on the definitions in force by the reload's switch, so that a job's resolved pipeline carries it.
    # "": its name. Not part of the definition: two pipelines that differ only in it are equal.
    key: str = field(default="", compare=False)

    def incoming(self, stage: str) -> tuple[EdgeConfig, ...]:
        return tuple(e for e in self.edges if e.dst == stage)

    def outgoing(self, stage: str) -> tuple[EdgeConfig, ...]:
        return tuple(e for e in self.edges if e.src == stage)

    def asks(self, stage: str) -> frozenset[str]:
        """The outputs this pipeline's edges map out of `stage` by name."""
        return frozenset(v for e in self.outgoing(stage) if e.map is not None for v in e.map.values())

    @property
    def sources(self) -> tuple[str, ...]:
        """Stages fed by the job's own inputs (no incoming edge)."""
        return tuple(s for s in self.stages if not self.incoming(s))

    @property
    def sinks(self) -> tuple[str, ...]:
        """Stages whose outputs are the job's outputs: those with no outgoing edge, and those whose
        outputs `keep` names."""
        return tuple(s for s in self.stages if not self.outgoing(s) or s in self.keep)

    def kept(self, stage: str, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """Which of `stage`'s outputs are the job's: all of a last stage's, the named ones of another."""
        if not self.outgoing(stage):
            return dict(outputs)
        names = self.keep.get(stage, ())
        return {k: v for k, v in outputs.items() if k in names}

    def as_api(self) -> PipelineDoc:
        return {"name": self.name, "stages": list(self.stages),
                "edges": [e.as_api() for e in self.edges],
                "sources": list(self.sources), "sinks": list(self.sinks),
                "kept_outputs": {k: list(v) for k, v in self.keep.items()},
                "timeout_s": self.timeout_s, "retries": self.retries}


@dataclass(frozen=True)
class Config:
    source: Path | None
    daemon: DaemonConfig
    stages: Mapping[str, StageConfig]
    pipelines: Mapping[str, PipelineConfig]

    @property
    def devices(self) -> tuple[int, ...]:
        """Every GPU index some stage uses, sorted (the lock order)."""
        return tuple(sorted({d for s in self.stages.values() for d in s.devices}))
