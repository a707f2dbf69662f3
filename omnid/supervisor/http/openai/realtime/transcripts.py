"""A realtime session's input transcription: each user's audio turn, once committed, transcribed by
the pipeline that the daemon's config names for it (`[daemon] realtime_transcription = "PIPELINE"`,
one that takes audio and answers in text), as an ordinary job of the caller's; its text goes out as
`conversation.item.input_audio_transcription.delta` events as the job makes it, then `.completed`
(or `.failed`). Without that setting a session's `transcription` stays null.

Runs in the supervisor's event-loop thread, owned by one realtime session (session.py), which it
knows by the `ResponseSession` Protocol (responses.py). One task per transcript follows its
job (the scheduler's event queue, as a response does); the session's end cancels them and their jobs.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, suppress
from typing import Any

import structlog

from omnid.config import PipelineConfig
from omnid.supervisor.http.http_common import follow_batches
from omnid.supervisor.http.openai.common import OpenAiError, generation, media_inputs, sampling, submit, take
from omnid.supervisor.http.openai.jobs import OpenAiJobs, succeeded
from omnid.supervisor.http.openai.realtime import events as E
from omnid.supervisor.http.openai.realtime.conversation import INPUT_RATE, Item
from omnid.supervisor.http.openai.realtime.responses import ResponseSession

log = structlog.get_logger("omnid.realtime")


class Transcripts:
    """A session's transcripts under way (one task and one job each)."""

    def __init__(self, session: ResponseSession, jobs: OpenAiJobs, p: PipelineConfig) -> None:
        self.session, self.jobs, self.p = session, jobs, p
        self.running: dict[str, tuple[asyncio.Task[None], str | None]] = {}     # item id -> (task, job id)

    def start(self, item: Item, prompt: str | None) -> None:
        """Transcribe a user's audio item (its events follow as the job makes them)."""
        if item.audio is None:
            return
        task = asyncio.get_running_loop().create_task(self._transcribe(item, prompt), name=f"transcribe-{item.id}")
        self.running[item.id] = (task, None)
        task.add_done_callback(lambda _t: self.running.pop(item.id, None))

    async def _transcribe(self, item: Item, prompt: str | None) -> None:
        config = self.jobs.api.config
        head = {"item_id": item.id, "content_index": 0}
        assert item.audio is not None
        content: list[dict[str, Any]] = [{"type": "audio"}] + ([{"type": "text", "text": prompt}] if prompt else [])
        try:
            inputs, summary = media_inputs(config, self.p, json.dumps([{"role": "user", "content": content}]),
                                           [("audio", item.audio, f"item {item.id}")])
            job = submit(self.jobs.api, self.session.request, self.p, inputs, sampling(config, self.p, {}, {}), summary)
            self.running[item.id] = (self.running[item.id][0], job.id)
            gen = generation(config, self.p)
            text = []
            async with aclosing(follow_batches(self.session.request, self.jobs.api.scheduler, job.id)) as batches:
                async for batch in batches:
                    pieces = "".join(t for ev in batch if (t := take(ev, gen)))
                    if pieces:
                        text.append(pieces)
                        await self.session.send(E.event("conversation.item.input_audio_transcription.delta",
                                                        **head, delta=pieces))
            succeeded(self.jobs.api.scheduler, job.id)
        except OpenAiError as e:
            await self.session.send(E.event("conversation.item.input_audio_transcription.failed", **head, error={
                "type": e.type, "code": e.code or "transcription_failed", "message": e.message, "param": None}))
            return
        except ConnectionError:
            return
        seconds = (len(item.audio) - 44) / (2 * INPUT_RATE)
        await self.session.send(E.event("conversation.item.input_audio_transcription.completed", **head,
                                        transcript="".join(text).strip(),
                                        usage={"type": "duration", "seconds": round(seconds, 3)}))

    async def cancel_all(self) -> None:
        """The session ended: every transcript's task, and its job in every stage."""
        for task, job in list(self.running.values()):
            task.cancel()
            with suppress(asyncio.CancelledError, ConnectionError):
                await task
            if job is not None and job in self.jobs.api.scheduler.live_jobs:
                self.jobs.api.scheduler.cancel(job)
        self.running.clear()
