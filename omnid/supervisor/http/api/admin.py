"""The socket API's daemon as a whole: its pipelines (`GET /v1/pipelines`, one described: inputs,
params, edges, outputs), its OpenAPI document, `POST /v1/reload` (as SIGHUP), its own logs, health,
readiness (every stage takes jobs, every real-time pipeline warm, the disk not short), and its
Prometheus metrics.

Runs in the supervisor's event-loop thread; nothing blocks (the reload awaits the daemon's own).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from omnid.lora import describe as lora_view
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission
from omnid.supervisor.http.api.documents import HealthDoc, PipelineListed, ReadyDoc
from omnid.supervisor.http.openapi import describe_pipeline, openapi_document
from omnid.supervisor.workers import stage_logs
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.api")


class Admin:
    """The daemon's handlers, on the `ApiCore`'s collaborators (config, stages, scheduler, info, metrics)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

    async def list_pipelines(self, request: web.Request) -> web.Response:
        config = self.api.config        # (each with its stages' LoRA adapters, where they have them)
        streams = self.api.scheduler.gate.snapshots()     # a real-time pipeline's capacity and streams
        pipelines: list[PipelineListed] = []
        for p in config.pipelines.values():
            doc: PipelineListed = {**p.as_api(), "adapters": {
                s: lora_view(config.stages[s]) for s in p.stages if config.stages[s].lora is not None}}
            if p.name in streams:
                doc["realtime"] = streams[p.name]
            pipelines.append(doc)
        return web.json_response({"pipelines": pipelines})

    async def get_pipeline(self, request: web.Request) -> web.Response:
        """One pipeline: its inputs, each stage's parameters (types, limits, defaults), edges, outputs."""
        pipeline = admission.find_pipeline(self.api.config, request.match_info["name"], in_path=True)
        return web.json_response(describe_pipeline(self.api.config, pipeline))

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of every route this app serves (read from its router now)."""
        return web.json_response(openapi_document(request.app, self.api.config, self.api.info.version))

    async def reload_config(self, request: web.Request) -> web.Response:
        """Read the config file again and apply it, as SIGHUP does; an admin action. 200 with what happened."""
        self.api.admin(request, "reload")
        if self.api.reload is None:
            raise Refused(503, ErrorCode.SHUTTING_DOWN, "the daemon cannot reload now")
        log.info("audit", action="reload", uid=request["uid"])
        status = await self.api.reload()
        return web.json_response({"status": status, "reloaded": not status.startswith("reload ")})

    async def daemon_logs(self, request: web.Request) -> web.StreamResponse:
        """The daemon's own records (root or daemon.admin_group); the query as for a stage's logs."""
        self.api.admin(request, "daemon_logs")
        return await self.api.send_log_of(request, stage_logs.daemon_log_path(self.api.config.daemon.state_dir))

    async def health(self, request: web.Request) -> web.Response:
        info = self.api.info
        doc: HealthDoc = {"status": "ok", "pid": info.pid, "uptime_s": round(time.time() - info.started, 3),
                          "version": info.version, "live_jobs": len(self.api.scheduler.live_jobs),
                          "stopping_jobs": len(self.api.scheduler.stopping)}
        return web.json_response(doc)

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when every stage takes jobs: warm, degraded (some replicas down: listed in
        `replicas_down`) or sleeping (it wakes for its next job); and every real-time pipeline has run
        its warm-up job (`warming`: those that have not yet). The disk: `disk` always; not ready, with
        reason `disk_full`, while it is short."""
        not_ready = sorted(name for name, h in self.api.stages.items()
                           if not h.takes_jobs or (self.api.info.starting and not h.state.warm))
        cold = sorted(name for name, snap in self.api.scheduler.gate.snapshots().items() if not snap["warm"])
        doc: ReadyDoc = {
            "ready": not not_ready and not cold and not self.api.info.draining,
            "stages": {name: h.state for name, h in self.api.stages.items()}, "not_ready": not_ready,
            "replicas_down": {name: {h.label: h.state for h in g.down()} for name, g in self.api.stages.items()
                              if g.down()},
            "warming": cold,
            "lazy": sorted(n for n in self.api.stages if n in self.api.config.stages and self.api.config.stages[n].lazy)}
        if self.api.info.draining:
            doc["draining"] = True
        if self.api.disk is not None:
            state = self.api.disk.check()
            doc["disk"] = state.as_doc(self.api.disk)
            if state.full:
                doc["ready"] = False
                doc["reasons"] = [ErrorCode.DISK_FULL]
        return web.json_response(doc, status=200 if doc["ready"] else 503)

    async def get_metrics(self, request: web.Request) -> web.Response:
        from prometheus_client.exposition import choose_encoder
        # The OpenMetrics format when asked for (Accept: application/openmetrics-text): with the
        # histograms' exemplars, the trace ids of jobs they counted (`[daemon] tracing`).
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.api.metrics.registry), headers={"Content-Type": content_type})
