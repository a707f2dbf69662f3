"""The socket API's jobs: `POST /v1/jobs` (a submission admitted, then taken: admission.py,
`ApiCore.take`), `GET /v1/jobs` (the caller's, or everyone's for root and admin keys), a job, its event
stream (NDJSON, as they come), cancel, delete, and its output files (whole, or `?stream=1` as a live
job's last stage produces them). A job is the caller's: only its uid (or root, or an admin key over
TCP) may read, cancel or delete it.

Runs in the supervisor's event-loop thread; nothing blocks (short sqlite reads, the scheduler's
event queue, output files read in the loop's default executor).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from omnid.store import StoreWriteFailed
from omnid.supervisor.errors import STORAGE_RETRY_AFTER_S, Refused
from omnid.supervisor.http import admission, trace_context
from omnid.supervisor.http.admission import json_body
from omnid.supervisor.http.http_common import flag, follow_batches, output_file, stream_output
from omnid.vocabulary import TERMINAL_JOB_STATES, ErrorCode, JobRecord, JobState, job_links

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.api")

MIN_PREFIX = 4                # a job id prefix shorter than this names no job (store.resolve)
# (in the order the API has always listed them)
_STATE_NAMES = ", ".join([str(JobState.QUEUED), str(JobState.RUNNING), *sorted(map(str, TERMINAL_JOB_STATES))])


class Jobs:
    """The job handlers, on the `ApiCore`'s collaborators (store, scheduler, config)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

    def _job(self, request: web.Request) -> JobRecord:
        """The job named in the path, if the caller may see it."""
        ref = request.match_info["id"]
        found = self.api.store.resolve(ref)
        if found is None:
            short = len(ref) < MIN_PREFIX     # (store.resolve matches prefixes of MIN_PREFIX or more only)
            raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {ref!r}" + (
                f": job id prefixes need at least {MIN_PREFIX} characters" if short else ""))
        if isinstance(found, list):
            raise Refused(400, ErrorCode.AMBIGUOUS_JOB, f"{ref!r} matches several jobs: {', '.join(found)}")
        job = self.api.scheduler.job(found)
        if job is None:
            raise Refused(404, ErrorCode.UNKNOWN_JOB, f"no job {ref!r}")
        uid = request["uid"]
        if not self.api.privileged(request) and job.owner_uid != uid:
            if request.get("tcp"):
                log.info("audit", action="refused", why="not_yours", uid=uid, job=job.id, method=request.method,
                         path=request.path)
            raise Refused(403, ErrorCode.NOT_YOURS, f"job {job.id} belongs to another user"
                          + (" (over TCP, only a key made with --admin acts on others' jobs)" if request.get("tcp") else ""))
        return job

    async def submit(self, request: web.Request) -> web.Response:
        sub = admission.job_submission(self.api.config, await json_body(request), request["uid"])
        sub = admission.owned(self.api.config, sub, request.get("api_key"), not request.get("tcp"))
        job = self.api.take(sub, "the daemon is stopping: it finishes the jobs it is running and keeps the "
                            "queued ones for its next start; submit again once it is back", request)
        log.info("audit", action="submit", uid=request["uid"], job=job.id, pipeline=sub.pipeline.name,
                 priority=sub.priority)
        trace = trace_context.trace_id(request)     # `[daemon] tracing`: the job's trace
        stream = self.api.scheduler.streams(job.id)     # a real-time pipeline's waiting stream: its place
        return web.json_response({**job.to_doc(), "links": job_links(job.id), **({"trace_id": trace} if trace else {}),
                                  **({"stream": stream} if stream else {})},
                                 status=201,
                                 headers={"Location": f"/v1/jobs/{job.id}"})

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
        jobs = self.api.store.list(None if self.api.privileged(request) else uid, state, pipeline, limit)
        # A live job's stored row lags its record (progress is not written on every step).
        live = self.api.scheduler.live_jobs
        return web.json_response({"jobs": [(live[j.id].record if j.id in live else j).to_doc() for j in jobs]})

    async def get_job(self, request: web.Request) -> web.Response:
        """A job; a queued one says where it waits (`queue`: per stage, its place and what is ahead);
        a real-time pipeline's (`stream`): its place and estimated start while it waits for capacity,
        its audio sent and its listener's slack once it plays."""
        job = self._job(request)
        doc = job.to_doc()
        places = self.api.scheduler.queue_places(job.id)
        if places:
            doc["queue"] = places
        stream = self.api.scheduler.streams(job.id)     # a real-time pipeline's: waiting (place) or playing (slack)
        if stream:
            doc["stream"] = stream
        return web.json_response(doc)

    async def events(self, request: web.Request) -> web.StreamResponse:
        job = self._job(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        sent = 0
        try:
            async with aclosing(follow_batches(request, self.api.scheduler, job.id)) as batches:
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
        cancelled = self.api.scheduler.cancel(job.id) or self._job(request)
        log.info("audit", action="cancel", uid=request["uid"], job=job.id, pipeline=job.pipeline,
                 owner_uid=job.owner_uid, **({"admin": True} if job.owner_uid != request["uid"] else {}))
        return web.json_response(cancelled.to_doc())

    async def delete(self, request: web.Request) -> web.Response:
        job = self._job(request)
        if not job.terminal:
            raise Refused(409, ErrorCode.JOB_NOT_FINISHED, f"job {job.id} is {job.state}; cancel it first")
        try:
            self.api.store.delete(job.id)
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
            return output_file(self.api.store, job, name)
        return await stream_output(request, self.api.store, self.api.scheduler, job, name)
