"""A realtime session's responses: each one a job (the conversation so far as a chat prompt,
submitted as the caller's through the OpenAI paths' jobs), its deltas streamed as the job makes
them (text, and speech read from the job's live WAV), its last events, and its cancel (barge-in,
`response.cancel`, the socket gone), which stops its job in every stage at once.

Runs in the supervisor's event-loop thread, owned by one realtime session (session.py), which it
knows by the `ResponseSession` Protocol below (it never imports the session). While a response runs,
one task follows its job (`Responses._answer`); each write waits for the socket (aiohttp's drain)
while the job's events wait in its bounded queue and its speech in its file, and what piled up goes
out as one delta (at most MAX_DELTA_BYTES of PCM each).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from aiohttp import web

from omnid.config import PipelineConfig
from omnid.supervisor.http import admission
from omnid.supervisor.http.http_common import follow_batches
from omnid.supervisor.http.openai.common import (
    Generation,
    OpenAiError,
    generation,
    media_inputs,
    sampling,
    submit,
    take,
    usage,
)
from omnid.supervisor.http.openai.jobs import OpenAiJobs, succeeded
from omnid.supervisor.http.openai.live_audio import LiveAudio
from omnid.supervisor.http.openai.realtime import events as E
from omnid.supervisor.http.openai.realtime.conversation import Conversation, Item
from omnid.supervisor.http.openai.realtime.events import new_id
from omnid.supervisor.http.openai.realtime.settings import ResponseOptions, SessionSettings
from omnid.vocabulary import JobRecord

log = structlog.get_logger("omnid.realtime")

MAX_DELTA_BYTES = 96 * 1024             # PCM per audio delta at most (a slow reader's backlog goes in several)


class ResponseSession(Protocol):
    """What a response needs of its session (session.py's `_Session` fills it)."""

    id: str
    request: web.Request                # the WebSocket's request: the caller's uid, the path
    conversation: Conversation
    settings: SessionSettings

    async def send(self, ev: Mapping[str, Any]) -> None:
        """One event to the client (nothing when the socket is closed)."""

    @property
    def closed(self) -> bool:
        """The socket is closed."""


@dataclass
class Response:
    """A response under way: its job, what it sent."""

    id: str
    item: Item
    job: JobRecord
    gen: Generation
    audio: bool                         # speech goes out (else the text alone)
    metadata: dict[str, str]
    voice: str
    task: asyncio.Task[None] | None = None
    finishing: bool = False             # its job ended: it is sending its last events
    pcm_bytes: int = 0
    rate: int = E.OPENAI_RATE
    created: float = field(default_factory=time.monotonic)

    def head(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}


class Responses:
    """A session's response under way (one at a time), and how many it made."""

    def __init__(self, session: ResponseSession, jobs: OpenAiJobs, p: PipelineConfig, rates: dict[str, int]) -> None:
        self.session, self.jobs, self.p = session, jobs, p
        self.config = jobs.api.config
        self.rates = rates                      # the PCM rate each pipeline's speech came at, last time
        self.current: Response | None = None
        self.count = 0

    async def send(self, ev: Mapping[str, Any]) -> None:
        await self.session.send(ev)

    async def start(self, opts: ResponseOptions) -> None:
        """A response as a job of the caller's; `response.created`, then its task follows the job."""
        s = self.session
        gen = generation(self.config, self.p)
        params = sampling(self.config, self.p, {"max_tokens": opts.max_tokens} if opts.max_tokens else {},
                          {"include_prompt": False})
        if gen.token_stage is not None:
            stage = self.config.stages[gen.token_stage]
            reserve = opts.max_tokens or int(params.get(gen.token_stage, {}).get("max_tokens")
                                             or stage.defaults.get("max_tokens") or 16)
        else:
            reserve = 0
        for name in self.p.stages:          # the voice, to a stage that declares one in its defaults
            for key in ("voice", "speaker"):
                if key in self.config.stages[name].defaults:
                    params.setdefault(name, {})[key] = opts.voice
        instructions = opts.instructions if opts.instructions is not None else s.settings.instructions
        messages, parts, dropped = s.conversation.prompt(instructions, reserve)
        if not messages:        # nothing said yet, no instructions: the model speaks first, as OpenAI's does
            messages = [{"role": "system", "content": ""}]      # (a chat template takes no empty chat)
        if parts:
            inputs, summary = media_inputs(self.config, self.p, json.dumps(messages), parts)
        else:
            inputs, summary = admission.inputs(self.config, {"messages": json.dumps(messages)}, self.p)
        job = submit(self.jobs.api, s.request, self.p, inputs, params, summary)
        self.count += 1
        item = Item(new_id("item"), "assistant", spoken="audio" in opts.modalities, status="in_progress")
        resp = Response(new_id("resp"), item, job, gen, "audio" in opts.modalities,
                        {**opts.metadata, "omnid_job": job.id}, opts.voice)
        self.current = resp
        if dropped:
            log.debug("realtime prompt trimmed", session=s.id, dropped=dropped, job=job.id)
        await self.send(E.event("response.created", response=self.doc(resp, "in_progress")))
        resp.task = asyncio.get_running_loop().create_task(self._answer(resp), name=f"realtime-{resp.id}")

    def doc(self, r: Response, status: str, reason: str | None = None,
            error: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The response as OpenAI's RealtimeResponse (its usage once it ended)."""
        doc: dict[str, Any] = {
            "id": r.id, "object": "realtime.response", "status": status, "conversation_id": self.session.id,
            "output_modalities": ["audio"] if r.audio else ["text"], "metadata": r.metadata,
            "output": [] if status == "in_progress" else [r.item.doc()],
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": r.rate}, "voice": r.voice}}}
        if status != "in_progress":
            details: dict[str, Any] = {"type": status}
            if reason is not None:
                details["reason"] = reason
            if error is not None:
                details["error"] = error
            doc["status_details"] = details
            u = usage(r.gen)
            doc["usage"] = {"total_tokens": u["total_tokens"], "input_tokens": u["prompt_tokens"],
                            "output_tokens": u["completion_tokens"],
                            "input_token_details": {"text_tokens": u["prompt_tokens"]},
                            "output_token_details": {"text_tokens": u["completion_tokens"]}}
        return doc

    async def _answer(self, r: Response) -> None:
        """The response's events as its job makes them; then its last ones (unless cancelled: the
        canceller sends those)."""
        head = r.head()
        reader = LiveAudio(self.jobs.api.store.job_dir(r.job.id)) if r.audio else None
        error: OpenAiError | None = None
        try:
            await self.send(E.event("response.output_item.added", response_id=r.id, output_index=0,
                                    item={**r.item.doc(), "content": []}))
            await self._item_added(r.item)
            part = {"type": "audio", "transcript": ""} if r.audio else {"type": "text", "text": ""}
            await self.send(E.event("response.content_part.added", **head, part=part))
            async for text, pcm in self._deltas(r, reader):
                if text:
                    r.item.text += text
                    await self.send(E.event("response.output_audio_transcript.delta" if r.audio
                                            else "response.output_text.delta", **head, delta=text))
                if pcm:
                    await self._audio_delta(r, reader, pcm)
        except OpenAiError as e:
            error = e
        except ConnectionError as e:
            log.debug("realtime client went away", session=self.session.id, job=r.job.id, error=str(e))
            return
        finally:
            if reader is not None:
                reader.close()
        r.finishing = True
        if error is not None:
            await self.send(E.error(error.code or "job_failed", error.message, type_=error.type))
        if error is None and r.gen.finish_reason == "length":     # cut by max tokens or the context window
            await self.finish(r, "incomplete", "max_output_tokens", None)
            return
        await self.finish(r, "failed" if error is not None else "completed", None,
                          {"type": error.type, "code": error.code or "job_failed"} if error is not None else None)

    async def _item_added(self, item: Item) -> None:
        previous = self.session.conversation.append(item)
        await self.send(E.event("conversation.item.added", previous_item_id=previous,
                                item={**item.doc(), "content": []}))

    async def _deltas(self, r: Response, reader: LiveAudio | None) -> AsyncIterator[tuple[str, bytes]]:
        """What the job made since the last delta: its text joined, its speech read (at most
        MAX_DELTA_BYTES at a time); after its end, the rest. OpenAiError if it ended badly."""
        async with aclosing(follow_batches(self.session.request, self.jobs.api.scheduler, r.job.id)) as batches:
            async for batch in batches:
                texts = [t for ev in batch if (t := take(ev, r.gen))]
                pcm = reader.read() if reader is not None else b""
                if texts:
                    r.gen.pieces.extend(texts)
                yield "".join(texts), pcm
        while reader is not None and (pcm := reader.read()):
            yield "", pcm
        text = await self.jobs.text_at_end(succeeded(self.jobs.api.scheduler, r.job.id), r.gen)
        if text:                            # a text stage that returned its text at the end
            yield text, b""

    async def _audio_delta(self, r: Response, reader: LiveAudio | None, pcm: bytes) -> None:
        if r.pcm_bytes == 0 and reader is not None and len(reader.header) >= 28:
            rate = int.from_bytes(reader.header[24:28], "little")
            r.rate = rate
            self.rates[self.p.name] = rate
            settings = self.session.settings
            if rate != settings.rate:               # say it before the first delta at another rate
                settings.rate = rate
                await self.send(E.event("session.updated", session=settings.doc(self.session.id)))
        for at in range(0, len(pcm), MAX_DELTA_BYTES):
            chunk = pcm[at:at + MAX_DELTA_BYTES]
            r.pcm_bytes += len(chunk)
            r.item.audio_ms = r.pcm_bytes * 1000 // (2 * r.rate)
            await self.send(E.event("response.output_audio.delta", **r.head(),
                                    delta=base64.b64encode(chunk).decode("ascii")))

    async def finish(self, r: Response, status: str, reason: str | None, error: Mapping[str, Any] | None) -> None:
        """A response's last events: its text (or transcript) done, its part and item done, `response.done`."""
        head = r.head()
        r.item.status = "completed" if status == "completed" else "incomplete"
        if self.current is r:
            self.current = None
        if r.audio:
            if r.pcm_bytes:
                await self.send(E.event("response.output_audio.done", **head))
            await self.send(E.event("response.output_audio_transcript.done", **head, transcript=r.item.text))
            part = {"type": "audio", "transcript": r.item.text}
        else:
            await self.send(E.event("response.output_text.done", **head, text=r.item.text))
            part = {"type": "text", "text": r.item.text}
        await self.send(E.event("response.content_part.done", **head, part=part))
        await self.send(E.event("response.output_item.done", response_id=r.id, output_index=0, item=r.item.doc()))
        await self.send(E.event("conversation.item.done", item=r.item.doc()))
        await self.send(E.event("response.done", response=self.doc(r, status, reason, error)))

    async def cancel(self, reason: str | None, first: Mapping[str, Any] | None = None) -> bool:
        """Stop the response under way: its task (no delta after this), its job in every stage, then
        `first` if given (server VAD's speech_started), then its last events with `cancelled`
        (`reason` None: the socket is gone, nothing is sent)."""
        r = self.current
        if r is None:
            return False
        if r.finishing:                     # its job ended: its last events are going out
            if r.task is not None:
                with suppress(asyncio.CancelledError, ConnectionError):
                    await r.task
            return False
        self.current = None
        if r.task is not None and not r.task.done():
            r.task.cancel()
            with suppress(asyncio.CancelledError, ConnectionError):
                await r.task
        if r.job.id in self.jobs.api.scheduler.live_jobs:
            self.jobs.api.scheduler.cancel(r.job.id)
            log.info("audit", action="cancel", uid=self.session.request["uid"], job=r.job.id,
                     session=self.session.id, why=reason or "the session ended", via=self.session.request.path)
        if first is not None:
            await self.send(first)
        if reason is not None and not self.session.closed:
            if r.item not in self.session.conversation.items:
                await self._item_added(r.item)
            await self.finish(r, "cancelled", reason, None)
        return True
