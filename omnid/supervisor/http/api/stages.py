"""The socket API's stages: `GET /v1/stages` (each stage's workers and state, the real-time
pipelines' capacity), and the admin actions on one: restart, sleep, wake, and its workers' logs.
(A stage's LoRA adapters at run time: adapters.py.)

Runs in the supervisor's event-loop thread; a restart goes on in a task of its own (202 at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from omnid.supervisor.errors import Refused
from omnid.supervisor.workers import stage_logs
from omnid.vocabulary import ErrorCode, WorkerState

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.api")


class Stages:
    """The stage handlers, on the `ApiCore`'s collaborators (stages, scheduler, config)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api
        self._tasks: set[asyncio.Task[None]] = set()     # stage restarts in progress

    async def list_stages(self, request: web.Request) -> web.Response:
        return web.json_response({"stages": [h.snapshot() for h in self.api.stages.values()],
                                  "realtime": self.api.scheduler.gate.snapshots()})

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def restart_stage(self, request: web.Request) -> web.Response:
        """Replace a stage's workers (one given up after a crash loop too), one replica after the
        other; root or the admin group. A sleeping stage is woken instead. 202 at once: the stage's
        state in `GET /v1/stages` says when it is ready."""
        self.api.admin(request, "restart_stage")
        group = self.api.stage(request)
        self._background(group.restart(f"asked for by uid {request['uid']}", self.api.config.daemon.drain_timeout_s))
        log.info("audit", action="restart_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"restarting": group.name, "stage": group.snapshot()}, status=202)

    async def sleep_stage(self, request: web.Request) -> web.Response:
        """Stop a stage's workers now, releasing their memory and GPUs, until a job (or `wake`) needs
        it; root or the admin group. 409 while it has work; 202 at once (`sleeping` in its state soon)."""
        self.api.admin(request, "sleep_stage")
        group = self.api.stage(request)
        if self.api.scheduler.has_work(group.name):
            raise Refused(409, ErrorCode.STAGE_BUSY, f"stage {group.name!r} has jobs in progress; put it to sleep "
                          "once they are done (or cancel them)", stage=group.name)
        if group.state is WorkerState.FAILED:
            raise Refused(409, ErrorCode.STAGE_FAILED, f"stage {group.name!r} has failed; restart it instead "
                          f"(omnictl stage restart {group.name})", stage=group.name)
        already = group.sleeping or group.dozing
        self.api.scheduler.put_to_sleep(group)
        log.info("audit", action="sleep_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"sleeping": group.name, "already": already, "stage": group.snapshot()},
                                 status=200 if already else 202)

    async def wake_stage(self, request: web.Request) -> web.Response:
        """Load a sleeping stage's workers again (before its next job: no wait then); root or the
        admin group. 202 at once; 200 when it is awake already."""
        self.api.admin(request, "wake_stage")
        group = self.api.stage(request)
        awake = not group.resting
        if not awake:
            group.touch()
            group.wake_soon()
        log.info("audit", action="wake_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"waking": group.name, "already": awake, "stage": group.snapshot()},
                                 status=200 if awake else 202)

    async def stage_logs(self, request: web.Request) -> web.StreamResponse:
        """A stage worker's stdout and stderr (root or daemon.admin_group): `TIME LINE` text lines,
        `?since=` (10m, 1h, ISO 8601, Unix time), `?tail=N`, `?follow=1` (sent as they come)."""
        self.api.admin(request, "stage_logs")
        group = self.api.stage(request)
        raw = request.query.get("replica", "0")
        if not raw.isdigit() or int(raw) >= max(group.stage.replicas, len(group.replicas)):
            raise Refused(400, ErrorCode.INVALID_REQUEST, f"replica must be from 0 to "
                          f"{max(group.stage.replicas, len(group.replicas)) - 1} (stage {group.name!r} has "
                          f"{group.stage.replicas}), not {raw!r}")
        path = stage_logs.stage_log_path(self.api.config.daemon.state_dir, group.name, int(raw))
        return await self.api.send_log_of(request, path)
