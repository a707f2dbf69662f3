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
To add an endpoint: a handler method here and its route in `Api.__init__`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import grp
import json
import mimetypes
import os
import pwd
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from omnid import media
from omnid.config import TENSOR_PROMPTS, Config, PipelineConfig, StageConfig
from omnid.metrics import Metrics
from omnid.params import job_param_problem, merged, plain_value, values_problem
from omnid.store import JobStore, StoreWriteFailed
from omnid.supervisor import stage_logs
from omnid.supervisor.errors import STORAGE_RETRY_AFTER_S, Refused
from omnid.supervisor.live_job import LAGGED
from omnid.supervisor.resources import DiskWatch
from omnid.supervisor.openapi import describe_pipeline, openapi_document
from omnid.supervisor.scheduler import Scheduler
from omnid.supervisor.stage_group import StageGroup
from omnid.supervisor.live import Live
from omnid.vocabulary import TERMINAL_JOB_STATES, DaemonState, ErrorCode, JobRecord, JobState, WorkerState
from omnid.worker.outputs import stream_file

log = structlog.get_logger("omnid.api")

MAX_TIMEOUT_S = 7 * 24 * 3600.0
MIN_PREFIX = 4                # a job id prefix shorter than this names no job (store.resolve)
SUMMARY_CHARS = 1000          # how much of a long text input the job document shows
# (in the order the API has always listed them)
_STATE_NAMES = ", ".join([str(JobState.QUEUED), str(JobState.RUNNING), *sorted(map(str, TERMINAL_JOB_STATES))])
_JOB_KEYS = {"pipeline", "inputs", "params", "timeout_s"}
MAX_BYTES_KEY = web.AppKey("max_request_bytes", int)
STREAM_POLL_S = 0.03          # `?stream=1`: how often a live output's stream file is looked at
STREAM_CHUNK = 64 * 1024
_STREAM_FLAGS = {"1": True, "true": True, "0": False, "false": False}
LOG_POLL_S = 0.1              # `?follow=1`: how often a log file is looked at for new lines


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


RETRY_AFTER_S = 2      # what 429 and 503 answers suggest to wait before trying again (507: STORAGE_RETRY_AFTER_S)


def retry_after(status: int) -> dict[str, str]:
    """The Retry-After header of a refusal that may pass by itself (429, 503, 507)."""
    if status == 507:
        return {"Retry-After": str(STORAGE_RETRY_AFTER_S)}
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}


def error(status: int, code: ErrorCode, message: str, **extra: Any) -> web.Response:
    headers = retry_after(status) or None
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
    def __init__(self, config: Config | Live, store: JobStore, scheduler: Scheduler, stages: Mapping[str, StageGroup],
                 metrics: Metrics, info: DaemonInfo) -> None:
        self.live = Live.of(config)     # the config in force (`config` reads it; a reload changes it there)
        config = self.live.config
        self.store = store
        self.scheduler = scheduler
        self.stages = stages
        self.metrics = metrics
        self.info = info
        self._tasks: set[asyncio.Task[None]] = set()     # stage restarts in progress
        self.disk: DiskWatch | None = None               # the state dir's space (the daemon sets it)
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
            web.get("/v1/stages/{name}/logs", self.stage_logs),
            web.get("/v1/logs", self.daemon_logs),
            web.get("/v1/health", self.health),
            web.get("/v1/ready", self.ready),
            web.get("/metrics", self.get_metrics),
        ])
        self.app = app                  # (the daemon mounts the OpenAI-compatible paths: openai_api.py)

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
        if uid != 0 and job.owner_uid != uid:
            raise Refused(403, ErrorCode.NOT_YOURS, f"job {job.id} belongs to another user")
        return job

    async def _json_body(self, request: web.Request) -> Any:
        limit = request.app[MAX_BYTES_KEY]
        if request.content_length is not None and request.content_length > limit:
            raise Refused(413, ErrorCode.TOO_LARGE, f"the request body is larger than {limit} bytes "
                          "(daemon.max_request_bytes)", max_bytes=limit)
        raw = await request.read()
        try:
            # NaN and Infinity are not JSON: refused here, they could never be answered as JSON.
            return json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise Refused(400, ErrorCode.BAD_JSON, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise Refused(400, ErrorCode.BAD_JSON, "the request body is nested too deeply") from None

    @property
    def config(self) -> Config:
        return self.live.config

    # ------------------------------------------------------------------ jobs

    async def submit(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
        unknown = set(body) - _JOB_KEYS
        if unknown:
            raise Refused(400, ErrorCode.INVALID_REQUEST, f"unknown field(s) {', '.join(sorted(unknown))}; "
                          f"a job has {', '.join(sorted(_JOB_KEYS))}")
        name = body.get("pipeline")
        if not isinstance(name, str) or not name:
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"pipeline\" must name a pipeline")
        pipeline = self.config.pipelines.get(name)
        if pipeline is None:
            raise Refused(400, ErrorCode.UNKNOWN_PIPELINE, f"no pipeline {name!r}; known: "
                          f"{', '.join(sorted(self.config.pipelines))}")
        inputs, summary = self._inputs(body.get("inputs", {}), pipeline)
        params = self._params(body.get("params", {}), pipeline)
        timeout = body.get("timeout_s")
        if timeout is not None:
            # A range check, not math.isfinite: that overflows on a 400-digit integer.
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                    or not 0 < timeout <= MAX_TIMEOUT_S:
                raise Refused(400, ErrorCode.INVALID_REQUEST, f"\"timeout_s\" must be a number of seconds in "
                              f"(0, {MAX_TIMEOUT_S:.0f}], not {timeout!r}")
            timeout = float(timeout)
        if self.info.stopping:
            raise Refused(503, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if self.info.draining:
            raise Refused(503, ErrorCode.DRAINING, "the daemon is stopping: it finishes the jobs it is running "
                          "and keeps the queued ones for its next start; submit again once it is back")
        self.check_disk()
        job = self.scheduler.submit(request["uid"], name, inputs, params, timeout, summary)
        self.store.flush()              # a 201 means the job is in the database
        log.info("audit", action="submit", uid=request["uid"], job=job.id, pipeline=name)
        return web.json_response(job.to_doc(), status=201, headers={"Location": f"/v1/jobs/{job.id}"})

    def check_disk(self) -> None:
        """507 `insufficient_storage` while the state dir is short (`resources.DiskWatch`): a job
        taken now might not be kept. Every submit path calls it."""
        if self.disk is None:
            return
        state = self.disk.check()
        if state.full:
            self.metrics.refused.labels(str(ErrorCode.DISK_FULL)).inc()
            raise Refused(507, ErrorCode.INSUFFICIENT_STORAGE, f"the daemon is short of disk space and takes no new "
                          f"jobs: {state.reason}. Jobs already taken go on; free space (omnictl rm, or retention: "
                          f"daemon.keep_jobs) and submit again", retry_after_s=STORAGE_RETRY_AFTER_S,
                          disk=state.as_doc(self.disk))

    def _inputs(self, raw: Any, pipeline: PipelineConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """A job's `inputs` as JSON gives them, decoded (files to bytes) and checked for the
        pipeline's first stages; with the summary the job document shows."""
        if not isinstance(raw, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"inputs\" must be an object of named inputs")
        inputs: dict[str, Any] = {}
        summary: dict[str, Any] = {}
        for key, value in raw.items():
            if not key or len(key) > 128:
                raise Refused(400, ErrorCode.INVALID_INPUT, f"input name {key!r} is empty or too long")
            if isinstance(value, (str, int, float, bool)) or value is None:
                if not plain_value(value):
                    raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r} is not a finite number")
                inputs[key] = value
                summary[key] = self.text_summary(value) if isinstance(value, str) else value
            elif _is_file(value) or _is_samples(value):
                inputs[key], summary[key] = _file_or_samples(key, value)
            elif isinstance(value, list) and value and all(_is_file(v) or _is_samples(v) for v in value):
                decoded = [_file_or_samples(f"{key}[{i}]", v) for i, v in enumerate(value)]
                inputs[key] = [data for data, _ in decoded]
                summary[key] = [doc for _, doc in decoded]
            elif isinstance(value, list) and plain_value(value):
                inputs[key] = summary[key] = value
            else:
                raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r} must be a string, number, boolean, list of "
                              "those, a file {\"b64\": ..., \"filename\": ...} or a list of files, or audio samples "
                              "{\"samples\": [...], \"rate\": HZ}")
        self.check_inputs(inputs, summary, pipeline)
        return inputs, summary

    @staticmethod
    def text_summary(value: str) -> str:
        """A text input as the job document shows it: long ones cut (listings stay small)."""
        return value if len(value) <= SUMMARY_CHARS else value[:SUMMARY_CHARS] + f"... ({len(value)} characters)"

    def check_inputs(self, inputs: dict[str, Any], summary: dict[str, Any], pipeline: PipelineConfig) -> None:
        """What the pipeline's first stages need of a job's (decoded) inputs: a vllm or diffusers
        stage's text `prompt`, a vllm stage's media within its limits (each file's type and size
        read from its header; `summary` gains what was read). Refused names the input."""
        for src in pipeline.sources:
            stage = self.config.stages[src]
            has_media = stage.engine == "vllm" and self._check_media(stage, pipeline, inputs, summary)
            if stage.engine in ("vllm", "diffusers") and isinstance(inputs.get("prompt"), bytes):
                raise Refused(400, ErrorCode.INVALID_INPUT, f"input \"prompt\" of {stage.engine} stage {src!r} must be "
                              "text, not a file (use --prompt or --input prompt=...)")
            if stage.engine == "vllm" and (isinstance(inputs.get("messages"), str) or has_media
                                           or any(inputs.get(k) is not None for k in TENSOR_PROMPTS)):
                continue                # a chat (JSON text), media (the stage renders its chat template), tensors
            if stage.engine in ("vllm", "diffusers") and not isinstance(inputs.get("prompt"), str):
                raise Refused(400, ErrorCode.MISSING_INPUT, f"pipeline {pipeline.name!r} starts with {stage.engine} stage "
                              f"{src!r}, which needs a text input \"prompt\"")

    def _check_media(self, stage: StageConfig, pipeline: PipelineConfig, inputs: dict[str, Any],
                     summary: dict[str, Any]) -> bool:
        """A vllm first stage's media inputs against its `media` limits; True if the job has any."""
        found = False
        for kind in media.MEDIA_KINDS:
            value = inputs.get(kind)
            if value is None:
                continue
            found = True
            if not stage.media.count(kind):
                raise Refused(400, ErrorCode.MEDIA_NOT_ACCEPTED, f"input {kind!r}: pipeline {pipeline.name!r} starts "
                              f"with stage {stage.name!r}, whose model takes no {kind} input (the media it takes: "
                              f"{', '.join(stage.media.kinds) or 'none'})", input=kind)
            files = value if isinstance(value, list) else [value]
            if not all(isinstance(v, bytes) for v in files):
                what = "a list of frame files" if kind == "video" else "a file {\"b64\": ...} or a list of files"
                raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {kind!r} must be {what}", input=kind)
            try:
                found_items = media.check_media(kind, value, stage.media)
            except media.MediaError as e:
                raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {kind!r}{_filename(summary.get(kind))}: {e} "
                              f"(stage {stage.name!r})", input=kind) from None
            doc = summary.get(kind)
            if isinstance(doc, dict) and found_items:
                doc.update(found_items[0])
            elif isinstance(doc, list) and kind != "video":
                for item_doc, found_doc in zip(doc, found_items):
                    if isinstance(item_doc, dict):
                        item_doc.update(found_doc)
        chat = inputs.get("messages")
        if isinstance(chat, str) and '"type"' in chat:      # a chat may place media parts of its own
            try:
                placed = media.chat_media_counts(json.loads(chat))
            except ValueError:
                placed = {}             # (the stage says what is wrong with it)
            for kind, n in placed.items():
                if not n:
                    continue
                if not stage.media.count(kind):
                    raise Refused(400, ErrorCode.MEDIA_NOT_ACCEPTED, f"input \"messages\" has {kind} parts, but "
                                  f"stage {stage.name!r}'s model takes no {kind} input", input="messages")
                given = len(media.as_items(kind, inputs[kind])) if inputs.get(kind) is not None else 0
                if n != given:
                    raise Refused(400, ErrorCode.INVALID_MEDIA, f"input \"messages\" has {n} {kind} part(s), but "
                                  f"input {kind!r} gives {given}", input=kind)
                found = True
        return found

    def _params(self, raw: Any, pipeline: PipelineConfig) -> dict[str, dict[str, Any]]:
        if not isinstance(raw, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "\"params\" must be an object: {\"STAGE\": {\"KEY\": value}}")
        out: dict[str, dict[str, Any]] = {}
        for stage_name, values in raw.items():
            if stage_name not in pipeline.stages:
                raise Refused(400, ErrorCode.INVALID_PARAM, f"pipeline {pipeline.name!r} has no stage {stage_name!r} "
                              f"(its stages: {', '.join(pipeline.stages)})")
            if not isinstance(values, dict):
                raise Refused(400, ErrorCode.INVALID_PARAM, f"params.{stage_name} must be an object")
            stage = self.config.stages[stage_name]
            for key, value in values.items():
                why = job_param_problem(stage_name, stage.engine, stage.defaults, key, value)
                if why is not None:
                    raise Refused(400, ErrorCode.INVALID_PARAM, why)
            why = values_problem(stage_name, stage.engine, merged(stage.defaults, values))
            if why is not None:
                raise Refused(400, ErrorCode.INVALID_PARAM, why)
            out[stage_name] = dict(values)
        return out

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
        jobs = self.store.list(None if uid == 0 else uid, state, pipeline, limit)
        # A live job's stored row lags its record (progress is not written on every step).
        live = self.scheduler.live
        return web.json_response({"jobs": [(live[j.id].record if j.id in live else j).to_doc() for j in jobs]})

    async def get_job(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).to_doc())

    async def events(self, request: web.Request) -> web.StreamResponse:
        job = self._job(request)
        past, queue = self.scheduler.subscribe(job.id)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        sent = 0
        try:
            while True:
                for past_event in past:
                    await resp.write(json.dumps(past_event).encode() + b"\n")
                    sent += 1
                # `subscribe` read the past and registered the queue in one step of the
                # loop, so no event is missed or sent twice.
                event = await _next_event(request, queue) if queue is not None else None
                while event is not None and event is not LAGGED:
                    await resp.write(json.dumps(event).encode() + b"\n")
                    sent += 1
                    event = await _next_event(request, queue) if queue is not None else None
                if event is None:
                    break
                # We fell behind (this client reads slowly): the rest is in the store.
                log.debug("event reader fell behind; catching up from the store", job=job.id, sent=sent)
                past, queue = self.scheduler.subscribe(job.id, after=sent)
            await resp.write_eof()
        except ConnectionError as e:       # the reader hung up: its subscription goes (the job goes on)
            log.debug("event reader went away", job=job.id, sent=sent, error=str(e))
        finally:
            if queue is not None:
                self.scheduler.unsubscribe(job.id, queue)
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if job.terminal:
            return web.json_response(job.to_doc())
        cancelled = self.scheduler.cancel(job.id) or self._job(request)
        log.info("audit", action="cancel", uid=request["uid"], job=job.id, pipeline=job.pipeline)
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
        stream = _flag(request.query.get("stream"), "stream")
        job = self._job(request)
        name = request.match_info["name"]
        if not stream or job.terminal:
            return self._output_file(job, name)
        return await self._stream_output(request, job, name)

    def _output_file(self, job: JobRecord, name: str) -> web.StreamResponse:
        """The output's final file, or why there is none (409 running, 410 gone, 404 no such output)."""
        for out in job.outputs:
            if out["name"] == name or out["file"] == name:
                path = self.store.job_dir(job.id) / out["file"]
                if not path.is_file():
                    raise Refused(410, ErrorCode.OUTPUT_GONE, f"output {name!r} of job {job.id} is no longer on disk")
                return web.FileResponse(path, headers={"Content-Type": out["content_type"]})
        if not job.terminal:
            raise Refused(409, ErrorCode.JOB_NOT_FINISHED, f"job {job.id} is {job.state}; output {name!r} "
                          "is not there yet")
        names = ", ".join(o["name"] for o in job.outputs) or "none"
        raise Refused(404, ErrorCode.UNKNOWN_OUTPUT, f"job {job.id} has no output {name!r} (its outputs: {names})")

    def _ended(self, job_id: str) -> JobRecord | None:
        """The job's record once it is no longer live (terminal, or None if deleted meanwhile); None while live."""
        if job_id in self.scheduler.live:
            return None
        found = self.scheduler.job(job_id)
        if found is None:
            raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}")
        return found

    async def _stream_output(self, request: web.Request, job: JobRecord, name: str) -> web.StreamResponse:
        """`?stream=1` on a live job: the last stage's `.stream/NAME` file, sent as it grows (chunked).

        Waits (polling, bounded by the job's end) for the file to appear; a job that ends without one
        is answered like a plain download. Once the file is open, its bytes are sent until the job is
        terminal and the file is read to its end (the worker removes the file when the job ends there;
        our open file keeps it readable).
        """
        path = stream_file(self.store.job_dir(job.id), name)
        while True:
            try:
                f = open(path, "rb")
                break
            except (FileNotFoundError, NotADirectoryError):
                over = self._ended(job.id)
                if over is not None:            # it ended with no stream file: its final files, if any
                    return self._output_file(over, name)
            if _gone(request):
                log.debug("output stream reader went away", job=job.id, output=name)
                return web.Response(status=499)       # nobody to answer: not sent
            await asyncio.sleep(STREAM_POLL_S)
        try:
            resp = web.StreamResponse(headers={"Content-Type": self._stream_content_type(job, name)})
            loop = asyncio.get_running_loop()
            await resp.prepare(request)
            ended = False
            while True:
                # fstat first: the file is read only when it grew, so an idle stream costs no thread.
                if ended or os.fstat(f.fileno()).st_size > f.tell():
                    data = await loop.run_in_executor(None, f.read, STREAM_CHUNK)
                    if data:
                        await resp.write(data)
                        continue
                    if ended:
                        break                          # terminal, and read to the end
                ended = job.id not in self.scheduler.live
                if not ended:
                    if _gone(request):
                        raise ConnectionResetError("the client went away")
                    await asyncio.sleep(STREAM_POLL_S)
            await resp.write_eof()
            return resp
        except ConnectionError as e:
            log.debug("output stream reader went away", job=job.id, output=name, error=str(e))
            return resp
        finally:
            f.close()

    def _stream_content_type(self, job: JobRecord, name: str) -> str:
        """The final output's content type when it is known already, else a guess from the name."""
        current = self.scheduler.job(job.id) or job
        for out in current.outputs:
            if out["name"] == name or out["file"] == name:
                return str(out["content_type"])
        guessed, _ = mimetypes.guess_type(name, strict=False)
        if (guessed or "").startswith("text/") or name.rpartition(".")[2] == "text":
            return "text/plain; charset=utf-8"
        return guessed or "application/octet-stream"

    # ------------------------------------------------------------------ daemon

    async def list_pipelines(self, request: web.Request) -> web.Response:
        return web.json_response({"pipelines": [p.as_api() for p in self.config.pipelines.values()]})

    async def get_pipeline(self, request: web.Request) -> web.Response:
        """One pipeline: its inputs, each stage's parameters (types, limits, defaults), edges, outputs."""
        name = request.match_info["name"]
        pipeline = self.config.pipelines.get(name)
        if pipeline is None:
            raise Refused(404, ErrorCode.UNKNOWN_PIPELINE, f"no pipeline {name!r}; known: "
                          f"{', '.join(sorted(self.config.pipelines))}")
        return web.json_response(describe_pipeline(self.config, pipeline))

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of every route this app serves (read from its router now)."""
        return web.json_response(openapi_document(request.app, self.config, self.info.version))

    async def list_stages(self, request: web.Request) -> web.Response:
        return web.json_response({"stages": [h.snapshot() for h in self.stages.values()]})

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
        self._check_admin(request["uid"])
        group = self._stage(request)
        self._background(group.restart(f"asked for by uid {request['uid']}", self.config.daemon.drain_timeout_s))
        log.info("audit", action="restart_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"restarting": group.name, "stage": group.snapshot()}, status=202)

    async def sleep_stage(self, request: web.Request) -> web.Response:
        """Stop a stage's workers now, releasing their memory and GPUs, until a job (or `wake`) needs
        it; root or the admin group. 409 while it has work; 202 at once (`sleeping` in its state soon)."""
        self._check_admin(request["uid"])
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
        self._check_admin(request["uid"])
        group = self._stage(request)
        awake = not group.resting
        if not awake:
            group.touch()
            group.wake_soon()
        log.info("audit", action="wake_stage", uid=request["uid"], stage=group.name)
        return web.json_response({"waking": group.name, "already": awake, "stage": group.snapshot()},
                                 status=200 if awake else 202)

    def _check_admin(self, uid: int) -> None:
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
        self._check_admin(request["uid"])
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
        self._check_admin(request["uid"])
        return await self._send_log(request, stage_logs.daemon_log_path(self.config.daemon.state_dir))

    async def _send_log(self, request: web.Request, path: Path) -> web.StreamResponse:
        """Logs can hold other users' prompts: the callers are checked before this. File reads run in
        the executor; a follower polls the file (an fstat, every LOG_POLL_S) until it hangs up or the
        daemon stops, holding one batch of lines at a time."""
        q = request.query
        since: float | None = None
        if q.get("since"):
            try:
                since = stage_logs.parse_since(q["since"])
            except stage_logs.BadSince as e:
                raise Refused(400, ErrorCode.INVALID_REQUEST, str(e)) from None
        tail: int | None = None
        if q.get("tail") is not None:
            try:
                tail = int(q["tail"])
                if not 0 <= tail <= stage_logs.MAX_TAIL:
                    raise ValueError
            except ValueError:
                raise Refused(400, ErrorCode.INVALID_REQUEST,
                              f"tail must be an integer from 0 to {stage_logs.MAX_TAIL}") from None
        follow = _flag(q.get("follow"), "follow")
        loop = asyncio.get_running_loop()
        reader = stage_logs.LogReader(path, self.config.daemon.log_file_keep, since)
        await loop.run_in_executor(None, reader.open)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8",
                                               "X-Content-Type-Options": "nosniff"})
            await resp.prepare(request)
            if tail is not None:
                lines = await loop.run_in_executor(None, reader.tail, tail)
                if lines:
                    await resp.write(b"".join(lines))
            else:
                while lines := await loop.run_in_executor(None, reader.read):
                    await resp.write(b"".join(lines))
            while follow and not self.info.stopping:
                if reader.changed():
                    reader.follow_rotation()
                    lines = await loop.run_in_executor(None, reader.read)
                    if lines:
                        await resp.write(b"".join(lines))
                        continue
                if _gone(request):
                    raise ConnectionResetError("the client went away")
                await asyncio.sleep(LOG_POLL_S)
            await resp.write_eof()
            return resp
        except ConnectionError as e:
            log.debug("log reader went away", path=str(path), error=str(e))
            return resp
        finally:
            reader.close()

    async def health(self, request: web.Request) -> web.Response:
        info = self.info
        return web.json_response({"status": "ok", "pid": info.pid, "uptime_s": round(time.time() - info.started, 3),
                                  "version": info.version, "live_jobs": len(self.scheduler.live),
                                  "stopping_jobs": len(self.scheduler.stopping)})

    async def ready(self, request: web.Request) -> web.Response:
        """Ready when every stage takes jobs: warm, degraded (some replicas down: listed in
        `replicas_down`) or sleeping (it wakes for its next job)."""
        states = {name: str(h.state) for name, h in self.stages.items()}
        not_ready = sorted(name for name, h in self.stages.items()
                           if not h.takes_jobs or (self.info.starting and not h.state.warm))
        down = {name: {h.label: str(h.state) for h in g.down()} for name, g in self.stages.items() if g.down()}
        body: dict[str, Any] = {"ready": not not_ready and not self.info.draining, "stages": states,
                                "not_ready": not_ready, "replicas_down": down}
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
            body.setdefault("reasons", []).append(str(ErrorCode.DISK_FULL))

    async def get_metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _is_file(value: Any) -> bool:
    return isinstance(value, dict) and set(value) <= {"b64", "filename"} and isinstance(value.get("b64"), str) \
        and isinstance(value.get("filename"), (str, type(None)))


def _is_samples(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"samples", "rate"}


def _file_or_samples(key: str, value: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """A file input's bytes, or audio samples as a WAV file; and the summary the job shows of it."""
    if "samples" in value:
        rate = value["rate"]
        if isinstance(rate, float) and rate.is_integer():
            rate = int(rate)            # (JSON has one number type: 16000.0 is the integer its schema says)
        try:
            wav = media.samples_to_wav(value["samples"], rate)
        except media.MediaError as e:
            raise Refused(400, ErrorCode.INVALID_MEDIA, f"input {key!r}: {e}", input=key.partition("[")[0]) from None
        return wav, {"samples": len(value["samples"]), "rate": rate, "size": len(wav)}
    try:
        data = base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise Refused(400, ErrorCode.INVALID_INPUT, f"input {key!r}: \"b64\" is not valid base64") from None
    return data, {"filename": value.get("filename"), "size": len(data)}


def _filename(doc: Any) -> str:
    """` (cat.png)`, for an error about a named file input."""
    name = doc.get("filename") if isinstance(doc, dict) else None
    return f" ({name})" if isinstance(name, str) and name else ""


def _flag(value: str | None, name: str) -> bool:
    """A 1/true, 0/false query flag (none: false); anything else is refused."""
    if value is None:
        return False
    flag = _STREAM_FLAGS.get(value.strip().lower())
    if flag is None:
        raise Refused(400, ErrorCode.INVALID_REQUEST, f"{name} must be 1 or true (or 0 or false), not {value!r}")
    return flag


DISCONNECT_POLL_S = 0.25      # how long a handler waiting on a quiet job may take to see that its caller hung up
HUNG_UP: dict[str, Any] = {"type": "hung_up"}    # what HangupWatch puts in the queue of a caller that is gone


class HangupWatch:
    """One task for every handler that waits on a job's event queue: every DISCONNECT_POLL_S it
    looks at each waiting caller (a flag of its transport) and wakes the ones that hung up, with
    HUNG_UP in their queue. A waiting handler costs nothing of its own (no timer per stream), so
    thousands of quiet streams are held for a few microseconds a sweep."""

    def __init__(self) -> None:
        self._waiting: dict[asyncio.Queue[Any], web.Request] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, request: web.Request, queue: asyncio.Queue[Any]) -> None:
        self._waiting[queue] = request
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sweep(), name="hangup-watch")

    def forget(self, queue: asyncio.Queue[Any]) -> None:
        self._waiting.pop(queue, None)

    async def _sweep(self) -> None:
        while self._waiting:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for queue, request in list(self._waiting.items()):
                if _gone(request):
                    del self._waiting[queue]
                    try:
                        queue.put_nowait(HUNG_UP)
                    except asyncio.QueueFull:
                        pass            # it has events to read: it looks at its caller after the next one


_hangups = HangupWatch()


async def _next_event(request: web.Request, queue: asyncio.Queue[Any]) -> Any:
    """The queue's next item; ConnectionResetError once the caller hung up: looked at after every
    item, and within DISCONNECT_POLL_S while the job is quiet (`HangupWatch`)."""
    _hangups.watch(request, queue)
    try:
        item = await queue.get()
    finally:
        _hangups.forget(queue)
    if item is HUNG_UP or _gone(request):
        raise ConnectionResetError("the client went away")
    return item


def _gone(request: web.Request) -> bool:
    """The caller hung up."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
