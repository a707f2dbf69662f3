"""Documents of the socket API that no lower room makes whole: the daemon's own (`GET /v1/health`,
`GET /v1/ready`) and a pipeline's (`GET /v1/pipelines`, `GET /v1/pipelines/{name}`: the config's
`PipelineDoc` and what the daemon adds). Their one definition: admin.py and openapi.py make them
(type-checked against these classes); the OpenAPI document's schemas are generated from them (a
field's docstring is its description).
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict

from omnid.config_types import PipelineDoc
from omnid.lora import LoraView
from omnid.supervisor.jobs.streams import RealtimeState
from omnid.supervisor.resources import DiskDoc
from omnid.vocabulary import ErrorCode, WorkerState


class HealthDoc(TypedDict):
    status: Literal["ok"]
    pid: int
    uptime_s: float
    version: str
    live_jobs: int
    """jobs queued or running"""
    stopping_jobs: int
    """cancelled jobs that a stage has not stopped yet (each has its grace kill)"""


class ReadyDoc(TypedDict):
    ready: bool
    stages: dict[str, WorkerState]
    not_ready: list[str]
    """the stages that take no jobs now"""
    replicas_down: dict[str, dict[str, WorkerState]]
    """per degraded stage, its workers that are down, by label"""
    warming: list[str]
    """real-time pipelines whose warm-up job has not run yet"""
    lazy: list[str]
    """python stages with `lazy = true`: ready before their function has loaded what it needs (it does
    so on its first job)"""
    draining: NotRequired[bool]
    """the daemon is stopping: it takes no new jobs"""
    reasons: NotRequired[list[Literal[ErrorCode.DISK_FULL]]]
    """why not ready besides the stages: disk_full"""
    disk: NotRequired[DiskDoc]


class PipelineListed(PipelineDoc):
    """A pipeline in `GET /v1/pipelines`."""

    adapters: dict[str, LoraView | None]
    """the LoRA adapters of its stages that have a lora table, and their base model"""
    realtime: NotRequired[RealtimeState]
    """a real-time pipeline's capacity and streams"""


class PipelineDescription(PipelineDoc):
    """`GET /v1/pipelines/{name}`: what a job gives the pipeline, may set and gets back."""

    inputs: dict[str, dict[str, Any]]
    """per first stage, the inputs it takes"""
    params: dict[str, dict[str, Any]]
    """per stage, its parameters: types, limits, defaults"""
    outputs: dict[str, dict[str, Any]]
    """per last stage, what it gives back"""
    adapters: dict[str, LoraView | None]
    """the LoRA adapters of its stages that have a lora table, and their base model"""
