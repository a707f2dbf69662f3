"""An OpenAI request's job once it exists (common.py submits it): followed for its answer's text
(counted into its `Generation`), streamed as server-sent chunks, cancelled when its answer is over
before it ended (the caller went away); its outputs read once it succeeded. A text answer, whole or
streamed, is made here for chat.py and completions.py (`OpenAiJobs.text_answer`).

Runs in the supervisor's event-loop thread, for the OpenAI handlers and the Realtime session
(realtime/responses.py). It waits on the job's event queue (an asyncio queue; whether the caller hung
up is looked at after every event and after every quiet DISCONNECT_POLL_S, so a hang-up cancels the
job however fast its events flow) and reads small output files in the loop's default executor;
nothing blocks. Every answer on the OpenAI paths names its job in `X-Omnid-Job` (`on_prepare`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from omnid.config import PipelineConfig
from omnid.store import JobStore
from omnid.supervisor.http.http_common import follow_batches, sse_done, sse_response, sse_send
from omnid.supervisor.http.openai.common import (
    CONTENT_TYPE_KEY,
    JOB_KEY,
    OPENAI_PATHS,
    WAIT_KEY,
    Generation,
    OpenAiError,
    error_event,
    take,
    usage,
)
from omnid.vocabulary import ErrorCode, JobOutput, JobRecord, JobState

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore
    from omnid.supervisor.jobs.scheduler import Scheduler

log = structlog.get_logger("omnid.openai")

JOB_HEADER = "X-Omnid-Job"             # the request's JOB_KEY (common.py), and its WAIT_KEY's place:
QUEUE_POSITION_HEADER = "X-Omnid-Queue-Position"        # 1: next to start
ESTIMATED_START_HEADER = "X-Omnid-Estimated-Start"      # seconds from the answer's start


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer on these paths names its job; a streamed output of unknown type gets its type."""
    if not request.path.startswith(OPENAI_PATHS):
        return
    job = request.get(JOB_KEY)
    if job is not None:
        response.headers[JOB_HEADER] = str(job)
    wait = request.get(WAIT_KEY)            # a stream waiting for a real-time pipeline's capacity
    if wait:
        response.headers[QUEUE_POSITION_HEADER] = str(wait["position"])
        response.headers[ESTIMATED_START_HEADER] = str(wait["estimated_start_s"])
    ctype = request.get(CONTENT_TYPE_KEY)
    if ctype is not None and response.content_type == "application/octet-stream":
        response.content_type = str(ctype)


def pick(outputs: list[JobOutput], kind: str, name: str, stage: str | None) -> JobOutput | None:
    """The output of `kind` named `name` (else the first of that kind), of `stage` if given."""
    mine = [o for o in outputs if o["kind"] == kind and (stage is None or o.get("stage") == stage)]
    return next((o for o in mine if o["name"] == name), mine[0] if mine and stage is not None else None)


def succeeded(scheduler: Scheduler, job_id: str) -> JobRecord:
    """The ended job's record; OpenAiError when it did not succeed."""
    record = scheduler.job(job_id)
    if record is None:
        raise OpenAiError(500, f"job {job_id} was deleted before it was answered", code="unknown_job",
                          retry=False)
    if record.state is not JobState.SUCCEEDED:
        err = record.error
        why = (err.message if err else "") or "no reason given"
        if err is not None and err.code is ErrorCode.INPUT_REJECTED:     # the request's fault, found by the engine
            raise OpenAiError(400, f"the model refused the request: {why}", code=str(err.code), retry=False)
        raise OpenAiError(504 if record.state is JobState.TIMED_OUT else 500, f"job {job_id} {record.state}: {why}",
                          code=str(err.code if err else record.state), retry=False)
    return record


async def read_output(store: JobStore, record: JobRecord, out: JobOutput) -> bytes:
    """One output's bytes (in the loop's default executor); 410 when its file is gone."""
    path = store.job_dir(record.id) / out["file"]
    try:
        return await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
    except FileNotFoundError:
        raise OpenAiError(410, f"output {out['name']!r} of job {record.id} is no longer on disk",
                          code=ErrorCode.OUTPUT_GONE) from None


class Opening:
    """A stream's opening chunk (a chat's role chunk), held until the first chunk that follows it:
    `take()` gives it once, in a list to splat into `sse_send`, then nothing."""

    def __init__(self, chunk: dict[str, Any] | None) -> None:
        self._chunk = chunk

    def take(self) -> list[dict[str, Any]]:
        chunk, self._chunk = self._chunk, None
        return [chunk] if chunk is not None else []


class OpenAiJobs:
    """The jobs of the OpenAI paths, on the `ApiCore`'s collaborators (config, store, scheduler)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

    def abandon(self, request: web.Request, job_id: str) -> None:
        """The answer is over (sent, failed, or its caller went away): a job still live is cancelled."""
        if job_id in self.api.scheduler.live_jobs:
            self.api.scheduler.cancel(job_id)
            log.info("audit", action="cancel", uid=request["uid"], job=job_id, why="the caller went away",
                     via=request.path)

    async def deltas(self, request: web.Request, job: JobRecord, gen: Generation,
                     on_event: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
        """The answer's text as its segments come, what arrived at once joined (one SSE write);
        raises OpenAiError if the job ends badly. A last stage that streamed no text is answered
        with its `text` output once the job ended. `on_event` is awaited at every arrival (an audio
        chat sends the speech made meanwhile)."""
        async with aclosing(follow_batches(request, self.api.scheduler, job.id)) as batches:
            async for batch in batches:
                if on_event is not None:
                    await on_event()
                done = gen.text_done
                texts = [text for ev in batch if (text := take(ev, gen))]
                if texts:
                    text = "".join(texts)
                    gen.pieces.append(text)
                    yield text
                elif gen.text_done and not done:
                    yield ""                    # (the text stage's last segment had no text: its end, at once)
        record = succeeded(self.api.scheduler, job.id)
        text = await self.text_at_end(record, gen)
        if text:
            yield text

    async def text_at_end(self, record: JobRecord, gen: Generation) -> str:
        """The answer of a job whose text stage streamed no text (a python function that returns its
        `text`): that output's text, once the job succeeded, counted as one piece ("" when it streamed
        text, or has none). Every text answer calls it after its last delta (chat, completions, Realtime)."""
        if gen.pieces:
            return ""
        text_out = pick(record.outputs, "text", "text", gen.text_stage)
        if text_out is None:
            return ""
        text = (await read_output(self.api.store, record, text_out)).decode("utf-8", errors="replace")
        if text:
            gen.pieces.append(text)
            gen.segments = max(gen.segments, 1)
        return text

    async def sse_answer(self, request: web.Request, resp: web.StreamResponse, job: JobRecord, gen: Generation,
                         usage_head: Mapping[str, Any] | None, piece: Callable[[str], dict[str, Any]],
                         last: Callable[[], dict[str, Any]],
                         on_event: Callable[[], Awaitable[None]] | None = None,
                         opening: Opening | None = None,
                         last_piece: Callable[[str], dict[str, Any]] | None = None) -> None:
        """A streamed answer's tail: a chunk per piece of text (`on_event` awaited at every event and
        once more at the end), the `last` chunk and the usage chunk (when `usage_head`), or the job's
        error said in the stream as OpenAI's servers do; then `[DONE]`. `opening` (a chat's role
        chunk) goes out with the first of them, in the same write.

        `last_piece(text)`: the last chunk with the answer's last text in it, as `vllm serve` ends a
        stream: sent as soon as the text stage's last segment arrives when no stage follows it (the
        job's own end, its outputs written, comes a few ms later: the usage chunk and `[DONE]` wait
        for it, and a job that fails even then says its error after)."""
        opening = opening or Opening(None)
        ended = False
        try:
            async for text in self.deltas(request, job, gen, on_event=on_event):
                if last_piece is not None and gen.ends_job and gen.text_done and not ended:
                    ended = True
                    await sse_send(resp, *opening.take(), last_piece(text))
                elif text:
                    await sse_send(resp, *opening.take(), piece(text))
            if on_event is not None:
                await on_event()                # the rest, once the job has ended
        except OpenAiError as e:
            await sse_send(resp, *opening.take(), error_event(e))
        else:
            if not ended:
                await sse_send(resp, *opening.take(), last())
            if usage_head is not None:
                await sse_send(resp, {**usage_head, "choices": [], "usage": usage(gen)})
        await sse_done(resp)

    # ------------------------------------------------------------------ a text answer (chat, completions)

    async def text_answer(self, request: web.Request, p: PipelineConfig, job: JobRecord, gen: Generation,
                          stream: bool, include_usage: bool, chat: bool, echo: str) -> web.StreamResponse:
        """A text job's answer as a chat completion (`chat`) or a completion (after its `echo`): whole,
        or streamed (`_stream_text`); the job cancelled if the answer ends before it."""
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "object": kind,
                "created": int(job.created_at), "model": p.name}
        try:
            if stream:
                return await self._stream_text(request, job, gen, head, chat, include_usage, echo)
            text = echo + "".join([piece async for piece in self.deltas(request, job, gen)])
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            return web.json_response({**head, "choices": [choice], "usage": usage(gen)})
        finally:
            self.abandon(request, job.id)

    async def _stream_text(self, request: web.Request, job: JobRecord, gen: Generation, head: Mapping[str, Any],
                           chat: bool, include_usage: bool, echo: str) -> web.StreamResponse:
        """Server-sent events: one chunk per text segment, a last one with `finish_reason`, `[DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        resp = await sse_response(request)

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                choice["delta"] = ({"role": "assistant", "content": "", "refusal": None} if first
                                   else {} if text is None else {"content": text})
            else:
                choice["text"] = text or ""
            return {**head, "choices": [choice], **({"usage": None} if include_usage else {})}

        # A chat's role chunk goes with its first text, as `vllm serve` sends it: a client that
        # times the first chunk (vLLM's benchmark, for one) times the first token, not the POST.
        opening = Opening(chunk(None, first=True) if chat else None)
        try:
            if echo:
                await sse_send(resp, *opening.take(), chunk(echo))
            await self.sse_answer(request, resp, job, gen, head if include_usage else None, chunk,
                                  lambda: chunk(None, gen.finish_reason), opening=opening,
                                  last_piece=lambda text: chunk(text or None, gen.finish_reason))
        except ConnectionError as e:
            log.debug("chat stream reader went away", job=job.id, error=str(e))
        return resp


class Endpoint:
    """An endpoint's handler (chat.py, completions.py, images.py, speech.py), on the OpenAI paths'
    jobs and the `ApiCore`'s collaborators (config, store, scheduler)."""

    def __init__(self, jobs: OpenAiJobs) -> None:
        self.jobs, self.api = jobs, jobs.api
