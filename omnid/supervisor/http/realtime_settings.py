"""A realtime session's settings, and what a client may set of them: `session.update` (output
modalities, instructions, audio formats and voice, max output tokens) and the options of one
`response.create`, checked as OpenAI's schema and the pipeline allow; the session as
RealtimeSession writes it.

Runs in the supervisor's event-loop thread, owned by one realtime session (realtime.py) and read by
its responses (realtime_responses.py). State and pure checks only: nothing here sends or awaits; a
client's mistake is an `EventError` (realtime_events.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnid.supervisor.http import realtime_events as E
from omnid.supervisor.http.realtime_conversation import INPUT_RATE
from omnid.supervisor.http.realtime_events import EventError

_FORMAT = {"type": "audio/pcm", "rate": E.OPENAI_RATE}
_SESSION_KEYS = {"type", "model", "output_modalities", "instructions", "audio", "max_output_tokens", "tools",
                 "tool_choice", "tracing", "include", "truncation"}
_RESPONSE_KEYS = {"output_modalities", "instructions", "audio", "max_output_tokens", "metadata", "conversation",
                  "tools", "tool_choice"}


@dataclass
class ResponseOptions:
    """What one `response.create` asks, the session's settings filling what it leaves out."""

    modalities: list[str]
    voice: str
    max_tokens: int | None
    metadata: dict[str, str]
    instructions: str | None            # None: the session's


@dataclass
class SessionSettings:
    """A session's settings: what it answers in, with what voice and instructions, at what PCM rate."""

    model: str                          # the pipeline's name (the URL's; it cannot change)
    speaks: bool                        # the pipeline may answer in audio
    rate: int = E.OPENAI_RATE           # the PCM rate its speech comes at (said again when it changes)
    modalities: list[str] = field(default_factory=list)
    instructions: str = ""
    voice: str = "alloy"
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.modalities:
            self.modalities = ["audio"] if self.speaks else ["text"]

    def doc(self, session_id: str) -> dict[str, Any]:
        """The session as OpenAI's RealtimeSession."""
        fmt = {"type": "audio/pcm", "rate": self.rate}
        return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
                "output_modalities": list(self.modalities), "instructions": self.instructions,
                "max_output_tokens": self.max_tokens if self.max_tokens is not None else "inf",
                "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": dict(_FORMAT), "turn_detection": None},
                          "output": {"format": fmt, "voice": self.voice}}}

    def update(self, s: Any) -> None:
        """`session.update`'s `session`: every field checked, then all applied."""
        if not isinstance(s, dict):
            raise EventError("invalid_value", "session.update needs \"session\": an object", "session")
        unknown = sorted(set(s) - _SESSION_KEYS)
        if unknown:
            raise EventError("unknown_parameter", f"session.{unknown[0]} is not supported here", f"session.{unknown[0]}")
        if s.get("type", "realtime") != "realtime":
            raise EventError("invalid_value", "session.type must be \"realtime\" (transcription sessions are not "
                             "supported)", "session.type")
        if s.get("model") not in (None, self.model):
            raise EventError("invalid_value", f"the session's model is {self.model!r} (the URL's); it cannot change",
                             "session.model")
        modalities = self._modalities(s.get("output_modalities"), "session.output_modalities")
        instructions = s.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise EventError("invalid_type", "session.instructions must be a string", "session.instructions")
        voice = self._audio(s.get("audio"), "session.audio", input_too=True)
        max_tokens = _max_tokens(s.get("max_output_tokens"), "session.max_output_tokens")
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

    def response_options(self, r: dict[str, Any]) -> ResponseOptions:
        """`response.create`'s `response` (an object), checked; what it leaves out is the session's."""
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
        max_tokens = _max_tokens(r.get("max_output_tokens"), "response.max_output_tokens") \
            if "max_output_tokens" in r else self.max_tokens
        metadata = r.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 15 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise EventError("invalid_value", "response.metadata holds up to 15 string keys and values",
                             "response.metadata")
        instructions = r.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise EventError("invalid_type", "response.instructions must be a string", "response.instructions")
        return ResponseOptions(modalities, voice, max_tokens, metadata, instructions)

    def _modalities(self, raw: Any, param: str) -> list[str] | None:
        if raw is None:
            return None
        if not isinstance(raw, list) or not raw or any(m not in ("text", "audio") for m in raw):
            raise EventError("invalid_value", f"{param} must be [\"audio\"] or [\"text\"]", param)
        if "audio" in raw and not self.speaks:
            raise EventError("invalid_value", f"model {self.model!r} does not speak: its output_modalities can "
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


def _max_tokens(raw: Any, param: str) -> int | None:
    if raw is None or raw == "inf":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 4096:
        raise EventError("invalid_value", f"{param} must be an integer from 1 to 4096, or \"inf\"", param)
    return raw
