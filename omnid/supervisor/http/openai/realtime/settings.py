"""A realtime session's settings, and what a client may set of them: `session.update` (output
modalities, instructions, audio formats and voice, turn detection, max output tokens) and the
options of one `response.create`, checked as OpenAI's schema and the pipeline allow; the session as
RealtimeSession writes it.

What OpenAI accepts, omnid accepts: an optional feature omnid lacks (tools, input transcription,
noise reduction, an idle timeout, a stored prompt) never refuses an update whole. The rest of the
update applies, the feature comes back off (null, or `[]` for tools) in `session.updated`, and
`update` returns its name for the session to log. A wrong value (a threshold of 7, an audio
format omnid does not take) is still refused.

Runs in the supervisor's event-loop thread, owned by one realtime session (session.py) and read by
its responses (responses.py). State and pure checks only: nothing here sends or awaits; a
client's mistake is an `EventError` (events.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnid.supervisor.http.openai.realtime import events as E
from omnid.supervisor.http.openai.realtime.conversation import INPUT_RATE
from omnid.supervisor.http.openai.realtime.events import EventError

_FORMAT = {"type": "audio/pcm", "rate": E.OPENAI_RATE}
_SESSION_KEYS = {"type", "model", "output_modalities", "instructions", "audio", "max_output_tokens", "tools",
                 "tool_choice", "tracing", "include", "truncation", "parallel_tool_calls", "reasoning", "prompt"}
_OPTIONAL = ("tools", "tracing", "include", "parallel_tool_calls", "reasoning", "prompt")  # taken, not done
# semantic_vad: omnid judges turns by silence alone; its eagerness is how long a pause ends a turn.
EAGERNESS_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 300}
_RESPONSE_KEYS = {"output_modalities", "instructions", "audio", "max_output_tokens", "metadata", "conversation",
                  "tools", "tool_choice"}


@dataclass
class TurnDetection:
    """Server VAD's settings (OpenAI's `server_vad`, with its defaults), or `semantic_vad`'s
    eagerness mapped onto the silence that ends a turn (EAGERNESS_MS)."""

    type: str = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: str = "auto"             # semantic_vad's

    def doc(self) -> dict[str, Any]:
        """As OpenAI's RealtimeTurnDetection; semantic_vad also says the silence it maps onto."""
        common = {"create_response": self.create_response, "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, **common,
                    "silence_duration_ms": self.silence_duration_ms, "threshold": self.threshold,
                    "prefix_padding_ms": self.prefix_padding_ms}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, **common, "idle_timeout_ms": None}


def turn_detection(raw: Any, param: str, ignored: list[str]) -> TurnDetection | None:
    """`audio.input.turn_detection`, checked: None turns it off (manual turns)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise EventError("invalid_type", f"{param} must be an object or null", param)
    kind = raw.get("type", "server_vad")
    known = {"server_vad": {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                            "interrupt_response", "idle_timeout_ms"},
             "semantic_vad": {"type", "eagerness", "create_response", "interrupt_response"}}
    if kind not in known:
        raise EventError("invalid_value", f"{param}.type must be \"server_vad\" or \"semantic_vad\"", f"{param}.type")
    unknown = sorted(set(raw) - known[kind])
    if unknown:
        raise EventError("unknown_parameter", f"{param}.{unknown[0]} is not a {kind} setting", f"{param}.{unknown[0]}")
    t = TurnDetection(type=kind)
    for name in ("create_response", "interrupt_response"):
        v = raw.get(name, True)
        if not isinstance(v, bool):
            raise EventError("invalid_type", f"{param}.{name} must be true or false", f"{param}.{name}")
        setattr(t, name, v)
    if kind == "semantic_vad":
        eagerness = raw.get("eagerness", "auto")
        if eagerness not in EAGERNESS_MS:
            raise EventError("invalid_value", f"{param}.eagerness must be low, medium, high or auto",
                             f"{param}.eagerness")
        t.eagerness, t.silence_duration_ms = eagerness, EAGERNESS_MS[eagerness]
        return t
    threshold = raw.get("threshold", t.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise EventError("invalid_value", f"{param}.threshold must be a number from 0.0 to 1.0", f"{param}.threshold")
    t.threshold = float(threshold)
    for name, low, high in (("prefix_padding_ms", 0, 10000), ("silence_duration_ms", 0, 10000)):
        v = raw.get(name, getattr(t, name))
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise EventError("invalid_value", f"{param}.{name} must be an integer from {low} to {high}",
                             f"{param}.{name}")
        setattr(t, name, v)
    idle = raw.get("idle_timeout_ms")
    if idle is not None:
        if isinstance(idle, bool) or not isinstance(idle, int) or not 5000 <= idle <= 30000:
            raise EventError("invalid_value", f"{param}.idle_timeout_ms must be an integer from 5000 to 30000, or "
                             "null", f"{param}.idle_timeout_ms")
        ignored.append(f"{param}.idle_timeout_ms")
    return t


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
    hears: bool = False                 # the pipeline takes audio (server VAD is then the default)
    vad: bool = True                    # server VAD can run here (the `vad` extra is installed)
    transcribes: bool = False           # the daemon names a pipeline for input transcription
    rate: int = E.OPENAI_RATE           # the PCM rate its speech comes at (said again when it changes)
    modalities: list[str] = field(default_factory=list)
    instructions: str = ""
    voice: str = "alloy"
    max_tokens: int | None = None
    turn: TurnDetection | None = None   # None: manual turns (the client commits)
    transcription: dict[str, Any] | None = None     # what the client asked of input transcription, if on

    def __post_init__(self) -> None:
        if not self.modalities:
            self.modalities = ["audio"] if self.speaks else ["text"]
        if self.hears and self.vad:
            self.turn = TurnDetection()

    def doc(self, session_id: str) -> dict[str, Any]:
        """The session as OpenAI's RealtimeSession."""
        fmt = {"type": "audio/pcm", "rate": self.rate}
        return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
                "output_modalities": list(self.modalities), "instructions": self.instructions,
                "max_output_tokens": self.max_tokens if self.max_tokens is not None else "inf",
                "tools": [], "tool_choice": "auto",
                "audio": {"input": {"format": dict(_FORMAT), "transcription": self.transcription,
                                    "noise_reduction": None,
                                    "turn_detection": self.turn.doc() if self.turn is not None else None},
                          "output": {"format": fmt, "voice": self.voice}}}

    def update(self, s: Any) -> list[str]:
        """`session.update`'s `session`: every field checked, then all applied. The optional
        features asked for that omnid lacks (left off) are returned, for a log line."""
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
        ignored = [f"session.{k}" for k in _OPTIONAL if s.get(k) not in (None, [], False, "auto")]
        turn = self.turn
        voice = self._audio(s.get("audio"), "session.audio", input_too=True, ignored=ignored)
        audio_in = (s.get("audio") or {}).get("input") or {}
        if "turn_detection" in audio_in:
            turn = turn_detection(audio_in["turn_detection"], "session.audio.input.turn_detection", ignored)
            if turn is not None and not (self.hears and self.vad):
                ignored.append("session.audio.input.turn_detection")
                turn = None
        if isinstance(audio_in.get("transcription"), dict) and self.transcribes:
            ignored.remove("session.audio.input.transcription")
        max_tokens = _max_tokens(s.get("max_output_tokens"), "session.max_output_tokens")
        if s.get("tool_choice") not in (None, "auto", "none", "required") and not isinstance(s.get("tool_choice"), dict):
            raise EventError("invalid_value", "session.tool_choice must be auto, none, required or a tool",
                             "session.tool_choice")
        self.turn = turn
        if "transcription" in audio_in:
            self.transcription = dict(audio_in["transcription"]) \
                if self.transcribes and audio_in["transcription"] is not None else None
        if modalities is not None:
            self.modalities = modalities
        if instructions is not None:
            self.instructions = instructions
        if voice is not None:
            self.voice = voice
        if "max_output_tokens" in s:
            self.max_tokens = max_tokens
        return ignored

    def response_options(self, r: Mapping[str, Any]) -> ResponseOptions:
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
        # (a response's audio takes no input side, so nothing lands in `ignored`)
        voice = self._audio(r.get("audio"), "response.audio", input_too=False, ignored=[]) or self.voice  # pragma: no mutate
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

    def _audio(self, raw: Any, param: str, input_too: bool, ignored: list[str]) -> str | None:
        """The `audio` settings (formats checked: PCM16 only, at the rates omnid gives and takes); the
        voice. Input transcription and noise reduction asked for are left off (`ignored`); turn
        detection is `update`'s."""
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
            for optional in ("transcription", "noise_reduction"):
                if part.get(optional) is not None:
                    if not isinstance(part[optional], dict):
                        raise EventError("invalid_type", f"{param}.input.{optional} must be an object or null",
                                         f"{param}.input.{optional}")
                    ignored.append(f"{param}.input.{optional}")
            v = part.get("voice")
            if isinstance(v, dict):
                v = v.get("id")
            if v is not None and (not isinstance(v, str) or not v):
                raise EventError("invalid_value", f"{param}.output.voice must be a voice's name", f"{param}.output.voice")
            voice = v if v is not None else voice   # pragma: no mutate (equivalent: only the output side, the last, names one)
        return voice


def _max_tokens(raw: Any, param: str) -> int | None:
    if raw is None or raw == "inf":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 4096:
        raise EventError("invalid_value", f"{param} must be an integer from 1 to 4096, or \"inf\"", param)
    return raw
