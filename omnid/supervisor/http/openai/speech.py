"""`POST /v1/audio/speech`: speech by a pipeline that ends in audio, one ordinary omnid job: a WAV
streamed as it is produced, or live PCM16 / `speech.audio.delta` server-sent events.

Here: the body's model (`SpeechRequest`) and the handler. Its speech is read from the job's live WAV
stream (live_audio.py) at each of its events, or sent through the API's own `?stream=1` helper
(`http_common.stream_output`). A chat answered in speech is chat.py's. Runs in the supervisor's
event-loop thread; nothing blocks.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import structlog
from aiohttp import web
from pydantic import Field

from omnid.config import PipelineConfig
from omnid.store import JobStore
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import follow, output_file, sse_send, stream_output
from omnid.supervisor.http.openai.common import (
    CONTENT_TYPE_KEY,
    WAIT_KEY,
    OpenAiError,
    RequestBody,
    error_event,
    fixed,
    pipeline_for,
    read_body,
    shown,
    submit,
)
from omnid.supervisor.http.openai.jobs import Endpoint, succeeded
from omnid.supervisor.http.openai.live_audio import LiveAudio
from omnid.vocabulary import JobRecord, JobState

log = structlog.get_logger("omnid.openai")


class SpeechRequest(RequestBody):
    """Speech, by an audio-ending pipeline, streamed as it is produced."""

    ANSWER = "audio"
    input: Annotated[str, Field(min_length=1)]
    voice: Any = Field(None, description="given to a last stage that has `voice` in its defaults")
    response_format: Literal["wav", "pcm"] | None = None
    stream_format: Literal["audio", "sse"] | None = None

    MESSAGES = {
        **RequestBody.MESSAGES,
        ("input",): (fixed("input must be a non-empty string"), None),
        ("response_format",): (lambda at, v: "response_format must be one of wav, pcm (omnid writes PCM: mp3, opus, "
                               f"aac and flac are not supported), not {shown(v)}", None),
        ("stream_format",): (fixed("stream_format must be \"audio\" (the bytes, as they come) or \"sse\" "
                                    "(speech.audio.delta events)"), None),
    }


def _audio_name(store: JobStore, p: PipelineConfig) -> str:
    """The audio output's name: as the pipeline's latest successful job had it, else "audio"."""
    last = store.list(None, JobState.SUCCEEDED, p.name, 1)
    for out in last[0].outputs if last else []:
        if out["kind"] == "audio":
            return str(out["name"])
    return "audio"


class Speech(Endpoint):
    """The speech handler."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        asked = SpeechRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, asked, "audio")
        text, fmt, sse, voice = asked.input, asked.response_format or "wav", asked.stream_format == "sse", asked.voice
        params: dict[str, dict[str, Any]] = {}
        for s in p.sinks:        # `voice` goes to a last stage that declares it in its defaults
            if voice is not None and "voice" in self.api.config.stages[s].defaults:
                params[s] = {"voice": voice}
        inputs, summary = admission.inputs(self.api.config, {admission.prompt_key(self.api.config, p, "text"): text}, p)
        job = submit(self.api, request, p, inputs, params, summary)
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
