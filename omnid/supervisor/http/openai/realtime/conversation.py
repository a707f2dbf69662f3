"""A realtime session's conversation: its items (as OpenAI's RealtimeConversationItem writes them),
the input audio buffer (PCM16, 24 kHz mono, made a WAV when committed), the client's items checked
as they are added, and the conversation as a job's chat prompt bounded by the model's context.

Runs in the supervisor's event-loop thread, owned by one realtime session (session.py) and read by
its responses (responses.py). State only, and pure checks: nothing here sends an event or
awaits; a client's mistake is an `EventError` (events.py). Its tokens are counted with the
model's own tokenizer (omnid/prompt_length.py), once per item.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnid import prompt_length
from omnid.config import Config, PipelineConfig
from omnid.media import MediaLimits
from omnid.supervisor.http import admission
from omnid.supervisor.http.openai.realtime import events as E
from omnid.supervisor.http.openai.realtime.events import EventError, new_id

MAX_ITEMS = 1024                        # a conversation's items kept at most (the oldest go first)
INPUT_RATE = E.OPENAI_RATE              # input_audio_buffer: PCM16 mono at OpenAI's 24 kHz
TOKENS_PER_MESSAGE = 8                  # a chat template's tokens around one message, at most (tiny and real)
AUDIO_TOKENS_PER_S = 50                 # what one second of input audio may cost in the prompt (Whisper: 25)


@dataclass
class Item:
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


def b64(value: Any, param: str) -> bytes:
    """A client event's base64 field, decoded."""
    if not isinstance(value, str):
        raise EventError("invalid_value", f"{param} must be base64 text", param)
    try:
        return base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise EventError("invalid_value", f"{param} is not valid base64", param) from None


def wav(pcm: bytes) -> bytes:
    """PCM16 mono at 24 kHz as a WAV file (what a job's `audio` input takes)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(INPUT_RATE)
        w.writeframes(pcm)
    return out.getvalue()


class Conversation:
    """The items of one session, newest last (at most MAX_ITEMS), and its uncommitted input audio."""

    def __init__(self, config: Config, p: PipelineConfig, media: MediaLimits | None) -> None:
        self.config, self.p, self.media = config, p, media      # media: what the first stage takes
        self.items: list[Item] = []
        self.buffer = bytearray()               # input audio, PCM16 24 kHz mono, until committed

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def append(self, item: Item) -> str | None:
        """The item, last (the oldest beyond MAX_ITEMS go); the id of the one before it."""
        previous = self.last_id
        self.items.append(item)
        del self.items[:-MAX_ITEMS]
        return previous

    def find(self, item_id: Any) -> Item:
        found = next((i for i in self.items if i.id == item_id), None)
        if found is None:
            raise EventError("item_not_found", f"no item {admission.shown(item_id)} in this conversation", "item_id")
        return found

    # ------------------------------------------------------------------ what a client adds

    def pcm_in(self, pcm: bytes, param: str) -> bytes:
        """A client's PCM16, if the pipeline takes audio."""
        if self.media is None or not self.media.count("audio"):
            raise EventError("audio_not_accepted", f"model {self.p.name!r} takes no audio (its first stage's model "
                             "takes none)", param)
        if len(pcm) % 2:
            raise EventError("invalid_value", "PCM16 audio is an even number of bytes", param)
        return pcm

    def buffer_limit(self) -> int:
        """The input audio buffer's bytes at most: the stage's media.max_audio_s."""
        return int(self.media.max_audio_s * INPUT_RATE) * 2 if self.media is not None else 0

    def buffer_append(self, raw: Any) -> None:
        """`input_audio_buffer.append`'s audio into the buffer, up to the stage's media.max_audio_s."""
        pcm = self.pcm_in(b64(raw, "audio"), "audio")
        limit = self.buffer_limit()
        if len(self.buffer) + len(pcm) > limit:
            raise EventError("input_audio_buffer_too_large", f"the input audio buffer would hold more than "
                             f"{limit // (2 * INPUT_RATE)} s (the stage's media.max_audio_s); commit or clear it",
                             "audio")
        self.buffer += pcm

    def commit(self, item_id: str | None = None) -> Item:
        """The buffer as a user's audio item (not yet added; server VAD names its id); the buffer emptied."""
        if not self.buffer:
            raise EventError("input_audio_buffer_commit_empty", "the input audio buffer is empty: append audio first")
        pcm, self.buffer = bytes(self.buffer), bytearray()
        return Item(item_id or new_id("item"), "user", audio=wav(pcm), audio_ms=len(pcm) * 1000 // (2 * INPUT_RATE))

    def new_item(self, ev: Mapping[str, Any]) -> Item:
        """`conversation.item.create`'s item, checked (a message at the end: text; a user's audio)."""
        item = ev.get("item")
        if not isinstance(item, dict):
            raise EventError("invalid_value", "conversation.item.create needs \"item\": an object", "item")
        if item.get("type", "message") != "message":
            raise EventError("unsupported", f"item.type {admission.shown(item.get('type'))} is not supported: messages only",
                             "item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise EventError("invalid_value", "item.role must be user, assistant or system", "item.role")
        if ev.get("previous_item_id") not in (None, self.last_id, "root"):
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
                audio = self.pcm_in(b64(part["audio"], at), at)
            elif kind == "output_audio" and role == "assistant" and isinstance(part.get("transcript"), str):
                texts.append(part["transcript"])
            else:
                raise EventError("invalid_value", f"{at}: a {role} message's parts are input_text (text)"
                                 + (" or input_audio (base64 PCM16, 24 kHz mono)" if role == "user" else ""), at)
        given = item.get("id")
        if given is not None and (not isinstance(given, str) or not given or len(given) > 64
                                  or any(i.id == given for i in self.items)):
            raise EventError("invalid_value", "item.id must be a new string of up to 64 characters", "item.id")
        new = Item(given or new_id("item"), str(role), "\n".join(texts), spoken=False)
        if audio is not None:
            new.audio, new.audio_ms = wav(audio), len(audio) * 1000 // (2 * INPUT_RATE)
        return new

    def truncation(self, ev: Mapping[str, Any]) -> tuple[Item, int]:
        """`conversation.item.truncate`'s item and `audio_end_ms`, checked."""
        item = self.find(ev.get("item_id"))
        end = ev.get("audio_end_ms")
        if item.role != "assistant" or not item.spoken:
            raise EventError("invalid_value", "only an assistant's audio can be truncated", "item_id")
        if ev.get("content_index", 0) != 0:
            raise EventError("invalid_value", "content_index must be 0", "content_index")
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= item.audio_ms:
            raise EventError("invalid_value", f"audio_end_ms must be from 0 to {item.audio_ms} (the audio's "
                             "length)", "audio_end_ms")
        return item, end

    @staticmethod
    def truncate(item: Item, end: int) -> None:
        """The client played `end` ms of an assistant's speech: its transcript is cut to the words
        heard (in proportion to the speech sent), and that is what the history keeps."""
        words = item.text.split(" ")
        keep = len(words) * end // item.audio_ms if item.audio_ms else 0
        item.text, item.tokens, item.audio_ms = " ".join(words[:keep]), None, end
        item.status = "incomplete"

    # ------------------------------------------------------------------ the prompt

    def prompt(self, instructions: str,
               reserve: int) -> tuple[list[dict[str, Any]], list[tuple[str, bytes, str]], int]:
        """The conversation as chat messages and their audio, newest first kept: the oldest turns are
        dropped until it fits the token stage's context less `reserve` (the answer's tokens), and audio
        beyond what the first stage takes per job (its media count) is dropped from older turns. Also
        how many items were dropped."""
        stage_name = admission.token_stage(self.config, self.p)
        window = prompt_length.window_of(self.config.stages[stage_name]) if stage_name else None
        budget = window.max_len - reserve if window is not None else None
        audio_left = self.media.count("audio") if self.media is not None else 0
        chosen: list[tuple[Item, bool]] = []
        used = 0
        if instructions:
            used += TOKENS_PER_MESSAGE + (prompt_length.count(window, instructions)[0] if window else 0)
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
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        parts: list[tuple[str, bytes, str]] = []
        for item, with_audio in reversed(chosen):
            if with_audio and item.audio is not None:
                content: Any = [{"type": "audio"}] + ([{"type": "text", "text": item.text}] if item.text else [])
                parts.append(("audio", item.audio, f"item {item.id}"))
            else:
                content = item.text
            messages.append({"role": item.role, "content": content})
        return messages, parts, dropped
