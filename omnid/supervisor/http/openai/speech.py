"""The OpenAI paths' audio answers: `POST /v1/audio/speech` (a pipeline that ends in audio: a WAV
streamed as it is produced, or live PCM16 / `speech.audio.delta` server-sent events), and a chat
answered in speech (`modalities: ["text", "audio"]`: `message.audio`, or `delta.audio` pieces).

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application
(openai_api.py routes `/v1/audio/speech` here and hands a chat that asks for audio here). Each
request is one ordinary omnid job (openai_jobs.py); its speech is read from the job's live WAV
stream (live_audio.py) at each of its events, or sent through the API's own `?stream=1` helper
(`http_common.stream_output`). Nothing blocks.
"""

from __future__ import annotations

import base64
from typing import Any

import structlog
from aiohttp import web

from omnid.config import PipelineConfig
from omnid.store import JobStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import follow, output_file, sse_response, sse_send, stream_output
from omnid.supervisor.http.openai.common import OpenAiError, error_event
from omnid.supervisor.http.openai.jobs import (
    CONTENT_TYPE_KEY,
    WAIT_KEY,
    Generation,
    OpenAiJobs,
    Opening,
    generation,
    read_output,
    succeeded,
    usage,
)
from omnid.supervisor.http.openai.live_audio import WAV_HEADER_BYTES, LiveAudio, wav_bytes
from omnid.supervisor.http.openai.models import pipeline_for
from omnid.supervisor.http.openai.protocol import SpeechRequest
from omnid.supervisor.http.openai.requests import read_body
from omnid.vocabulary import ErrorCode, JobRecord, JobState

log = structlog.get_logger("omnid.openai")

AUDIO_EXPIRES_S = 3600          # how long a chat's audio id is said to be good (the job's files may outlive it)


def _audio_name(store: JobStore, p: PipelineConfig) -> str:
    """The audio output's name: as the pipeline's latest successful job had it, else "audio"."""
    last = store.list(None, JobState.SUCCEEDED, p.name, 1)
    for out in last[0].outputs if last else []:
        if out["kind"] == "audio":
            return str(out["name"])
    return "audio"


class OpenAiAudio:
    """The speech handler and the audio chat's answer, on the OpenAI paths' jobs (`OpenAiJobs`)."""

    def __init__(self, jobs: OpenAiJobs) -> None:
        self.jobs = jobs
        self.api = jobs.api

    # ------------------------------------------------------------------ audio chat

    async def chat(self, request: web.Request, p: PipelineConfig, inputs: dict[str, Any],
                   params: dict[str, dict[str, Any]], summary: dict[str, Any], stream: bool,
                   include_usage: bool, fmt: str) -> web.StreamResponse:
        """A chat answered in text and speech, as OpenAI answers one: `message.audio` = {id, data
        (base64), expires_at, transcript}, the text being the transcript (`content` is null); streamed,
        `delta.audio` pieces: the transcript as it grows and the PCM16 as it is made."""
        gen = generation(self.api.config, p)
        job = self.jobs.submit(request, p, inputs, params, summary)
        head = {"id": "chatcmpl-" + job.id, "object": "chat.completion", "created": int(job.created_at),
                "model": p.name}
        audio_id = "audio_" + job.id
        expires = int(job.created_at) + AUDIO_EXPIRES_S
        try:
            if stream:
                return await self._stream_chat(request, job, gen, head, include_usage, audio_id, expires)
            transcript = "".join([piece async for piece in self.jobs.deltas(request, job, gen)])
            record = succeeded(self.api.scheduler, job.id)
            out = next((o for o in record.outputs if o["kind"] == "audio"), None)
            if out is None:
                raise OpenAiError(500, f"job {job.id} of model {p.name!r} ended with no audio output",
                                  code=ErrorCode.INTERNAL_ERROR)
            data = wav_bytes(await read_output(self.api.store, record, out))
            if fmt == "pcm16":
                data = data[WAV_HEADER_BYTES:]
            message = {"role": "assistant", "content": None, "refusal": None,
                       "audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii"),
                                 "expires_at": expires, "transcript": transcript}}
            choice = {"index": 0, "logprobs": None, "finish_reason": gen.finish_reason, "message": message}
            return web.json_response({**head, "choices": [choice], "usage": usage(gen)})
        finally:
            self.jobs.abandon(request, job.id)

    async def _stream_chat(self, request: web.Request, job: JobRecord, gen: Generation,
                           head: dict[str, Any], include_usage: bool, audio_id: str,
                           expires: int) -> web.StreamResponse:
        head = {**head, "object": "chat.completion.chunk"}
        resp = await sse_response(request)
        reader = LiveAudio(self.api.store.job_dir(job.id))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "delta": delta}],
                    **({"usage": None} if include_usage else {})}

        opening = Opening(chunk({"role": "assistant", "content": None, "refusal": None}))

        async def pcm_out() -> None:
            data = reader.read()
            if data:
                await sse_send(resp, *opening.take(),
                               chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))

        try:
            await self.jobs.sse_answer(request, resp, job, gen, head if include_usage else None,
                                       lambda piece: chunk({"audio": {"id": audio_id, "transcript": piece}}),
                                       lambda: chunk({"audio": {"id": audio_id, "expires_at": expires}},
                                                     gen.finish_reason),
                                       on_event=pcm_out, opening=opening)
        except ConnectionError as e:
            log.debug("audio chat stream reader went away", job=job.id, error=str(e))
        finally:
            reader.close()
        return resp

    # ------------------------------------------------------------------ speech

    async def speech(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        asked = SpeechRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, body, "audio")
        text, fmt, sse, voice = asked.input, asked.response_format or "wav", asked.stream_format == "sse", asked.voice
        params: dict[str, dict[str, Any]] = {}
        for s in p.sinks:        # `voice` goes to a last stage that declares it in its defaults
            if voice is not None and "voice" in self.api.config.stages[s].defaults:
                params[s] = {"voice": voice}
        inputs, summary = admission.inputs(self.api.config, {admission.prompt_key(self.api.config, p, "text"): text}, p)
        job = self.jobs.submit(request, p, inputs, params, summary)
        if sse or fmt == "pcm":
            try:
                return await self._speech_live(request, job, fmt, sse)
            finally:
                self.jobs.abandon(request, job.id)
        name = _audio_name(self.api.store, p)
        request[CONTENT_TYPE_KEY] = "audio/wav"
        try:
            current = self.api.scheduler.job(job.id) or job
            try:
                if current.terminal:
                    return output_file(self.api.store, current, name)
                return await stream_output(request, self.api.store, self.api.scheduler, current, name)
            except Refused:
                succeeded(self.api.scheduler, job.id)          # the job's own error, if it ended badly
                raise
        finally:
            self.jobs.abandon(request, job.id)

    async def _speech_live(self, request: web.Request, job: JobRecord, fmt: str, sse: bool) -> web.StreamResponse:
        """Speech as it is made: PCM16 bytes (`response_format: "pcm"`), or server-sent events
        (`stream_format: "sse"`): `speech.audio.delta` with base64 audio (the first one of a WAV
        carrying its header), then `speech.audio.done`."""
        reader = LiveAudio(self.api.store.job_dir(job.id))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "audio/pcm",
                                           "Cache-Control": "no-cache"})
        header = fmt == "wav"
        started = False

        async def out(data: bytes) -> None:
            nonlocal started
            if not started:
                await resp.prepare(request)
                started = True
            if sse and data:
                await sse_send(resp, {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
            elif data:
                await resp.write(data)

        if request.get(WAIT_KEY):           # a stream waiting for capacity: its place goes out now
            await out(b"")
        try:
            async for _ev in follow(request, self.api.scheduler, job.id):
                data = reader.read()
                if data:
                    if header:
                        data, header = reader.header + data, False
                    await out(data)
            await out(reader.read())
            succeeded(self.api.scheduler, job.id)          # the job's own error, if it ended badly
            if sse:
                await sse_send(resp, {"type": "speech.audio.done",
                                   "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}})
            await resp.write_eof()
        except OpenAiError as e:
            if not started:
                raise                        # nothing sent yet: an ordinary error answer
            if sse:
                await sse_send(resp, error_event(e))
            await resp.write_eof()
        except ConnectionError as e:
            log.debug("speech stream reader went away", job=job.id, error=str(e))
        finally:
            reader.close()
        return resp
