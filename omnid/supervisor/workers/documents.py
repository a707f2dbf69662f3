"""What `GET /v1/stages` says of a stage and of each of its workers: the documents' one definition.

The stage handles make them (`StageHandle.snapshot`, `StageGroup.snapshot`), type-checked against
these classes; the OpenAPI document's `Stage` schema is generated from them (a field's docstring is
its description), and omnictl reads them.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from typing_extensions import NotRequired, TypedDict

from omnid.lora import LoraView
from omnid.vocabulary import WorkerState

Placement = Literal["local", "ray", "mixed"]


class LastRestart(TypedDict):
    reason: str
    """why it was asked for (an admin's restart, a reload, a memory limit)"""
    at: float
    """when (Unix time)"""


class ShmUse(TypedDict):
    """the shared memory the stage's workers receive tensors in"""

    capacity_bytes: int
    used_bytes: int
    slots: int


class RayPlace(TypedDict, total=False):
    """where Ray placed the worker's actor"""

    node_id: str | None
    node_ip: str | None
    node_name: str | None
    host: str | None
    actor_id: str | None
    gpus: list[str] | None


class WorkerFields(TypedDict):
    """What a stage's document and each of its workers' say alike. The stage's: its workers' sums (the
    counts, memory, CPU, queues), its first worker's pid, uptime_s, load_s, spawned_at and ready_at."""

    name: str
    engine: str
    state: WorkerState
    pid: int | None
    """the worker's process (a Ray actor's on its node); null while none runs"""
    devices: list[int]
    queue_depth: int
    """jobs given to the worker and not yet started by it"""
    queue_capacity: int
    max_inflight: int
    running: list[str]
    """the jobs it runs now"""
    jobs_done: int
    restarts: int
    rss_restarts: int
    """restarts for going over `max_rss_mb`"""
    rss_bytes: int | None
    cpu_percent: float | None
    gpu_memory_bytes: int | None
    uptime_s: float | None
    load_s: float | None
    """how long its engine took to load"""
    spawned_at: float | None
    ready_at: float | None
    tracked_jobs: int
    """jobs the worker holds state for (its own count)"""
    last_error: str | None
    last_restart: LastRestart | None
    """the latest restart asked for"""
    model: str | None
    function: str | None
    lazy: bool
    info: dict[str, Any]
    """what the loaded engine reports: for a vLLM stage its model, dtype, max_model_len, compiled
    (torch.compile'd or eager), vllm (the vLLM version its worker runs), engine_core, threads; tensors
    and media where configured"""
    shm: ShmUse
    placement: Placement
    node: str | None
    """the Ray node's address (null for a local worker)"""
    ray: NotRequired[RayPlace | None]
    """a Ray-placed worker's actor (only for stages placed by Ray)"""


class WorkerDoc(WorkerFields):
    """One worker (a replica of its stage)."""

    replica: int
    label: str
    """its name in logs: the stage's, and `#N` for replicas after the first"""


class ReplicaDoc(WorkerDoc):
    retiring: bool
    """a replica past the stage's `replicas` after a reload, finishing its jobs before it stops"""


class StageDoc(WorkerFields):
    """A stage: its workers' figures summed, and each of them (`replicas`)."""

    replica_count: int
    down: list[str]
    """the labels of its workers that are not serving"""
    idle_unload_s: float | None
    idle_s: float | None
    slept_at: float | None
    wake_s: float | None
    lora: LoraView | None
    """its LoRA adapters in force, and their base model (null without a `lora` table)"""
    replicas: list[ReplicaDoc]


class Where(TypedDict):
    placement: Placement
    node: str | None
    ray: NotRequired[RayPlace | None]


def shared(doc: WorkerDoc) -> WorkerFields:
    """A worker's fields that its stage's document shares (all but its replica number and label)."""
    keys = WorkerFields.__required_keys__ | WorkerFields.__optional_keys__
    return cast(WorkerFields, {k: v for k, v in doc.items() if k in keys})
