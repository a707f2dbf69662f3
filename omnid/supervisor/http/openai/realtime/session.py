"""OpenAI's Realtime API: `GET /v1/realtime?model=PIPELINE`, a WebSocket session that holds a
conversation, each response of it an ordinary omnid job.

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application (the daemon
mounts it: `RealtimeApi(api).mount(api.app)`), on the socket and on the TCP listener (whose door,
access.py, checks the key before this sees the request). Nothing here blocks: a session is two
coroutines, the handler here reading the client's events and, while a response runs, one task that
follows its job (responses.py: the scheduler's event queue, as the OpenAI paths do:
openai/jobs.py) and reads its speech from the job's live WAV stream (openai/live_audio.py). The session's
conversation is conversation.py's, its settings settings.py's.

- The events are OpenAI's published ones (the `RealtimeClientEvent*` and `RealtimeServerEvent*`
  components of openai/openai-openapi; events.py writes the server's): `session.update`,
  `conversation.item.create` (user, system or assistant text; user audio), `input_audio_buffer.append`
  / `commit` / `clear` (PCM16, 24 kHz mono, for pipelines whose first stage takes audio),
  `response.create`, `response.cancel`, `conversation.item.truncate`, `conversation.item.delete`,
  `conversation.item.retrieve`.
- A response is a job of the caller's uid (a key's uid over TCP): its prompt is the conversation so
  far as chat `messages` (the pipeline's chat template renders them), the oldest turns dropped to fit
  the model's context. Its text comes as `response.output_audio_transcript.delta` (audio out) or
  `response.output_text.delta` (text out), its speech as `response.output_audio.delta` (base64
  PCM16 at the pipeline's rate: the session says it, and says it again before a response whose
  audio comes at another rate), then `response.done` with the usage.
- Server VAD (`turn_detection` `server_vad` or `semantic_vad`; the default on a pipeline that takes
  audio, as OpenAI's): the appended audio is judged as it comes (vad.py, in a worker
  thread), and the session sends `input_audio_buffer.speech_started` / `speech_stopped` /
  `committed` and creates the response itself. `turn_detection: null` keeps manual turns. Input
  transcription, when the client asks and the config names a pipeline for it, is
  transcripts.py's.
- `response.cancel`, and a new user turn while a response runs (barge-in, by an item or by voice:
  speech that starts), cancel its job in every stage at once; no delta follows, and `response.done`
  says `cancelled`. The assistant's item keeps
  the text made so far; `conversation.item.truncate` cuts it to the audio the client played.
- A client's mistake is an `error` event with a code; the session stays open. A session refused
  (unknown model, too many sessions, the daemon draining) gets an `error` event and a close with a
  code and a reason; so does a session idle for `daemon.realtime_idle_timeout_s`. Closing the
  socket (or losing it) cancels the session's running job.
- A slow reader: each write waits for the socket (aiohttp's drain); meanwhile the job's events wait
  in its bounded queue and its speech in its file, and what piled up goes out as one delta.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import WSMsgType, web

from omnid.config import PipelineConfig
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission
from omnid.supervisor.http.access import KEY_NAME
from omnid.supervisor.http.openai.common import OpenAiError, find_pipeline
from omnid.supervisor.http.openai.jobs import OpenAiJobs
from omnid.supervisor.http.openai.realtime import events as E
from omnid.supervisor.http.openai.realtime import vad as realtime_vad
from omnid.supervisor.http.openai.realtime.conversation import INPUT_RATE, Conversation, Item, b64
from omnid.supervisor.http.openai.realtime.events import EventError, new_id
from omnid.supervisor.http.openai.realtime.responses import Responses
from omnid.supervisor.http.openai.realtime.settings import SessionSettings
from omnid.supervisor.http.openai.realtime.transcripts import Transcripts
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore

log = structlog.get_logger("omnid.realtime")


class RealtimeApi:
    """The `/v1/realtime` handler, and the sessions open now (bounded per key and in all)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api
        self.jobs = OpenAiJobs(api)              # the OpenAI paths' jobs followed
        self.sessions: dict[str, _Session] = {}
        self.rates: dict[str, int] = {}         # the PCM rate each pipeline's speech came at, last time

    def mount(self, app: web.Application) -> None:
        app.add_routes([web.get(E.REALTIME_PATH, self.connect)])
        app.on_shutdown.append(self._close_all)

    async def _close_all(self, _app: web.Application) -> None:
        for s in list(self.sessions.values()):
            await s.close(E.CLOSE_GOING_AWAY, "the daemon is stopping")

    async def connect(self, request: web.Request) -> web.StreamResponse:
        cfg = self.api.config.daemon
        owner = str(request.get(KEY_NAME) or f"uid {request['uid']}")
        try:
            p = find_pipeline(self.api.config, request.query.get("model"))
        except OpenAiError as e:
            return await E.refuse(request, e.code or "model_not_found", e.message, E.CLOSE_POLICY, status=e.status)
        if admission.text_stage(self.api.config, p) is None:
            return await E.refuse(request, "model_not_supported", f"model {p.name!r} does not end in text: a "
                                  "realtime session needs a pipeline that answers in text (and speech)",
                                  E.CLOSE_POLICY)
        if self.api.info.draining:
            return await E.refuse(request, "draining", "the daemon is stopping; try again once it is back",
                                  E.CLOSE_TRY_LATER, "server_error", 503)
        mine = sum(1 for s in self.sessions.values() if s.owner == owner)
        if len(self.sessions) >= cfg.max_realtime_sessions:
            return await E.refuse(request, "too_many_sessions", f"the daemon holds {len(self.sessions)} realtime "
                                  f"sessions, as many as it may (daemon.max_realtime_sessions)", E.CLOSE_TRY_LATER,
                                  "rate_limit_error", 429)
        if mine >= cfg.max_realtime_sessions_per_key:
            return await E.refuse(request, "too_many_sessions", f"{owner} holds {mine} realtime sessions, as many as "
                                  "one key (or uid) may (daemon.max_realtime_sessions_per_key)", E.CLOSE_TRY_LATER,
                                  "rate_limit_error", 429)
        ws = web.WebSocketResponse(compress=False, max_msg_size=cfg.max_request_bytes, autoping=True)
        if not ws.can_prepare(request).ok:
            raise Refused(400, ErrorCode.INVALID_REQUEST, "GET /v1/realtime is a WebSocket: send the Upgrade headers")
        session = _Session(self, request, ws, p, owner)
        self.sessions[session.id] = session         # counted before the first await: the limits hold
        try:
            await ws.prepare(request)
            log.info("audit", action="realtime_open", uid=request["uid"], session=session.id, pipeline=p.name,
                     via=request.path)
            await session.run()
        finally:
            del self.sessions[session.id]
            await session.end()
            log.info("audit", action="realtime_close", uid=request["uid"], session=session.id,
                     responses=session.runner.count, why=session.closed_why)
        return ws


class _Session:
    """One client's session: its socket, its settings, its conversation, its response under way;
    the client's events, each handled in turn (`_HANDLERS`)."""

    def __init__(self, rt: RealtimeApi, request: web.Request, ws: web.WebSocketResponse, p: PipelineConfig,
                 owner: str) -> None:
        self.rt, self.request, self.ws, self.p, self.owner = rt, request, ws, p, owner
        self.id = new_id("sess")
        self.config = rt.api.config
        self.closed_why = "the client closed"
        media = admission.media_stage(self.config, p)
        self.conversation = Conversation(self.config, p, media.media if media is not None else None)
        produces = admission.answers(self.config, rt.api.store, p)
        self.settings = SessionSettings(p.name, speaks=produces is None or "audio" in produces,
                                        hears=media is not None and bool(media.media.count("audio")),
                                        vad=realtime_vad.available(), rate=rt.rates.get(p.name, E.OPENAI_RATE),
                                        transcribes=self._asr() is not None)
        self.runner = Responses(self, rt.jobs, p, rt.rates)
        asr = self._asr()
        self.transcripts = Transcripts(self, rt.jobs, asr) if asr is not None else None
        self.vad: realtime_vad.Detector | None = None       # server VAD's state, made on the first audio
        self.heard = 0                          # bytes of input audio appended in the session (its timeline)
        self.speech_item: str | None = None     # the item id of the speech under way (server VAD)

    # ------------------------------------------------------------------ the socket

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def send(self, ev: Mapping[str, Any]) -> None:
        """One event (a frame is written whole; a full socket waits here)."""
        if not self.ws.closed:
            await self.ws.send_str(json.dumps(ev))

    async def close(self, code: int, why: str) -> None:
        self.closed_why = why
        await self.runner.cancel(None)
        with suppress(ConnectionError, RuntimeError):
            await self.ws.close(code=code, message=E.reason(why))

    async def end(self) -> None:
        """The socket is gone: a response under way is cancelled, its job with it (and transcripts')."""
        await self.runner.cancel(None)
        if self.transcripts is not None:
            await self.transcripts.cancel_all()

    def _asr(self) -> PipelineConfig | None:
        """The pipeline that transcribes input audio (`daemon.realtime_transcription`), if any."""
        name = self.config.daemon.realtime_transcription
        return self.config.pipelines.get(name) if name is not None else None

    async def run(self) -> None:
        idle = self.config.daemon.realtime_idle_timeout_s
        await self.send(E.event("session.created", session=self.session_doc()))
        while not self.ws.closed:
            try:
                msg = await self.ws.receive(timeout=idle)
            except asyncio.TimeoutError:
                if self.runner.current is not None:
                    continue                # a response is still being answered: not idle
                await self.send(E.error("idle_timeout", f"no event for {idle:g} s "
                                        "(daemon.realtime_idle_timeout_s): the session is closed"))
                await self.close(E.CLOSE_NORMAL, f"idle for {idle:g} s")
                return
            if msg.type == WSMsgType.TEXT:
                await self.handle(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await self.send(E.error("invalid_event", "events are JSON text frames, not binary ones"))
            elif msg.type == WSMsgType.ERROR:
                exc = self.ws.exception()
                if "too big" in str(exc).lower() or "message size" in str(exc).lower():
                    self.closed_why = "a message over daemon.max_request_bytes"
                else:
                    self.closed_why = f"socket error: {exc}"
                return
            else:                            # CLOSE, CLOSING, CLOSED
                return

    async def handle(self, raw: str) -> None:
        client_event: str | None = None
        try:
            try:
                ev = json.loads(raw)
            except ValueError as e:
                raise EventError("invalid_json", f"the event is not valid JSON: {e}") from None
            if not isinstance(ev, dict):
                raise EventError("invalid_event", "an event must be a JSON object with a \"type\"")
            client_event = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
            kind = ev.get("type")
            handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise EventError("invalid_event_type" if kind is not None else "missing_type",
                                 f"unknown event type {admission.shown(kind)}; omnid takes "
                                 f"{', '.join(sorted(_HANDLERS))}", "type")
            await handler(self, ev)
        except EventError as e:
            await self.send(E.error(e.code, e.message, e.param, client_event))
        except OpenAiError as e:
            await self.send(E.error(e.code or "invalid_request_error", e.message, e.param, client_event,
                                    e.type))
        except Refused as e:
            param = e.extra.get("input")
            await self.send(E.error(str(e.code), e.message, param if isinstance(param, str) else None,
                                    client_event, "rate_limit_error" if e.status == 429 else
                                    "server_error" if e.status >= 500 else "invalid_request_error"))


    # ------------------------------------------------------------------ the session

    def session_doc(self) -> dict[str, Any]:
        return self.settings.doc(self.id)

    async def on_session_update(self, ev: Mapping[str, Any]) -> None:
        ignored = self.settings.update(ev.get("session"))
        if ignored:
            log.info("realtime session.update: optional features omnid lacks are left off", session=self.id,
                     fields=ignored)
        turn = self.settings.turn
        if turn is None:
            self.vad = None
        elif self.vad is not None:
            self.vad.threshold, self.vad.silence_ms = turn.threshold, turn.silence_duration_ms
        await self.send(E.event("session.updated", session=self.session_doc()))

    # ------------------------------------------------------------------ the conversation

    async def add(self, item: Item) -> None:
        """An item into the conversation (a user's turn while a response runs interrupts it)."""
        if item.role == "user" and self.runner.current is not None:
            await self.runner.cancel("turn_detected")
        previous = self.conversation.append(item)
        doc = item.doc()
        await self.send(E.event("conversation.item.added", previous_item_id=previous, item=doc))
        await self.send(E.event("conversation.item.done", previous_item_id=previous, item=doc))
        asked = self.settings.transcription
        if item.role == "user" and item.audio is not None and asked is not None and self.transcripts is not None:
            prompt = asked.get("prompt")
            self.transcripts.start(item, prompt if isinstance(prompt, str) and prompt else None)

    async def on_item_create(self, ev: Mapping[str, Any]) -> None:
        await self.add(self.conversation.new_item(ev))

    async def on_buffer_append(self, ev: Mapping[str, Any]) -> None:
        turn = self.settings.turn
        if turn is None:
            self.conversation.buffer_append(ev.get("audio"))
            return
        pcm = self.conversation.pcm_in(b64(ev.get("audio"), "audio"), "audio")
        if self.vad is None:                    # its timeline starts at the first audio it judges
            self.vad = realtime_vad.Detector(turn.threshold, turn.silence_duration_ms)
            self.heard = 0
        if len(self.conversation.buffer) + len(pcm) > self.conversation.buffer_limit():
            await self._turn_ended(self.heard * 1000 // _BYTES_PER_S)     # speech as long as a job takes
            self.vad.reset()
        self.conversation.buffer += pcm
        self.heard += len(pcm)
        for edge in await self.vad.feed(pcm):
            if edge.kind == "started":
                await self._speech_started(edge.ms)
            elif self.speech_item is not None:
                await self._turn_ended(edge.ms)
        if not self.vad.speaking:               # between turns: only the prefix padding is kept
            keep = turn.prefix_padding_ms * _BYTES_PER_S // 1000 // 2 * 2
            del self.conversation.buffer[:max(0, len(self.conversation.buffer) - keep)]

    async def _speech_started(self, ms: int) -> None:
        """Speech in the input audio: a response under way is cancelled (barge-in by voice), and the
        buffer keeps `prefix_padding_ms` before it."""
        turn = self.settings.turn
        assert turn is not None
        self.speech_item = new_id("item")
        start = self.heard - len(self.conversation.buffer)          # the buffer's first byte, on the timeline
        first = max(start, (ms - turn.prefix_padding_ms) * _BYTES_PER_S // 1000 // 2 * 2)
        del self.conversation.buffer[:first - start]
        said = E.event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self.speech_item)
        # barge-in: the answer stops (no delta after this), then speech_started, then its response.done
        if self.runner.current is None or not turn.interrupt_response \
                or not await self.runner.cancel("turn_detected", first=said):
            await self.send(said)

    async def _turn_ended(self, ms: int) -> None:
        """The speech stopped at `ms`: the buffer up to there is committed as the user's turn, and
        (create_response) answered."""
        turn, item_id = self.settings.turn, self.speech_item
        if item_id is None:
            return
        self.speech_item = None
        await self.send(E.event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
        start = self.heard - len(self.conversation.buffer)
        end = max(0, ms * _BYTES_PER_S // 1000 // 2 * 2 - start)
        rest = bytes(self.conversation.buffer[end:])
        del self.conversation.buffer[end:]
        if not self.conversation.buffer:
            self.conversation.buffer = bytearray(rest)
            return
        item = self.conversation.commit(item_id)
        self.conversation.buffer = bytearray(rest)
        await self.send(E.event("input_audio_buffer.committed", previous_item_id=self.conversation.last_id,
                                item_id=item.id))
        await self.add(item)
        if turn is not None and turn.create_response:
            if self.runner.current is None:
                await self.runner.start(self.settings.response_options({}))
            else:
                log.debug("realtime turn not answered: a response is under way", session=self.id, item=item.id)

    async def on_buffer_commit(self, ev: Mapping[str, Any]) -> None:
        item = self.conversation.commit(self.speech_item)
        self.speech_item = None
        if self.vad is not None:
            self.vad.reset()
        await self.send(E.event("input_audio_buffer.committed", previous_item_id=self.conversation.last_id,
                                item_id=item.id))
        await self.add(item)

    async def on_buffer_clear(self, ev: Mapping[str, Any]) -> None:
        self.conversation.buffer = bytearray()
        self.speech_item = None
        if self.vad is not None:
            self.vad.reset()
        await self.send(E.event("input_audio_buffer.cleared"))

    async def on_item_truncate(self, ev: Mapping[str, Any]) -> None:
        """The client played `audio_end_ms` of an assistant's speech: its transcript is cut to the
        words heard (in proportion to the speech sent), and that is what the history keeps."""
        item, end = self.conversation.truncation(ev)
        if self.runner.current is not None and self.runner.current.item is item:
            await self.runner.cancel("client_cancelled")
        self.conversation.truncate(item, end)
        await self.send(E.event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end))

    async def on_item_delete(self, ev: Mapping[str, Any]) -> None:
        item = self.conversation.find(ev.get("item_id"))
        if self.runner.current is not None and self.runner.current.item is item:
            await self.runner.cancel("client_cancelled")
        self.conversation.items.remove(item)
        await self.send(E.event("conversation.item.deleted", item_id=item.id))

    async def on_item_retrieve(self, ev: Mapping[str, Any]) -> None:
        await self.send(E.event("conversation.item.retrieved", item=self.conversation.find(ev.get("item_id")).doc()))

    # ------------------------------------------------------------------ responses

    async def on_response_create(self, ev: Mapping[str, Any]) -> None:
        r = ev.get("response") or {}
        if not isinstance(r, dict):
            raise EventError("invalid_value", "response must be an object", "response")
        if self.runner.current is not None:
            raise EventError("conversation_already_has_active_response", f"response {self.runner.current.id} is "
                             "under way: cancel it first (response.cancel) or wait for its response.done")
        # no user turn yet (the agent greets first): the model answers from the instructions alone
        await self.runner.start(self.settings.response_options(r))

    async def on_response_cancel(self, ev: Mapping[str, Any]) -> None:
        wanted = ev.get("response_id")
        current = self.runner.current
        if current is None or (wanted is not None and wanted != current.id):
            raise EventError("response_cancel_not_active", "there is no response under way to cancel"
                             + (f" with id {admission.shown(wanted)}" if wanted is not None else ""), "response_id")
        if not await self.runner.cancel("client_cancelled"):
            raise EventError("response_cancel_not_active", "the response had ended already", "response_id")


_BYTES_PER_S = 2 * INPUT_RATE             # PCM16 mono: the input timeline's bytes a second

_HANDLERS = {
    "session.update": _Session.on_session_update,
    "conversation.item.create": _Session.on_item_create,
    "conversation.item.truncate": _Session.on_item_truncate,
    "conversation.item.delete": _Session.on_item_delete,
    "conversation.item.retrieve": _Session.on_item_retrieve,
    "input_audio_buffer.append": _Session.on_buffer_append,
    "input_audio_buffer.commit": _Session.on_buffer_commit,
    "input_audio_buffer.clear": _Session.on_buffer_clear,
    "response.create": _Session.on_response_create,
    "response.cancel": _Session.on_response_cancel,
}
