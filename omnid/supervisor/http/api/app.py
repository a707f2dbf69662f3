"""The socket API's application: HTTP/1.1 + JSON over the daemon's Unix socket (aiohttp), and its
one route table (`Api`).

Runs in the supervisor's event-loop thread. Handlers never block: they read the job store (short
sqlite reads), ask the scheduler, or stream a job's events from an asyncio queue.

`Api` is given its collaborators (config, store, scheduler, stage handles, metrics, and `DaemonInfo`)
by the daemon that builds it; it imports nothing of the daemon. What a request meets before its
handler (the error shape, the caller's uid) and what the handlers share (`ApiCore`) are core.py's;
no handler imports this module. To add an endpoint: a handler method in its room (jobs.py,
stages.py, admin.py) and its route in `Api.__init__`. What a submission must be is admission.py's
(every front end asks it, from its JSON body on); what the front ends share (a job's event stream,
output files, logs, server-sent events) is http_common.py's.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from omnid.store import JobStore
from omnid.supervisor.http.admission import MAX_BYTES_KEY
from omnid.supervisor.http.api.adapters import Adapters
from omnid.supervisor.http.api.admin import Admin
from omnid.supervisor.http.api.core import ApiCore, DaemonInfo, error, errors_middleware
from omnid.supervisor.http.api.jobs import Jobs
from omnid.supervisor.http.api.stages import Stages
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics
from omnid.supervisor.workers.stage_group import StageGroup

__all__ = ["Api", "DaemonInfo", "error"]

class Api(ApiCore):
    """The socket API's application and its route table, on the collaborators and checks its handlers
    (jobs.py, stages.py, admin.py, adapters.py, and the OpenAI paths' submit) share (`ApiCore`)."""

    def __init__(self, live: Live, store: JobStore, scheduler: Scheduler, stages: Mapping[str, StageGroup],
                 metrics: Metrics, info: DaemonInfo) -> None:
        super().__init__(live, store, scheduler, stages, metrics, info)
        config = self.live.config
        app = web.Application(middlewares=[errors_middleware], client_max_size=config.daemon.max_request_bytes)
        app[MAX_BYTES_KEY] = config.daemon.max_request_bytes
        jobs, stage, daemon = Jobs(self), Stages(self), Admin(self)
        self.daemon = daemon              # (its /metrics handler: the daemon's metrics listener too)
        app.add_routes([
            web.post("/v1/jobs", jobs.submit),
            web.get("/v1/jobs", jobs.list_jobs),
            web.get("/v1/jobs/{id}", jobs.get_job),
            web.get("/v1/jobs/{id}/events", jobs.events),
            web.post("/v1/jobs/{id}/cancel", jobs.cancel),
            web.delete("/v1/jobs/{id}", jobs.delete),
            web.get("/v1/jobs/{id}/outputs/{name}", jobs.output),
            web.get("/v1/pipelines", daemon.list_pipelines),
            web.get("/v1/pipelines/{name}", daemon.get_pipeline),
            web.get("/v1/openapi.json", daemon.openapi),
            web.get("/v1/stages", stage.list_stages),
            web.post("/v1/stages/{name}/restart", stage.restart_stage),
            web.post("/v1/stages/{name}/sleep", stage.sleep_stage),
            web.post("/v1/stages/{name}/wake", stage.wake_stage),
            web.post("/v1/reload", daemon.reload_config),
            web.get("/v1/stages/{name}/logs", stage.stage_logs),
            web.get("/v1/logs", daemon.daemon_logs),
            web.get("/v1/health", daemon.health),
            web.get("/v1/ready", daemon.ready),
            web.get("/metrics", daemon.get_metrics),
        ])
        app.add_routes(Adapters(self).routes())     # a stage's LoRA adapters at run time (adapters.py)
        self.app = app                  # (the daemon mounts the OpenAI-compatible paths: openai/routes.py)

