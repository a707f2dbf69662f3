"""What the HTTP front ends share (the socket API, its OpenAI-compatible paths, the TCP door):
query flags, a job's event stream and whether its caller hung up, a job's output
files (whole or as they grow), a log file sent (and followed), server-sent events.

Runs in the supervisor's event-loop thread; nothing here blocks: file reads go to the loop's
default executor, waits are asyncio sleeps and queue reads.
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
import os
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

import structlog
from aiohttp import web

from omnid.paths import stream_file
from omnid.store import JobStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.jobs.live_job import LAGGED
from omnid.supervisor.jobs.scheduler import Scheduler
from omnid.supervisor.workers import stage_logs
from omnid.vocabulary import ErrorCode, Event, JobRecord

log = structlog.get_logger("omnid.api")

STREAM_POLL_S = 0.03          # `?stream=1`: how often a live output's stream file is looked at
STREAM_CHUNK = 64 * 1024
_FLAGS = {"1": True, "true": True, "0": False, "false": False}
LOG_POLL_S = 0.1              # `?follow=1`: how often a log file is looked at for new lines
DISCONNECT_POLL_S = 0.25      # how long a handler waiting on a quiet job may take to see that its caller hung up
HUNG_UP = cast(Event, {"type": "hung_up"})     # what HangupWatch puts in the queue of a caller that is gone (a mark)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# ------------------------------------------------------------------ the request (its JSON body: admission.py's json_body)


def flag(value: str | None, name: str) -> bool:
    """A 1/true, 0/false query flag (none: false); anything else is refused."""
    if value is None:
        return False
    found = _FLAGS.get(value.strip().lower())
    if found is None:
        raise Refused(400, ErrorCode.INVALID_REQUEST, f"{name} must be 1 or true (or 0 or false), not {value!r}")
    return found


def gone(request: web.Request) -> bool:
    """The caller hung up."""
    transport = request.transport
    return transport is None or transport.is_closing()


# ------------------------------------------------------------------ a job's events


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
                if gone(request):
                    del self._waiting[queue]
                    try:
                        queue.put_nowait(HUNG_UP)
                    except asyncio.QueueFull:
                        pass            # it has events to read: it looks at its caller after the next one


_hangups = HangupWatch()


async def next_event(request: web.Request, queue: asyncio.Queue[Any]) -> Any:
    """The queue's next item; ConnectionResetError once the caller hung up: looked at after every
    item, and within DISCONNECT_POLL_S while the job is quiet (`HangupWatch`)."""
    _hangups.watch(request, queue)
    try:
        item = await queue.get()
    finally:
        _hangups.forget(queue)
    if item is HUNG_UP or gone(request):
        raise ConnectionResetError("the client went away")
    return item


async def follow_batches(request: web.Request, scheduler: Scheduler,
                         job_id: str) -> AsyncGenerator[list[Event], None]:
    """The job's events from its start until it ended, each once, as the lists that are there at
    once (the past in one, then what one wake-up finds queued: a step's tokens of a batch come
    together), so a reader writes each list in one write. ConnectionResetError if the caller hangs
    up. A reader that fell behind (its queue dropped: LAGGED) reads the rest from the store.
    (Close it when done, `contextlib.aclosing`: that ends its subscription at once.)"""
    sent = 0
    past, queue = scheduler.subscribe(job_id)
    try:
        while True:
            # `subscribe` read the past and registered the queue in one step of the loop, so no
            # event is missed or sent twice.
            if past:
                sent += len(past)
                yield list(past)
            if queue is None:
                return
            lagged = False
            while not lagged:
                # The hang-up is looked at after every wake-up as well as after every quiet
                # DISCONNECT_POLL_S: a job whose events flow (every token) is cancelled too.
                item = await next_event(request, queue)
                batch: list[Event] = []
                while True:
                    if item is None:
                        if batch:
                            yield batch
                        return
                    if item is LAGGED:
                        lagged = True
                        break
                    if item is HUNG_UP:
                        raise ConnectionResetError("the client went away")
                    batch.append(item)
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                if batch:
                    sent += len(batch)
                    yield batch
            log.debug("event reader fell behind; catching up from the store", job=job_id, sent=sent)
            scheduler.unsubscribe(job_id, queue)
            past, queue = scheduler.subscribe(job_id, after=sent)
    finally:
        if queue is not None:
            scheduler.unsubscribe(job_id, queue)


async def follow(request: web.Request, scheduler: Scheduler, job_id: str) -> AsyncGenerator[Event, None]:
    """`follow_batches`, one event at a time."""
    async with aclosing(follow_batches(request, scheduler, job_id)) as batches:
        async for batch in batches:
            for ev in batch:
                yield ev


# ------------------------------------------------------------------ a job's outputs


def output_file(store: JobStore, job: JobRecord, name: str) -> web.StreamResponse:
    """The output's final file, or why there is none (409 running, 410 gone, 404 no such output)."""
    for out in job.outputs:
        if out["name"] == name or out["file"] == name:
            path = store.job_dir(job.id) / out["file"]
            if not path.is_file():
                raise Refused(410, ErrorCode.OUTPUT_GONE, f"output {name!r} of job {job.id} is no longer on disk")
            return web.FileResponse(path, headers={"Content-Type": out["content_type"]})
    if not job.terminal:
        raise Refused(409, ErrorCode.JOB_NOT_FINISHED, f"job {job.id} is {job.state}; output {name!r} "
                      "is not there yet")
    names = ", ".join(o["name"] for o in job.outputs) or "none"
    raise Refused(404, ErrorCode.UNKNOWN_OUTPUT, f"job {job.id} has no output {name!r} (its outputs: {names})")


def _ended(scheduler: Scheduler, job_id: str) -> JobRecord | None:
    """The job's record once it is no longer live (terminal, or None if deleted meanwhile); None while live."""
    if job_id in scheduler.live_jobs:
        return None
    found = scheduler.job(job_id)
    if found is None:
        raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {job_id!r}")
    return found


async def stream_output(request: web.Request, store: JobStore, scheduler: Scheduler, job: JobRecord,
                        name: str) -> web.StreamResponse:
    """`?stream=1` on a live job: the last stage's `.stream/NAME` file, sent as it grows (chunked).

    Waits (polling, bounded by the job's end) for the file to appear; a job that ends without one
    is answered like a plain download. Once the file is open, its bytes are sent until the job is
    terminal and the file is read to its end (the worker removes the file when the job ends there;
    our open file keeps it readable).
    """
    path = stream_file(store.job_dir(job.id), name)
    while True:
        try:
            f = open(path, "rb")
            break
        except (FileNotFoundError, NotADirectoryError):
            over = _ended(scheduler, job.id)
            if over is not None:            # it ended with no stream file: its final files, if any
                return output_file(store, over, name)
        if gone(request):
            log.debug("output stream reader went away", job=job.id, output=name)
            return web.Response(status=499)       # nobody to answer: not sent
        await asyncio.sleep(STREAM_POLL_S)
    try:
        resp = web.StreamResponse(headers={"Content-Type": _stream_content_type(scheduler, job, name)})
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
            ended = job.id not in scheduler.live_jobs
            if not ended:
                if gone(request):
                    raise ConnectionResetError("the client went away")
                await asyncio.sleep(STREAM_POLL_S)
        await resp.write_eof()
        return resp
    except ConnectionError as e:
        log.debug("output stream reader went away", job=job.id, output=name, error=str(e))
        return resp
    finally:
        f.close()


def _stream_content_type(scheduler: Scheduler, job: JobRecord, name: str) -> str:
    """The final output's content type when it is known already, else a guess from the name."""
    current = scheduler.job(job.id) or job
    for out in current.outputs:
        if out["name"] == name or out["file"] == name:
            return str(out["content_type"])
    guessed, _ = mimetypes.guess_type(name, strict=False)
    if (guessed or "").startswith("text/") or name.rpartition(".")[2] == "text":
        return "text/plain; charset=utf-8"
    return guessed or "application/octet-stream"


# ------------------------------------------------------------------ logs (stage_logs.py)


async def send_log(request: web.Request, path: Path, keep: int, stopping: Callable[[], bool]) -> web.StreamResponse:
    """A log file as `TIME LINE` text lines: `?since=`, `?tail=N`, `?follow=1` (until the caller
    hangs up or `stopping()`). Logs can hold other users' prompts: the callers are checked before
    this. File reads run in the executor; a follower polls the file (an fstat, every LOG_POLL_S),
    holding one batch of lines at a time."""
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
    following = flag(q.get("follow"), "follow")
    loop = asyncio.get_running_loop()
    reader = stage_logs.LogReader(path, keep, since)
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
        while following and not stopping():
            if reader.changed():
                reader.follow_rotation()
                lines = await loop.run_in_executor(None, reader.read)
                if lines:
                    await resp.write(b"".join(lines))
                    continue
            if gone(request):
                raise ConnectionResetError("the client went away")
            await asyncio.sleep(LOG_POLL_S)
        await resp.write_eof()
        return resp
    except ConnectionError as e:
        log.debug("log reader went away", path=str(path), error=str(e))
        return resp
    finally:
        reader.close()


# ------------------------------------------------------------------ server-sent events


async def sse_response(request: web.Request) -> web.StreamResponse:
    """A `text/event-stream` answer, prepared (its headers sent)."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def sse_send(resp: web.StreamResponse, *objs: dict[str, Any]) -> None:
    """Events, one `data: JSON` each, in one write."""
    await resp.write(b"".join(b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in objs))


async def sse_done(resp: web.StreamResponse) -> None:
    """The stream's end, as OpenAI's servers say it: `data: [DONE]`."""
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
