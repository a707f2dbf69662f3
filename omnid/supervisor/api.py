"""The socket API: HTTP/1.1 + JSON over the daemon's Unix socket (aiohttp).

Runs in the supervisor's event-loop thread. Handlers never block: they read
the job store (short sqlite reads), ask the scheduler, or stream a job's
events from an asyncio queue. Every error is
`{"error": {"code": ..., "message": ...}}` with a fitting status, including
aiohttp's own (413 for a body over `max_request_bytes`, 405, 404 route).

The caller's uid comes from the socket (SO_PEERCRED): a job belongs to the
uid that submitted it; only that uid or root may read, cancel or delete it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from omnid.config import check_param
from omnid.store import STATES, TERMINAL
from omnid.supervisor.scheduler import Refused

if TYPE_CHECKING:
    from omnid.supervisor.daemon import Daemon

log = structlog.get_logger("omnid.api")

MAX_TIMEOUT_S = 7 * 24 * 3600.0
SUMMARY_CHARS = 1000          # how much of a long text input the job document shows
_JOB_KEYS = {"pipeline", "inputs", "params", "timeout_s"}
MAX_BYTES_KEY = web.AppKey("max_request_bytes", int)


def error(status: int, code: str, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, **extra}}, status=status)


def _peer_uid(request: web.Request) -> int:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        raise Refused(403, "no_credentials", "the caller's identity cannot be read from this connection")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


@web.middleware
async def errors_middleware(request: web.Request,
                            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        request["uid"] = _peer_uid(request)
        return await handler(request)
    except Refused as e:
        return error(e.status, e.code, e.message, **e.extra)
    except web.HTTPRequestEntityTooLarge:
        # (aiohttp's exception keeps no max_size attribute: the limit is the app's.)
        limit = request.app[MAX_BYTES_KEY]
        return error(413, "too_large", f"the request body is larger than {limit} bytes "
                     "(daemon.max_request_bytes)", max_bytes=limit)
    except web.HTTPNotFound:
        return error(404, "not_found", f"no such endpoint: {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as e:
        return error(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}; "
                     f"use {', '.join(sorted(e.allowed_methods))}")
    except web.HTTPException as e:
        return error(e.status, "http_error", e.reason)
    except ConnectionError:
        raise                          # the caller went away (mid-stream): nobody to answer
    except Exception as e:
        # Still a JSON error, and the daemon keeps serving; the log has the traceback.
        log.exception("request failed", method=request.method, path=request.path)
        return error(500, "internal_error", f"the daemon failed on this request: {type(e).__name__}: {e}")


class Api:
    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon
        app = web.Application(middlewares=[errors_middleware],
                              client_max_size=daemon.config.daemon.max_request_bytes)
        app[MAX_BYTES_KEY] = daemon.config.daemon.max_request_bytes
        app.add_routes([
            web.post("/v1/jobs", self.submit),
            web.get("/v1/jobs", self.list_jobs),
            web.get("/v1/jobs/{id}", self.get_job),
            web.get("/v1/jobs/{id}/events", self.events),
            web.post("/v1/jobs/{id}/cancel", self.cancel),
            web.delete("/v1/jobs/{id}", self.delete),
            web.get("/v1/jobs/{id}/outputs/{name}", self.output),
            web.get("/v1/pipelines", self.pipelines),
            web.get("/v1/stages", self.stages),
            web.get("/v1/health", self.health),
            web.get("/v1/ready", self.ready),
            web.get("/metrics", self.metrics),
        ])
        self.app = app

    # ------------------------------------------------------------------ helpers

    def _job(self, request: web.Request) -> dict[str, Any]:
        """The job named in the path, if the caller may see it."""
        ref = request.match_info["id"]
        found = self.d.store.resolve(ref)
        if found is None:
            raise Refused(404, "unknown_job", f"no job {ref!r}")
        if isinstance(found, list):
            raise Refused(400, "ambiguous_job", f"{ref!r} matches several jobs: {', '.join(found)}")
        live = self.d.scheduler.live.get(found)
        doc = live.doc if live is not None else self.d.store.get(found)
        if doc is None:
            raise Refused(404, "unknown_job", f"no job {ref!r}")
        uid = request["uid"]
        if uid != 0 and doc["owner_uid"] != uid:
            raise Refused(403, "not_yours", f"job {doc['id']} belongs to another user")
        return doc

    async def _json_body(self, request: web.Request) -> Any:
        limit = request.app[MAX_BYTES_KEY]
        if request.content_length is not None and request.content_length > limit:
            raise Refused(413, "too_large", f"the request body is larger than {limit} bytes "
                          "(daemon.max_request_bytes)", max_bytes=limit)
        raw = await request.read()
        try:
            # NaN and Infinity are not JSON: refused here, they could never be answered as JSON.
            return json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise Refused(400, "bad_json", f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise Refused(400, "bad_json", "the request body is nested too deeply") from None

    # ------------------------------------------------------------------ jobs

    async def submit(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, "invalid_request", "the request body must be a JSON object")
        unknown = set(body) - _JOB_KEYS
        if unknown:
            raise Refused(400, "invalid_request", f"unknown field(s) {', '.join(sorted(unknown))}; "
                          f"a job has {', '.join(sorted(_JOB_KEYS))}")
        name = body.get("pipeline")
        if not isinstance(name, str) or not name:
            raise Refused(400, "invalid_request", "\"pipeline\" must name a pipeline")
        pipeline = self.d.config.pipelines.get(name)
        if pipeline is None:
            raise Refused(400, "unknown_pipeline", f"no pipeline {name!r}; known: "
                          f"{', '.join(sorted(self.d.config.pipelines))}")
        inputs, summary = self._inputs(body.get("inputs", {}), pipeline)
        params = self._params(body.get("params", {}), pipeline)
        timeout = body.get("timeout_s")
        if timeout is not None:
            # A range check, not math.isfinite: that overflows on a 400-digit integer.
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                    or not 0 < timeout <= MAX_TIMEOUT_S:
                raise Refused(400, "invalid_request", f"\"timeout_s\" must be a number of seconds in "
                              f"(0, {MAX_TIMEOUT_S:.0f}], not {timeout!r}")
            timeout = float(timeout)
        if self.d.stopping:
            raise Refused(503, "shutting_down", "the daemon is shutting down")
        doc = self.d.scheduler.submit(request["uid"], name, inputs, params, timeout, summary)
        return web.json_response(doc, status=201)

    def _inputs(self, raw: Any, pipeline: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(raw, dict):
            raise Refused(400, "invalid_request", "\"inputs\" must be an object of named inputs")
        inputs: dict[str, Any] = {}
        summary: dict[str, Any] = {}
        for key, value in raw.items():
            if not key or len(key) > 128:
                raise Refused(400, "invalid_input", f"input name {key!r} is empty or too long")
            if isinstance(value, (str, int, float, bool)) or value is None:
                if not _plain_json(value):
                    raise Refused(400, "invalid_input", f"input {key!r} is not a finite number")
                inputs[key] = summary[key] = value
                if isinstance(value, str) and len(value) > SUMMARY_CHARS:   # listings stay small
                    summary[key] = value[:SUMMARY_CHARS] + f"... ({len(value)} characters)"
            elif isinstance(value, dict) and set(value) <= {"b64", "filename"} and isinstance(value.get("b64"), str):
                try:
                    data = base64.b64decode(value["b64"], validate=True)
                except (binascii.Error, ValueError):
                    raise Refused(400, "invalid_input", f"input {key!r}: \"b64\" is not valid base64") from None
                inputs[key] = data
                summary[key] = {"filename": value.get("filename"), "size": len(data)}
            elif isinstance(value, list) and _plain_json(value):
                inputs[key] = summary[key] = value
            else:
                raise Refused(400, "invalid_input", f"input {key!r} must be a string, number, boolean, list of "
                              "those, or a file {\"b64\": ..., \"filename\": ...}")
        for src in pipeline.sources:
            stage = self.d.config.stages[src]
            if stage.engine in ("vllm", "diffusers") and isinstance(inputs.get("prompt"), bytes):
                raise Refused(400, "invalid_input", f"input \"prompt\" of {stage.engine} stage {src!r} must be "
                              "text, not a file (use --prompt or --input prompt=...)")
            if stage.engine in ("vllm", "diffusers") and not isinstance(inputs.get("prompt"), str):
                raise Refused(400, "missing_input", f"pipeline {pipeline.name!r} starts with {stage.engine} stage "
                              f"{src!r}, which needs a text input \"prompt\"")
        return inputs, summary

    def _params(self, raw: Any, pipeline: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(raw, dict):
            raise Refused(400, "invalid_request", "\"params\" must be an object: {\"STAGE\": {\"KEY\": value}}")
        out: dict[str, dict[str, Any]] = {}
        for stage_name, values in raw.items():
            if stage_name not in pipeline.stages:
                raise Refused(400, "invalid_param", f"pipeline {pipeline.name!r} has no stage {stage_name!r} "
                              f"(its stages: {', '.join(pipeline.stages)})")
            if not isinstance(values, dict):
                raise Refused(400, "invalid_param", f"params.{stage_name} must be an object")
            accepted = self.d.accepted_params(stage_name)
            for key, value in values.items():
                if accepted is not None and key not in accepted:
                    raise Refused(400, "invalid_param", f"stage {stage_name!r} has no parameter {key!r}; "
                                  f"known: {', '.join(sorted(accepted))}")
                if not _plain_json(value):
                    raise Refused(400, "invalid_param", f"params.{stage_name}.{key} must be a string, number, "
                                  "boolean, or a list of those")
                why = check_param(self.d.config.stages[stage_name].engine, key, value)
                if why is not None:
                    raise Refused(400, "invalid_param", f"params.{stage_name}.{key} {why}, not {value!r}")
            out[stage_name] = dict(values)
        return out

    async def list_jobs(self, request: web.Request) -> web.Response:
        q = request.query
        state = q.get("state")
        if state is not None and state not in STATES:
            raise Refused(400, "invalid_request", f"state must be one of {', '.join(STATES)}")
        pipeline = q.get("pipeline")
        try:
            limit = int(q.get("limit", "50"))
            if not 1 <= limit <= 1000:
                raise ValueError
        except ValueError:
            raise Refused(400, "invalid_request", "limit must be an integer from 1 to 1000") from None
        uid = request["uid"]
        jobs = self.d.store.list(None if uid == 0 else uid, state, pipeline, limit)
        live = self.d.scheduler.live
        return web.json_response({"jobs": [live[j["id"]].doc if j["id"] in live else j for j in jobs]})

    async def get_job(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request))

    async def events(self, request: web.Request) -> web.StreamResponse:
        doc = self._job(request)
        past, queue = self.d.scheduler.subscribe(doc["id"])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            for ev in past:
                await resp.write(json.dumps(ev).encode() + b"\n")
            # `subscribe` read the past and registered the queue in one step of the
            # loop, so no event is missed or sent twice.
            while queue is not None:
                ev = await queue.get()
                if ev is None:
                    break
                await resp.write(json.dumps(ev).encode() + b"\n")
            await resp.write_eof()
        finally:
            if queue is not None:
                self.d.scheduler.unsubscribe(doc["id"], queue)
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        doc = self._job(request)
        if doc["state"] in TERMINAL:
            return web.json_response(doc)
        return web.json_response(self.d.scheduler.cancel(doc["id"]) or self._job(request))

    async def delete(self, request: web.Request) -> web.Response:
        doc = self._job(request)
        if doc["state"] not in TERMINAL:
            raise Refused(409, "job_not_finished", f"job {doc['id']} is {doc['state']}; cancel it first")
        self.d.store.delete(doc["id"])
        return web.json_response({"deleted": doc["id"]})

    async def output(self, request: web.Request) -> web.StreamResponse:
        doc = self._job(request)
        name = request.match_info["name"]
        for out in doc["outputs"]:
            if out["name"] == name or out["file"] == name:
                path = self.d.store.job_dir(doc["id"]) / out["file"]
                if not path.is_file():
                    raise Refused(410, "output_gone", f"output {name!r} of job {doc['id']} is no longer on disk")
                return web.FileResponse(path, headers={"Content-Type": out["content_type"]})
        if doc["state"] not in TERMINAL:
            raise Refused(409, "job_not_finished", f"job {doc['id']} is {doc['state']}; output {name!r} "
                          "is not there yet")
        names = ", ".join(o["name"] for o in doc["outputs"]) or "none"
        raise Refused(404, "unknown_output", f"job {doc['id']} has no output {name!r} (its outputs: {names})")

    # ------------------------------------------------------------------ daemon

    async def pipelines(self, request: web.Request) -> web.Response:
        return web.json_response({"pipelines": [p.as_api() for p in self.d.config.pipelines.values()]})

    async def stages(self, request: web.Request) -> web.Response:
        return web.json_response({"stages": [h.snapshot() for h in self.d.stages.values()]})

    async def health(self, request: web.Request) -> web.Response:
        sched = self.d.scheduler
        return web.json_response({"status": "ok", "pid": self.d.pid, "uptime_s": round(time.time() - self.d.started, 3),
                                  "version": self.d.version, "live_jobs": len(sched.live) if sched else 0,
                                  "stopping_jobs": len(sched.stopping) if sched else 0})

    async def ready(self, request: web.Request) -> web.Response:
        states = {name: h.state for name, h in self.d.stages.items()}
        not_ready = sorted(n for n, s in states.items() if s not in ("ready", "busy"))
        body = {"ready": not not_ready, "stages": states, "not_ready": not_ready}
        return web.json_response(body, status=200 if not not_ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        data = generate_latest(self.d.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _plain_json(value: Any) -> bool:
    if isinstance(value, (str, bool, int)) or value is None:
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_plain_json(v) and not isinstance(v, list) and v is not None for v in value)
    return False
