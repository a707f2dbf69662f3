"""What every request of the socket API meets: its error shape (`error`, and the middleware that
answers every failure with it), the caller's uid, and what the handlers share (`ApiCore`: the
daemon's collaborators, the last step of every submit path, `take`, and the caller checks: admin,
privileged). app.py builds the route table on it; the handlers (jobs.py, stages.py, admin.py,
adapters.py, keys.py, and the OpenAI and Realtime paths) are given it, and import nothing of app.py.

Every error is `{"error": {"code": ..., "message": ...}}` with a fitting status, including aiohttp's
own (413 for a body over `max_request_bytes`, 405, 404 route). The caller's uid comes from the socket
(SO_PEERCRED), or over TCP from its API key (access.py, the innermost middleware, sets it): a job
belongs to the uid that submitted it; only that uid or root may read, cancel or delete it.

Runs in the supervisor's event-loop thread; nothing here blocks.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from omnid.config import Config
from omnid.store import JobStore
from omnid.supervisor.errors import STORAGE_RETRY_AFTER_S, Refused, retry_after
from omnid.supervisor.http import trace_context
from omnid.supervisor.http.admission import MAX_BYTES_KEY
from omnid.supervisor.http.http_common import send_log
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.jobs.submission import Submission
from omnid.supervisor.live import Live
from omnid.supervisor.metrics import Metrics
from omnid.supervisor.resources import DiskWatch
from omnid.supervisor.workers.stage_group import StageGroup
from omnid.vocabulary import DaemonState, ErrorCode, JobRecord

log = structlog.get_logger("omnid.api")


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


class ApiCore:
    """The socket API's collaborators (config, store, scheduler, stage handles, metrics, and
    `DaemonInfo`), given by the daemon that builds the `Api`, and what its handlers share."""

    def __init__(self, live: Live, store: JobStore, scheduler: Scheduler, stages: Mapping[str, StageGroup],
                 metrics: Metrics, info: DaemonInfo) -> None:
        self.live = live  # the config in force (`config` reads it; a reload changes it there)
        self.store = store
        self.scheduler = scheduler
        self.stages = stages
        self.metrics = metrics
        self.info = info
        self.disk: DiskWatch | None = None               # the state dir's space (the daemon sets it)
        self.reload: Callable[[], Awaitable[str]] | None = None     # SIGHUP's reload (the daemon sets it)

    @property
    def config(self) -> Config:
        return self.live.config

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

    def stage(self, request: web.Request) -> StageGroup:
        name = request.match_info["name"]
        group = self.stages.get(name)
        if group is None:
            raise Refused(404, ErrorCode.UNKNOWN_STAGE, f"no stage {name!r}; known: {', '.join(sorted(self.stages))}")
        return group

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

    async def send_log_of(self, request: web.Request, path: Path) -> web.StreamResponse:
        """A log file sent (stage_logs.py's files; the query: `since`, `tail`, `follow`)."""
        return await send_log(request, path, self.config.daemon.log_file_keep, lambda: self.info.stopping)

