"""OpenAI's Realtime API: `GET /v1/realtime?model=PIPELINE`, a WebSocket session that holds a
conversation, each response of it an ordinary omnid job.

Runs in the supervisor's event-loop thread, inside the socket API's aiohttp application (the daemon
mounts it: `RealtimeApi(api).mount(api.app)`), on the socket and on the TCP listener (whose door,
access.py, checks the key before this sees the request). Nothing here blocks: a session is two
coroutines, the handler reading the client's events and, while a response runs, one task that
follows its job (the scheduler's event queue, as the OpenAI paths do: openai_api.py) and reads its
speech from the job's live WAV stream (`LiveAudio`).

- The events are OpenAI's published ones (the `RealtimeClientEvent*` and `RealtimeServerEvent*`
  components of openai/openai-openapi; realtime_events.py writes the server's): `session.update`,
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
- `response.cancel`, and a new user turn while a response runs (barge-in), cancel its job in every
  stage at once; no delta follows, and `response.done` says `cancelled`. The assistant's item keeps
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
import base64
import binascii
import io
import itertools
import json
import time
import wave
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import WSMsgType, web

from omnid.config import PipelineConfig
from omnid.supervisor.errors import Refused
from omnid.supervisor.http import admission, prompt_length
from omnid.supervisor.http import realtime_events as E
from omnid.supervisor.http.access import KEY_NAME
from omnid.supervisor.http.http_common import follow_batches
from omnid.supervisor.http.live_audio import LiveAudio
from omnid.supervisor.http.openai_errors import OpenAiError
from omnid.supervisor.http.openai_jobs import Generation, OpenAiJobs, generation, succeeded, take, usage
from omnid.supervisor.http.openai_models import find_pipeline
from omnid.supervisor.http.openai_requests import media_inputs, sampling
from omnid.vocabulary import ErrorCode, JobRecord

if TYPE_CHECKING:
    from omnid.supervisor.http.api import Api

log = structlog.get_logger("omnid.realtime")

MAX_DELTA_BYTES = 96 * 1024             # PCM per audio delta at most (a slow reader's backlog goes in several)
MAX_ITEMS = 1024                        # a conversation's items kept at most (the oldest go first)
INPUT_RATE = E.OPENAI_RATE              # input_audio_buffer: PCM16 mono at OpenAI's 24 kHz
TOKENS_PER_MESSAGE = 8                  # a chat template's tokens around one message, at most (tiny and real)
AUDIO_TOKENS_PER_S = 50                 # what one second of input audio may cost in the prompt (Whisper: 25)
_FORMAT = {"type": "audio/pcm", "rate": E.OPENAI_RATE}
_SESSION_KEYS = {"type", "model", "output_modalities", "instructions", "audio", "max_output_tokens", "tools",
                 "tool_choice", "tracing", "include", "truncation"}
_RESPONSE_KEYS = {"output_modalities", "instructions", "audio", "max_output_tokens", "metadata", "conversation",
                  "tools", "tool_choice"}
_seq = itertools.count(1)


class EventError(Exception):
    """A client event refused: said to the client as an `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _new_id(prefix: str) -> str:
    return f"{prefix}_{int(time.time() * 1000):x}{next(_seq):04x}"


@dataclass
class _Item:
    """One conversation item: a message, its text (a user's audio as a WAV besides)."""

    id: str
    role: str                           # user, assistant, system
    text: str = ""
    audio: bytes | None = None          # a user's audio turn: WAV (PCM16 mono, 24 kHz)
    audio_ms: int = 0                   # its length; an assistant's: the speech sent
    spoken: bool = False                # an assistant's answer in audio (its text is the transcript)
    status: str = "completed"
    tokens: int | None = None           # its text's tokens (counted once)

    def doc(self) -> dict[str, Any]:
        """The item as OpenAI's RealtimeConversationItem (no audio data)."""
        if self.role == "assistant":
            part = {"type": "output_audio", "transcript": self.text} if self.spoken \
                else {"type": "output_text", "text": self.text}
            content = [part]
        elif self.audio is not None:
            content = [{"type": "input_audio"}] + ([{"type": "input_text", "text": self.text}] if self.text else [])
        else:
            content = [{"type": "input_text", "text": self.text}]
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": content}


@dataclass
class _Response:
    """A response under way: its job, what it sent."""

    id: str
    item: _Item
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


class RealtimeApi:
    """The `/v1/realtime` handler, and the sessions open now (bounded per key and in all)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.jobs = OpenAiJobs(api)              # the OpenAI paths' job submission
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
                     responses=session.responses, why=session.closed_why)
        return ws


class _Session:
    """One client's session: its settings, its conversation, its response under way."""

    def __init__(self, rt: RealtimeApi, request: web.Request, ws: web.WebSocketResponse, p: PipelineConfig,
                 owner: str) -> None:
        self.rt, self.request, self.ws, self.p, self.owner = rt, request, ws, p, owner
        self.id = _new_id("sess")
        self.config = rt.api.config
        self.items: list[_Item] = []
        self.buffer = bytearray()               # input audio, PCM16 24 kHz mono, until committed
        self.current: _Response | None = None
        self.responses = 0
        self.closed_why = "the client closed"
        media = admission.media_stage(self.config, p)
        self.media = media.media if media is not None else None
        produces = admission.answers(self.config, rt.api.store, p)
        self.speaks = produces is None or "audio" in produces
        self.modalities = ["audio"] if self.speaks else ["text"]
        self.instructions = ""
        self.voice = "alloy"
        self.max_tokens: int | None = None
        self.rate = rt.rates.get(p.name, E.OPENAI_RATE)

    # ------------------------------------------------------------------ the socket

    async def send(self, ev: dict[str, Any]) -> None:
        """One event (a frame is written whole; a full socket waits here)."""
        if not self.ws.closed:
            await self.ws.send_str(json.dumps(ev))

    async def close(self, code: int, why: str) -> None:
        self.closed_why = why
        await self.cancel_response(None)
        with suppress(ConnectionError, RuntimeError):
            await self.ws.close(code=code, message=E.reason(why))

    async def end(self) -> None:
        """The socket is gone: a response under way is cancelled, its job with it."""
        await self.cancel_response(None)

    async def run(self) -> None:
        idle = self.config.daemon.realtime_idle_timeout_s
        await self.send(E.event("session.created", session=self.session_doc()))
        while not self.ws.closed:
            try:
                msg = await self.ws.receive(timeout=idle)
            except asyncio.TimeoutError:
                if self.current is not None:
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
                                 f"unknown event type {kind!r}; omnid takes "
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
        fmt = {"type": "audio/pcm", "rate": self.rate}
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.p.name,
                "output_modalities": list(self.modalities), "instructions": self.instructions,
                "max_output_tokens": self.max_tokens if self.max_tokens is not None else "inf",
                "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": dict(_FORMAT), "turn_detection": None},
                          "output": {"format": fmt, "voice": self.voice}}}

    async def on_session_update(self, ev: dict[str, Any]) -> None:
        s = ev.get("session")
        if not isinstance(s, dict):
            raise EventError("invalid_value", "session.update needs \"session\": an object", "session")
        unknown = sorted(set(s) - _SESSION_KEYS)
        if unknown:
            raise EventError("unknown_parameter", f"session.{unknown[0]} is not supported here", f"session.{unknown[0]}")
        if s.get("type", "realtime") != "realtime":
            raise EventError("invalid_value", "session.type must be \"realtime\" (transcription sessions are not "
                             "supported)", "session.type")
        if s.get("model") not in (None, self.p.name):
            raise EventError("invalid_value", f"the session's model is {self.p.name!r} (the URL's); it cannot change",
                             "session.model")
        modalities = self._modalities(s.get("output_modalities"), "session.output_modalities")
        instructions = s.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise EventError("invalid_type", "session.instructions must be a string", "session.instructions")
        voice = self._audio(s.get("audio"), "session.audio", input_too=True)
        max_tokens = self._max_tokens(s.get("max_output_tokens"), "session.max_output_tokens")
        if s.get("tools") not in (None, []) or s.get("tool_choice") not in (None, "auto", "none"):
            raise EventError("unsupported", "tools are not supported", "session.tools")
        if modalities is not None:
            self.modalities = modalities
        if instructions is not None:
            self.instructions = instructions
        if voice is not None:
            self.voice = voice
        if "max_output_tokens" in s:
            self.max_tokens = max_tokens
        await self.send(E.event("session.updated", session=self.session_doc()))

    def _modalities(self, raw: Any, param: str) -> list[str] | None:
        if raw is None:
            return None
        if not isinstance(raw, list) or not raw or any(m not in ("text", "audio") for m in raw):
            raise EventError("invalid_value", f"{param} must be [\"audio\"] or [\"text\"]", param)
        if "audio" in raw and not self.speaks:
            raise EventError("invalid_value", f"model {self.p.name!r} does not speak: its output_modalities can "
                             "only be [\"text\"]", param)
        return ["audio"] if "audio" in raw else ["text"]

    def _audio(self, raw: Any, param: str, input_too: bool) -> str | None:
        """The `audio` settings (formats checked: PCM16 only, at the rates omnid gives and takes); the voice."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise EventError("invalid_type", f"{param} must be an object", param)
        voice = None
        for side, fields in (("input", {"format", "turn_detection", "transcription", "noise_reduction"}),
                             ("output", {"format", "voice", "speed"})):
            part = raw.get(side)
            if part is None:
                continue
            if not isinstance(part, dict) or (side == "input" and not input_too):
                raise EventError("invalid_value", f"{param}.{side} must be an object", f"{param}.{side}")
            unknown = sorted(set(part) - fields)
            if unknown:
                raise EventError("unknown_parameter", f"{param}.{side}.{unknown[0]} is not supported",
                                 f"{param}.{side}.{unknown[0]}")
            fmt = part.get("format")
            rate = INPUT_RATE if side == "input" else self.rate
            if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm"
                                    or fmt.get("rate", rate) != rate):
                raise EventError("invalid_value", f"{param}.{side}.format: omnid {'takes' if side == 'input' else 'gives'}"
                                 f" {{\"type\": \"audio/pcm\", \"rate\": {rate}}} (PCM16 mono) only",
                                 f"{param}.{side}.format")
            if part.get("turn_detection") is not None:
                raise EventError("unsupported", f"{param}.input.turn_detection must be null: omnid has no voice "
                                 "activity detection; commit the input audio buffer yourself",
                                 f"{param}.input.turn_detection")
            if part.get("transcription") is not None or part.get("noise_reduction") is not None:
                raise EventError("unsupported", "input transcription and noise reduction are not supported",
                                 f"{param}.input")
            v = part.get("voice")
            if isinstance(v, dict):
                v = v.get("id")
            if v is not None and (not isinstance(v, str) or not v):
                raise EventError("invalid_value", f"{param}.output.voice must be a voice's name", f"{param}.output.voice")
            voice = v if v is not None else voice
        return voice

    def _max_tokens(self, raw: Any, param: str) -> int | None:
        if raw is None or raw == "inf":
            return None
        if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 4096:
            raise EventError("invalid_value", f"{param} must be an integer from 1 to 4096, or \"inf\"", param)
        return raw

    # ------------------------------------------------------------------ the conversation

    async def add(self, item: _Item) -> None:
        """An item into the conversation (a user's turn while a response runs interrupts it)."""
        if item.role == "user" and self.current is not None:
            await self.cancel_response("turn_detected")
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        del self.items[:-MAX_ITEMS]
        doc = item.doc()
        await self.send(E.event("conversation.item.added", previous_item_id=previous, item=doc))
        await self.send(E.event("conversation.item.done", previous_item_id=previous, item=doc))

    async def on_item_create(self, ev: dict[str, Any]) -> None:
        item = ev.get("item")
        if not isinstance(item, dict):
            raise EventError("invalid_value", "conversation.item.create needs \"item\": an object", "item")
        if item.get("type", "message") != "message":
            raise EventError("unsupported", f"item.type {item.get('type')!r} is not supported: messages only",
                             "item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise EventError("invalid_value", "item.role must be user, assistant or system", "item.role")
        if ev.get("previous_item_id") not in (None, self.items[-1].id if self.items else None, "root"):
            raise EventError("unsupported", "items are added at the end of the conversation only", "previous_item_id")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise EventError("invalid_value", "item.content must be a non-empty array of content parts", "item.content")
        texts: list[str] = []
        audio: bytes | None = None
        for i, part in enumerate(content):
            at = f"item.content[{i}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "input_audio" and role == "user" and isinstance(part.get("audio"), str):
                if audio is not None:
                    raise EventError("invalid_value", "one input_audio part per item", at)
                audio = self._pcm_in(_b64(part["audio"], at), at)
            elif kind == "output_audio" and role == "assistant" and isinstance(part.get("transcript"), str):
                texts.append(part["transcript"])
            else:
                raise EventError("invalid_value", f"{at}: a {role} message's parts are input_text (text)"
                                 + (" or input_audio (base64 PCM16, 24 kHz mono)" if role == "user" else ""), at)
        given = item.get("id")
        if given is not None and (not isinstance(given, str) or not given or len(given) > 64
                                  or any(i.id == given for i in self.items)):
            raise EventError("invalid_value", "item.id must be a new string of up to 64 characters", "item.id")
        new = _Item(given or _new_id("item"), str(role), "\n".join(texts), spoken=False)
        if audio is not None:
            new.audio, new.audio_ms = _wav(audio), len(audio) * 1000 // (2 * INPUT_RATE)
        await self.add(new)

    def _pcm_in(self, pcm: bytes, param: str) -> bytes:
        if self.media is None or not self.media.count("audio"):
            raise EventError("audio_not_accepted", f"model {self.p.name!r} takes no audio (its first stage's model "
                             "takes none)", param)
        if len(pcm) % 2:
            raise EventError("invalid_value", "PCM16 audio is an even number of bytes", param)
        return pcm

    async def on_buffer_append(self, ev: dict[str, Any]) -> None:
        pcm = self._pcm_in(_b64(ev.get("audio"), "audio"), "audio")
        limit = int(self.media.max_audio_s * INPUT_RATE) * 2 if self.media is not None else 0
        if len(self.buffer) + len(pcm) > limit:
            raise EventError("input_audio_buffer_too_large", f"the input audio buffer would hold more than "
                             f"{limit // (2 * INPUT_RATE)} s (the stage's media.max_audio_s); commit or clear it",
                             "audio")
        self.buffer += pcm

    async def on_buffer_commit(self, ev: dict[str, Any]) -> None:
        if not self.buffer:
            raise EventError("input_audio_buffer_commit_empty", "the input audio buffer is empty: append audio first")
        pcm, self.buffer = bytes(self.buffer), bytearray()
        item = _Item(_new_id("item"), "user", audio=_wav(pcm), audio_ms=len(pcm) * 1000 // (2 * INPUT_RATE))
        previous = self.items[-1].id if self.items else None
        await self.send(E.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id))
        await self.add(item)

    async def on_buffer_clear(self, ev: dict[str, Any]) -> None:
        self.buffer = bytearray()
        await self.send(E.event("input_audio_buffer.cleared"))

    def _item(self, ev: dict[str, Any]) -> _Item:
        item_id = ev.get("item_id")
        found = next((i for i in self.items if i.id == item_id), None)
        if found is None:
            raise EventError("item_not_found", f"no item {item_id!r} in this conversation", "item_id")
        return found

    async def on_item_truncate(self, ev: dict[str, Any]) -> None:
        """The client played `audio_end_ms` of an assistant's speech: its transcript is cut to the
        words heard (in proportion to the speech sent), and that is what the history keeps."""
        item = self._item(ev)
        end = ev.get("audio_end_ms")
        if item.role != "assistant" or not item.spoken:
            raise EventError("invalid_value", "only an assistant's audio can be truncated", "item_id")
        if ev.get("content_index", 0) != 0:
            raise EventError("invalid_value", "content_index must be 0", "content_index")
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= item.audio_ms:
            raise EventError("invalid_value", f"audio_end_ms must be from 0 to {item.audio_ms} (the audio's "
                             "length)", "audio_end_ms")
        if self.current is not None and self.current.item is item:
            await self.cancel_response("client_cancelled")
        words = item.text.split(" ")
        keep = len(words) * end // item.audio_ms if item.audio_ms else 0
        item.text, item.tokens, item.audio_ms = " ".join(words[:keep]), None, end
        item.status = "incomplete"
        await self.send(E.event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end))

    async def on_item_delete(self, ev: dict[str, Any]) -> None:
        item = self._item(ev)
        if self.current is not None and self.current.item is item:
            await self.cancel_response("client_cancelled")
        self.items.remove(item)
        await self.send(E.event("conversation.item.deleted", item_id=item.id))

    async def on_item_retrieve(self, ev: dict[str, Any]) -> None:
        await self.send(E.event("conversation.item.retrieved", item=self._item(ev).doc()))

    def prompt(self, reserve: int) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]], int]:
        """The conversation as chat messages and their audio, newest first kept: the oldest turns are
        dropped until it fits the token stage's context less `reserve` (the answer's tokens), and audio
        beyond what the first stage takes per job (its media count) is dropped from older turns. Also
        how many items were dropped."""
        stage_name = admission.token_stage(self.config, self.p)
        window = prompt_length.window_of(self.config.stages[stage_name]) if stage_name else None
        budget = window.max_len - reserve if window is not None else None
        audio_left = self.media.count("audio") if self.media is not None else 0
        chosen: list[tuple[_Item, bool]] = []
        used = 0
        if self.instructions:
            used += TOKENS_PER_MESSAGE + (prompt_length.count(window, self.instructions)[0] if window else 0)
        for item in reversed(self.items):
            with_audio = item.audio is not None and audio_left > 0
            if item.audio is not None and not with_audio and not item.text:
                continue
            if item.tokens is None:
                item.tokens = prompt_length.count(window, item.text)[0] if window is not None and item.text else 0
            cost = TOKENS_PER_MESSAGE + item.tokens + (item.audio_ms * AUDIO_TOKENS_PER_S // 1000 if with_audio else 0)
            if budget is not None and used + cost > budget and chosen:
                break
            used += cost
            audio_left -= with_audio
            chosen.append((item, with_audio))
        dropped = len(self.items) - len(chosen)
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        parts: list[tuple[str, bytes, str]] = []
        for item, with_audio in reversed(chosen):
            if with_audio and item.audio is not None:
                content: Any = [{"type": "audio"}] + ([{"type": "text", "text": item.text}] if item.text else [])
                parts.append(("audio", item.audio, f"item {item.id}"))
            else:
                content = item.text
            messages.append({"role": item.role, "content": content})
        return messages, parts, dropped

    # ------------------------------------------------------------------ responses

    async def on_response_create(self, ev: dict[str, Any]) -> None:
        r = ev.get("response") or {}
        if not isinstance(r, dict):
            raise EventError("invalid_value", "response must be an object", "response")
        if self.current is not None:
            raise EventError("conversation_already_has_active_response", f"response {self.current.id} is under way: "
                             "cancel it first (response.cancel) or wait for its response.done")
        unknown = sorted(set(r) - _RESPONSE_KEYS)
        if unknown:
            raise EventError("unknown_parameter", f"response.{unknown[0]} is not supported here", f"response.{unknown[0]}")
        if r.get("conversation", "auto") != "auto":
            raise EventError("unsupported", "responses are in the session's conversation only (conversation \"auto\")",
                             "response.conversation")
        if r.get("tools") not in (None, []) or r.get("tool_choice") not in (None, "auto", "none"):
            raise EventError("unsupported", "tools are not supported", "response.tools")
        modalities = self._modalities(r.get("output_modalities"), "response.output_modalities") or self.modalities
        voice = self._audio(r.get("audio"), "response.audio", input_too=False) or self.voice
        max_tokens = self._max_tokens(r.get("max_output_tokens"), "response.max_output_tokens") \
            if "max_output_tokens" in r else self.max_tokens
        metadata = r.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 15 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise EventError("invalid_value", "response.metadata holds up to 15 string keys and values",
                             "response.metadata")
        instructions = r.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise EventError("invalid_type", "response.instructions must be a string", "response.instructions")
        if not any(i.role == "user" for i in self.items):
            raise EventError("invalid_value", "the conversation has no user turn yet: conversation.item.create or "
                             "input_audio_buffer.commit first")
        gen = generation(self.config, self.p)
        params = sampling(self.config, self.p, {"max_tokens": max_tokens} if max_tokens else {},
                           {"include_prompt": False})
        if gen.token_stage is not None:
            stage = self.config.stages[gen.token_stage]
            reserve = max_tokens or int(params.get(gen.token_stage, {}).get("max_tokens")
                                        or stage.defaults.get("max_tokens") or 16)
        else:
            reserve = 0
        for s in self.p.stages:          # the voice, to a stage that declares one in its defaults
            for key in ("voice", "speaker"):
                if key in self.config.stages[s].defaults:
                    params.setdefault(s, {})[key] = voice
        saved = self.instructions
        if instructions is not None:
            self.instructions = instructions
        try:
            messages, parts, dropped = self.prompt(reserve)
        finally:
            self.instructions = saved
        if parts:
            inputs, summary = media_inputs(self.config, self.p, json.dumps(messages), parts)
        else:
            inputs, summary = admission.inputs(self.config, {"messages": json.dumps(messages)}, self.p)
        job = self.rt.jobs.submit(self.request, self.p, inputs, params, summary)
        self.responses += 1
        item = _Item(_new_id("item"), "assistant", spoken="audio" in modalities, status="in_progress")
        resp = _Response(_new_id("resp"), item, job, gen, "audio" in modalities,
                         {**metadata, "omnid_job": job.id}, voice)
        self.current = resp
        if dropped:
            log.debug("realtime prompt trimmed", session=self.id, dropped=dropped, job=job.id)
        await self.send(E.event("response.created", response=self.response_doc(resp, "in_progress")))
        resp.task = asyncio.get_running_loop().create_task(self._answer(resp), name=f"realtime-{resp.id}")

    def response_doc(self, r: _Response, status: str, reason: str | None = None,
                     error: dict[str, Any] | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": r.id, "object": "realtime.response", "status": status, "conversation_id": self.id,
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

    async def _answer(self, r: _Response) -> None:
        """The response's events as its job makes them; then its last ones (unless cancelled: the
        canceller sends those)."""
        head = r.head()
        reader = LiveAudio(self.rt.api.store.job_dir(r.job.id)) if r.audio else None
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
            log.debug("realtime client went away", session=self.id, job=r.job.id, error=str(e))
            return
        finally:
            if reader is not None:
                reader.close()
        r.finishing = True
        if error is not None:
            await self.send(E.error(error.code or "job_failed", error.message, type_=error.type))
        await self.finish(r, "failed" if error is not None else "completed", None,
                          {"type": error.type, "code": error.code or "job_failed"} if error is not None else None)

    async def _item_added(self, item: _Item) -> None:
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        del self.items[:-MAX_ITEMS]
        await self.send(E.event("conversation.item.added", previous_item_id=previous,
                                item={**item.doc(), "content": []}))

    async def _deltas(self, r: _Response, reader: LiveAudio | None) -> AsyncIterator[tuple[str, bytes]]:
        """What the job made since the last delta: its text joined, its speech read (at most
        MAX_DELTA_BYTES at a time); after its end, the rest. OpenAiError if it ended badly."""
        async with aclosing(follow_batches(self.request, self.rt.api.scheduler, r.job.id)) as batches:
            async for batch in batches:
                texts = [t for ev in batch if (t := take(ev, r.gen))]
                pcm = reader.read() if reader is not None else b""
                if texts:
                    r.gen.pieces.extend(texts)
                yield "".join(texts), pcm
        while reader is not None and (pcm := reader.read()):
            yield "", pcm
        succeeded(self.rt.api.scheduler, r.job.id)

    async def _audio_delta(self, r: _Response, reader: LiveAudio | None, pcm: bytes) -> None:
        if r.pcm_bytes == 0 and reader is not None and len(reader.header) >= 28:
            rate = int.from_bytes(reader.header[24:28], "little")
            r.rate = rate
            self.rt.rates[self.p.name] = rate
            if rate != self.rate:               # say it before the first delta at another rate
                self.rate = rate
                await self.send(E.event("session.updated", session=self.session_doc()))
        for at in range(0, len(pcm), MAX_DELTA_BYTES):
            chunk = pcm[at:at + MAX_DELTA_BYTES]
            r.pcm_bytes += len(chunk)
            r.item.audio_ms = r.pcm_bytes * 1000 // (2 * r.rate)
            await self.send(E.event("response.output_audio.delta", **r.head(),
                                    delta=base64.b64encode(chunk).decode("ascii")))

    async def finish(self, r: _Response, status: str, reason: str | None, error: dict[str, Any] | None) -> None:
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
        await self.send(E.event("response.done", response=self.response_doc(r, status, reason, error)))

    async def cancel_response(self, reason: str | None) -> bool:
        """Stop the response under way: its task (no delta after this), its job in every stage, then
        its last events with `cancelled` (`reason` None: the socket is gone, nothing is sent)."""
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
        if r.job.id in self.rt.api.scheduler.live:
            self.rt.api.scheduler.cancel(r.job.id)
            log.info("audit", action="cancel", uid=self.request["uid"], job=r.job.id, session=self.id,
                     why=reason or "the session ended", via=self.request.path)
        if reason is not None and not self.ws.closed:
            if r.item not in self.items:
                await self._item_added(r.item)
            await self.finish(r, "cancelled", reason, None)
        return True

    async def on_response_cancel(self, ev: dict[str, Any]) -> None:
        wanted = ev.get("response_id")
        if self.current is None or (wanted is not None and wanted != self.current.id):
            raise EventError("response_cancel_not_active", "there is no response under way to cancel"
                             + (f" with id {wanted!r}" if wanted is not None else ""), "response_id")
        if not await self.cancel_response("client_cancelled"):
            raise EventError("response_cancel_not_active", "the response had ended already", "response_id")


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


def _b64(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise EventError("invalid_value", f"{param} must be base64 text", param)
    try:
        return base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise EventError("invalid_value", f"{param} is not valid base64", param) from None


def _wav(pcm: bytes) -> bytes:
    """PCM16 mono at 24 kHz as a WAV file (what a job's `audio` input takes)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(INPUT_RATE)
        w.writeframes(pcm)
    return out.getvalue()
