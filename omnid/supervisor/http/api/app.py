"""The socket API: HTTP/1.1 + JSON over the daemon's Unix socket (aiohttp).

Runs in the supervisor's event-loop thread. Handlers never block: they read
the job store (short sqlite reads), ask the scheduler, or stream a job's
events from an asyncio queue. Every error is
`{"error": {"code": ..., "message": ...}}` with a fitting status, including
aiohttp's own (413 for a body over `max_request_bytes`, 405, 404 route).

The caller's uid comes from the socket (SO_PEERCRED), or over TCP from its API
key (access.py, the innermost middleware, sets it): a job belongs to the uid that
submitted it; only that uid or root may read, cancel or delete it.

`Api` is given its collaborators (config, store, scheduler, stage handles, metrics,
and `DaemonInfo`) by the daemon that builds it; it imports nothing of the daemon.
To add an endpoint: a handler method here and its route in `Api.__init__`. What a submission must
be is admission.py's (every front end asks it, from its JSON body on); what the front ends share (a
job's event stream, output files, logs, server-sent events) is http_common.py's.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from omnid.config import Config
from omnid.lora import describe as lora_view
from omnid.store import JobStore, StoreWriteFailed
from omnid.supervisor.errors import RETRY_AFTER_S as RETRY_AFTER_S  # (re-exported)
from omnid.supervisor.errors import STORAGE_RETRY_AFTER_S, Refused, retry_after
from omnid.supervisor.http import admission, trace_context
from omnid.supervisor.http.api.adapters import Adapters
from omnid.supervisor.http.admission import MAX_BYTES_KEY, json_body
from omnid.supervisor.http.http_common import flag, follow_batches, output_file, send_log, stream_output
from omnid.supervisor.http.openapi import describe_pipeline, openapi_document
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.jobs.submission import Submission
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics
from omnid.supervisor.resources import DiskWatch
from omnid.supervisor.workers import stage_logs
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import TERMINAL_JOB_STATES, DaemonState, ErrorCode, JobRecord, JobState, WorkerState, job_links

log = structlog.get_logger("omnid.api")

MIN_PREFIX = 4                # a job id prefix shorter than this names no job (store.resolve)
# (in the order the API has always listed them)
_STATE_NAMES = ", ".join([str(JobState.QUEUED), str(JobState.RUNNING), *sorted(map(str, TERMINAL_JOB_STATES))])


@dataclass
class DaemonInfo:
    """What `/v1/health` says of the daemon itself; `stopping` turns new jobs away (503)."""

    pid: int
    started: float
    version: str
    state: DaemonState = DaemonState.STARTING

    @property
    def starting(self) -> bool:     # until every stage's first workers are up (then degraded counts as ready)
        return self.state is DaemonState.STARTING

    @property
    def draining(self) -> bool:
        return self.state in (DaemonState.DRAINING, DaemonState.STOPPING)

    @property
    def stopping(self) -> bool:
        return self.state is DaemonState.STOPPING


def error(status: int, code: ErrorCode, message: str, **extra: Any) -> web.Response:
    headers = retry_after(status, extra.get("retry_after_s")) or None
    return web.json_response({"error": {"code": str(code), "message": message, **extra}}, status=status,
                             headers=headers)


def _peer_uid(request: web.Request) -> int | None:
    """The caller's uid on the Unix socket; None over TCP, whose door (access.py) knows it by its key."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        return None
    if sock is None or sock.family != socket.AF_UNIX:
        raise Refused(403, ErrorCode.NO_CREDENTIALS, "the caller's identity cannot be read from this connection")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


@web.middleware
async def errors_middleware(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        uid = _peer_uid(request)
        if uid is not None:
            request["uid"] = uid
        return await handler(request)
    except Refused as e:
        return error(e.status, e.code, e.message, **e.extra)
    except web.HTTPRequestEntityTooLarge:
        # (aiohttp's exception keeps no max_size attribute: the limit is the app's.)
        limit = request.app[MAX_BYTES_KEY]
        return error(413, ErrorCode.TOO_LARGE, f"the request body is larger than {limit} bytes "
                     "(daemon.max_request_bytes)", max_bytes=limit)
    except web.HTTPNotFound:
        return error(404, ErrorCode.NOT_FOUND, f"no such endpoint: {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as e:
        resp = error(405, ErrorCode.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.path}; "
                     f"use {', '.join(sorted(e.allowed_methods))}")
        resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))     # (RFC 9110: a 405 says what is)
        return resp
    except web.HTTPException as e:
        return error(e.status, ErrorCode.HTTP_ERROR, e.reason)
    except ConnectionError:
        raise                          # the caller went away (mid-stream): nobody to answer
    except Exception as e:
        # Still a JSON error, and the daemon keeps serving; the log has the traceback.
        log.exception("request failed", method=request.method, path=request.path)
        return error(500, ErrorCode.INTERNAL_ERROR, f"the daemon failed on this request: {type(e).__name__}: {e}")


class Api:
    def __init__(self, live: Live, store: JobStore, scheduler: Scheduler, stages: Mapping[str, StageGroup],
                 metrics: Metrics, info: DaemonInfo) -> None:
        self.live = live  # the config in force (`config` reads it; a reload changes it there)
        config = self.live.config
        self.store = store
        self.scheduler = scheduler
        self.stages = stages
        self.metrics = metrics
        self.info = info
        self._tasks: set[asyncio.Task[None]] = set()     # stage restarts in progress
        self.disk: DiskWatch | None = None               # the state dir's space (the daemon sets it)
        self.reload: Callable[[], Awaitable[str]] | None = None     # SIGHUP's reload (the daemon sets it)
        app = web.Application(middlewares=[errors_middleware], client_max_size=config.daemon.max_request_bytes)
        app[MAX_BYTES_KEY] = config.daemon.max_request_bytes
        app.add_routes([
            web.post("/v1/jobs", self.submit),
            web.get("/v1/jobs", self.list_jobs),
            web.get("/v1/jobs/{id}", self.get_job),
            web.get("/v1/jobs/{id}/events", self.events),
            web.post("/v1/jobs/{id}/cancel", self.cancel),
            web.delete("/v1/jobs/{id}", self.delete),
            web.get("/v1/jobs/{id}/outputs/{name}", self.output),
            web.get("/v1/pipelines", self.list_pipelines),
            web.get("/v1/pipelines/{name}", self.get_pipeline),
            web.get("/v1/openapi.json", self.openapi),
            web.get("/v1/stages", self.list_stages),
            web.post("/v1/stages/{name}/restart", self.restart_stage),
            web.post("/v1/stages/{name}/sleep", self.sleep_stage),
            web.post("/v1/stages/{name}/wake", self.wake_stage),
            web.post("/v1/reload", self.reload_config),
            web.get("/v1/stages/{name}/logs", self.stage_logs),
            web.get("/v1/logs", self.daemon_logs),
            web.get("/v1/health", self.health),
            web.get("/v1/ready", self.ready),
            web.get("/metrics", self.get_metrics),
        ])
        app.add_routes(Adapters(self).routes())     # a stage's LoRA adapters at run time (adapters.py)
        self.app = app                  # (the daemon mounts the OpenAI-compatible paths: openai/routes.py)

    # ------------------------------------------------------------------ helpers

    def _job(self, request: web.Request) -> JobRecord:
        """The job named in the path, if the caller may see it."""
        ref = request.match_info["id"]
        found = self.store.resolve(ref)
        if found is None:
            short = len(ref) < MIN_PREFIX     # (store.resolve matches prefixes of MIN_PREFIX or more only)
            raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {ref!r}" + (
                f": job id prefixes need at least {MIN_PREFIX} characters" if short else ""))
        if isinstance(found, list):
            raise Refused(400, ErrorCode.AMBIGUOUS_JOB, f"{ref!r} matches several jobs: {', '.join(found)}")
        job = self.scheduler.job(found)
        if job is None:
            raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {ref!r}")
        uid = request["uid"]
        if not self.privileged(request) and job.owner_uid != uid:
            if request.get("tcp"):
                log.info("audit", action="refused", why="not_yours", uid=uid, job=job.id, method=request.method,
                         path=request.path)
            raise Refused(403, ErrorCode.NOT_YOURS, f"job {job.id} belongs to another user"
                          + (" (over TCP, only a key made with --admin acts on others' jobs)" if request.get("tcp") else ""))
        return job

    @property
    def config(self) -> Config:
        return self.live.config

    # ------------------------------------------------------------------ jobs

    async def submit(self, request: web.Request) -> web.Response:
        sub = admission.job_submission(self.config, await json_body(request), request["uid"])
        sub = admission.owned(self.config, sub, request.get("api_key"), not request.get("tcp"))
        job = self.take(sub, "the daemon is stopping: it finishes the jobs it is running and keeps the "
                        "queued ones for its next start; submit again once it is back", request)
        log.info("audit", action="submit", uid=request["uid"], job=job.id, pipeline=sub.pipeline.name,
                 priority=sub.priority)
        trace = trace_context.trace_id(request)     # `[daemon] tracing`: the job's trace
        stream = self.scheduler.streams(job.id)     # a real-time pipeline's waiting stream: its place
        return web.json_response({**job.to_doc(), "links": job_links(job.id), **({"trace_id": trace} if trace else {}),
                                  **({"stream": stream} if stream else {})},
                                 status=201,
                                 headers={"Location": f"/v1/jobs/{job.id}"})

    def take(self, sub: Submission, draining: str, request: web.Request | None = None) -> JobRecord:
        """A submission that passed admission, made a job of the caller's (every submit path's last
        step): 503 while the daemon stops (`draining`: why, as the path says it), 507 while the disk is
        short, the scheduler's own refusals. The job is in the database when this returns. With
        tracing on, the `request`'s trace context (W3C traceparent) is the job's parent, and its
        answer names the job's trace (`trace_context`)."""
        if self.info.stopping:
            raise Refused(503, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if self.info.draining:
            raise Refused(503, ErrorCode.DRAINING, draining)
        self.check_disk()
        if request is not None and self.scheduler.tracing is not None:
            sub = trace_context.joined(sub, request)
        job = self.scheduler.submit(sub)
        self.store.flush()              # a 201 means the job is in the database
        if request is not None and (live := self.scheduler.live_jobs.get(job.id)) is not None and live.trace is not None:
            trace_context.answered(request, live.trace.traceparent)
        return job

    def check_disk(self) -> None:
        """507 `insufficient_storage` while the state dir is short (`resources.DiskWatch`): a job
        taken now might not be kept. Every submit path calls it."""
        if self.disk is None:
            return
        state = self.disk.check()
        if state.full:
            self.metrics.refused.labels(ErrorCode.DISK_FULL).inc()
            raise Refused(507, ErrorCode.INSUFFICIENT_STORAGE, f"the daemon is short of disk space and takes no new "
                          f"jobs: {state.reason}. Jobs already taken go on; free space (omnictl rm, or retention: "
                          f"daemon.keep_jobs) and submit again", retry_after_s=STORAGE_RETRY_AFTER_S,
                          disk=state.as_doc(self.disk))

    async def list_jobs(self, request: web.Request) -> web.Response:
        q = request.query
        state_name = q.get("state")
        state = None
        if state_name is not None:
            try:
                state = JobState(state_name)
            except ValueError:
                raise Refused(400, ErrorCode.INVALID_REQUEST,
                              f"state must be one of {_STATE_NAMES}") from None
        pipeline = q.get("pipeline")
        try:
            limit = int(q.get("limit", "50"))
            if not 1 <= limit <= 1000:
                raise ValueError
        except ValueError:
            raise Refused(400, ErrorCode.INVALID_REQUEST, "limit must be an integer from 1 to 1000") from None
        uid = request["uid"]
        jobs = self.store.list(None if self.privileged(request) else uid, state, pipeline, limit)
        # A live job's stored row lags its record (progress is not written on every step).
        live = self.scheduler.live_jobs
        return web.json_response({"jobs": [(live[j.id].record if j.id in live else j).to_doc() for j in jobs]})

    async def get_job(self, request: web.Request) -> web.Response:
        """A job; a queued one says where it waits (`queue`: per stage, its place and what is ahead);
        a real-time pipeline's (`stream`): its place and estimated start while it waits for capacity,
        its audio sent and its listener's slack once it plays."""
        job = self._job(request)
        doc = job.to_doc()
        places = self.scheduler.queue_places(job.id)
        if places:
            doc["queue"] = places
        stream = self.scheduler.streams(job.id)     # a real-time pipeline's: waiting (place) or playing (slack)
        if stream:
            doc["stream"] = stream
        return web.json_response(doc)

    async def events(self, request: web.Request) -> web.StreamResponse:
        job = self._job(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        sent = 0
        try:
            async with aclosing(follow_batches(request, self.scheduler, job.id)) as batches:
                async for batch in batches:     # what is there at once goes in one write
                    await resp.write(b"".join(json.dumps(ev).encode() + b"\n" for ev in batch))
                    sent += len(batch)
            await resp.write_eof()
        except ConnectionError as e:       # the reader hung up: its subscription goes (the job goes on)
            log.debug("event reader went away", job=job.id, sent=sent, error=str(e))
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if job.terminal:
            return web.json_response(job.to_doc())
        cancelled = self.scheduler.cancel(job.id) or self._job(request)
        log.info("audit", action="cancel", uid=request["uid"], job=job.id, pipeline=job.pipeline,
                 owner_uid=job.owner_uid, **({"admin": True} if job.owner_uid != request["uid"] else {}))
        return web.json_response(cancelled.to_doc())

    async def delete(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if not job.terminal:
            raise Refused(409, ErrorCode.JOB_NOT_FINISHED, f"job {job.id} is {job.state}; cancel it first")
        try:
            self.store.delete(job.id)
        except StoreWriteFailed as e:
            raise Refused(507, ErrorCode.INSUFFICIENT_STORAGE, f"job {job.id} could not be deleted: {e}",
                          retry_after_s=STORAGE_RETRY_AFTER_S) from None
        log.info("audit", action="delete", uid=request["uid"], job=job.id, pipeline=job.pipeline)
        return web.json_response({"deleted": job.id})

    async def output(self, request: web.Request) -> web.StreamResponse:
        """One output file; with `?stream=1`, a live job's output as its last stage produces it."""
        stream = flag(request.query.get("stream"), "stream")
        job = self._job(request)
        name = request.match_info["name"]
        if not stream or job.terminal:
            return output_file(self.store, job, name)
        return await stream_output(request, self.store, self.scheduler, job, name)

    # ------------------------------------------------------------------ daemon

    async def list_pipelines(self, request: web.Request) -> web.Response:
        config = self.config        # (each with its stages' LoRA adapters, where they have them)
        streams = self.scheduler.gate.snapshots()     # a real-time pipeline's capacity and streams
        return web.json_response({"pipelines": [{**p.as_api(), "adapters": {
            s: lora_view(config.stages[s]) for s in p.stages if config.stages[s].lora is not None},
            **({"realtime": streams[p.name]} if p.name in streams else {})}
            for p in config.pipelines.values()]})

    async def get_pipeline(self, request: web.Request) -> web.Response:
        """One pipeline: its inputs, each stage's parameters (types, limits, defaults), edges, outputs."""
        pipeline = admission.find_pipeline(self.config, request.match_info["name"], in_path=True)
        return web.json_response(describe_pipeline(self.config, pipeline))

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of every route this app serves (read from its router now)."""
        return web.json_response(openapi_document(request.app, self.config, self.info.version))

    async def list_stages(self, request: web.Request) -> web.Response:
        return web.json_response({"stages": [h.snapshot() for h in self.stages.values()],
                                  "realtime": self.scheduler.gate.snapshots()})

    def _stage(self, request: web.Request) -> StageGroup:
        name = request.match_info["name"]
        group = self.stages.get(name)
        if group is None:
            raise Refused(404, ErrorCode.UNKNOWN_STAGE, f"no stage {name!r}; known: {', '.join(sorted(self.stages))}")
        return group

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def restart_stage(self, request: web.Request) -> web.Response:
        """Replace a stage's workers (one given up after a crash loop too), one replica after the
        other; root or the admin group. A sleeping stage is woken instead. 202 at once: the stage's
        state in `GET /v1/stages` says when it is ready."""
        self.admin(request, "restart_stage")
        group = self._stage(request)
        self._background(group.restart(f"asked for by uid {request['uid']}", self.config.daemon.drain_timeout_s))
        log.info("audit", action="restart_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"restarting": group.name, "stage": group.snapshot()}, status=202)

    async def sleep_stage(self, request: web.Request) -> web.Response:
        """Stop a stage's workers now, releasing their memory and GPUs, until a job (or `wake`) needs
        it; root or the admin group. 409 while it has work; 202 at once (`sleeping` in its state soon)."""
        self.admin(request, "sleep_stage")
        group = self._stage(request)
        if self.scheduler.has_work(group.name):
            raise Refused(409, ErrorCode.STAGE_BUSY, f"stage {group.name!r} has jobs in progress; put it to sleep "
                          "once they are done (or cancel them)", stage=group.name)
        if group.state is WorkerState.FAILED:
            raise Refused(409, ErrorCode.STAGE_FAILED, f"stage {group.name!r} has failed; restart it instead "
                          f"(omnictl stage restart {group.name})", stage=group.name)
        already = group.sleeping or group.dozing
        self.scheduler.put_to_sleep(group)
        log.info("audit", action="sleep_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"sleeping": group.name, "already": already, "stage": group.snapshot()},
                                 status=200 if already else 202)

    async def wake_stage(self, request: web.Request) -> web.Response:
        """Load a sleeping stage's workers again (before its next job: no wait then); root or the
        admin group. 202 at once; 200 when it is awake already."""
        self.admin(request, "wake_stage")
        group = self._stage(request)
        awake = not group.resting
        if not awake:
            group.touch()
            group.wake_soon()
        log.info("audit", action="wake_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"waking": group.name, "already": awake, "stage": group.snapshot()},
                                 status=200 if awake else 202)

    def admin(self, request: web.Request, action: str) -> None:
        """An admin action: on the socket root or `daemon.admin_group`; over TCP only a key made with
        `--admin` (whatever its uid). A refusal is a 403 `not_admin`, audited with the key."""
        if request.get("tcp"):
            if request.get("api_key_admin"):
                return
            log.info("audit", action="refused", why="not_admin", wanted=action, uid=request["uid"],
                     method=request.method, path=request.path)
            raise Refused(403, ErrorCode.NOT_ADMIN, f"{action}: over TCP only a key made with --admin may do this "
                          "(omnictl key add NAME --uid UID --admin, on the socket)")
        try:
            self.check_admin(request["uid"])
        except Refused:
            log.info("audit", action="refused", why="not_admin", wanted=action, uid=request["uid"],
                     method=request.method, path=request.path)
            raise

    @staticmethod
    def privileged(request: web.Request) -> bool:
        """The caller may read and cancel every owner's jobs: root on the socket; an admin key over TCP
        (a key's uid 0 alone is not enough)."""
        return bool(request.get("api_key_admin")) if request.get("tcp") else request["uid"] == 0

    async def reload_config(self, request: web.Request) -> web.Response:
        """Read the config file again and apply it, as SIGHUP does; an admin action. 200 with what happened."""
        self.admin(request, "reload")
        if self.reload is None:
            raise Refused(503, ErrorCode.SHUTTING_DOWN, "the daemon cannot reload now")
        log.info("audit", action="reload", uid=request["uid"])
        status = await self.reload()
        return web.json_response({"status": status, "reloaded": not status.startswith("reload ")})

    def check_admin(self, uid: int) -> None:
        if uid == 0:
            return
        group = self.config.daemon.admin_group
        if group is not None:
            try:
                gid = grp.getgrnam(group).gr_gid
                user = pwd.getpwuid(uid)
                if gid in os.getgrouplist(user.pw_name, user.pw_gid):
                    return
            except KeyError:
                pass
        raise Refused(403, ErrorCode.NOT_ADMIN, "only root" + (f" or members of {group!r}" if group else "")
                      + " may do this (daemon.admin_group)")

    # ------------------------------------------------------------------ logs (stage_logs.py)

    async def stage_logs(self, request: web.Request) -> web.StreamResponse:
        """A stage worker's stdout and stderr (root or daemon.admin_group): `TIME LINE` text lines,
        `?since=` (10m, 1h, ISO 8601, Unix time), `?tail=N`, `?follow=1` (sent as they come)."""
        self.admin(request, "stage_logs")
        group = self._stage(request)
        raw = request.query.get("replica", "0")
        if not raw.isdigit() or int(raw) >= max(group.stage.replicas, len(group.replicas)):
            raise Refused(400, ErrorCode.INVALID_REQUEST, f"replica must be from 0 to "
                          f"{max(group.stage.replicas, len(group.replicas)) - 1} (stage {group.name!r} has "
                          f"{group.stage.replicas}), not {raw!r}")
        return await self._send_log(request, stage_logs.stage_log_path(self.config.daemon.state_dir, group.name,
                                                                       int(raw)))

    async def daemon_logs(self, request: web.Request) -> web.StreamResponse:
        """The daemon's own records (root or daemon.admin_group); the query as for a stage's logs."""
        self.admin(request, "daemon_logs")
        return await self._send_log(request, stage_logs.daemon_log_path(self.config.daemon.state_dir))

    async def _send_log(self, request: web.Request, path: Path) -> web.StreamResponse:
        return await send_log(request, path, self.config.daemon.log_file_keep, lambda: self.info.stopping)

    async def health(self, request: web.Request) -> web.Response:
        info = self.info
        return web.json_response({"status": "ok", "pid": info.pid, "uptime_s": round(time.time() - info.started, 3),
                                  "version": info.version, "live_jobs": len(self.scheduler.live_jobs),
                                  "stopping_jobs": len(self.scheduler.stopping)})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when every stage takes jobs: warm, degraded (some replicas down: listed in
        `replicas_down`) or sleeping (it wakes for its next job); and every real-time pipeline has run
        its warm-up job (`warming`: those that have not yet)."""
        states = {name: str(h.state) for name, h in self.stages.items()}
        not_ready = sorted(name for name, h in self.stages.items()
                           if not h.takes_jobs or (self.info.starting and not h.state.warm))
        down = {name: {h.label: str(h.state) for h in g.down()} for name, g in self.stages.items() if g.down()}
        cold = sorted(name for name, snap in self.scheduler.gate.snapshots().items() if not snap["warm"])
        body: dict[str, Any] = {"ready": not not_ready and not cold and not self.info.draining, "stages": states,
                                "not_ready": not_ready, "replicas_down": down, "warming": cold,
                                "lazy": sorted(n for n in self.stages if n in self.config.stages
                                               and self.config.stages[n].lazy)}
        if self.info.draining:
            body["draining"] = True
        self._ready_disk(body)
        return web.json_response(body, status=200 if body["ready"] else 503)

    def _ready_disk(self, body: dict[str, Any]) -> None:
        """/v1/ready's word on the disk: `disk` always; not ready, with reason `disk_full`, while short."""
        if self.disk is None:
            return
        state = self.disk.check()
        body["disk"] = state.as_doc(self.disk)
        if state.full:
            body["ready"] = False
            body.setdefault("reasons", []).append(ErrorCode.DISK_FULL)

    async def get_metrics(self, request: web.Request) -> web.Response:
        from prometheus_client.exposition import choose_encoder
        # The OpenMetrics format when asked for (Accept: application/openmetrics-text): with the
        # histograms' exemplars, the trace ids of jobs they counted (`[daemon] tracing`).
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.metrics.registry), headers={"Content-Type": content_type})

