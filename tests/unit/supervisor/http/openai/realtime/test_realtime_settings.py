"""A realtime session's settings, in process (`omnid.supervisor.http.openai.realtime.settings`):
`session.update` checked whole before any of it applies, a response's options filled from the
session's, and the session as OpenAI's RealtimeSession writes it."""

from __future__ import annotations

from typing import Any

import pytest

from omnid.supervisor.http.openai.realtime.events import EventError
from omnid.supervisor.http.openai.realtime.settings import EAGERNESS_MS, SessionSettings, TurnDetection, turn_detection


def refused(call: Any, *args: Any) -> EventError:
    with pytest.raises(EventError) as e:
        call(*args)
    return e.value


def test_a_session_update_applies_what_it_sets() -> None:
    s = SessionSettings("omni", speaks=True)
    assert s.modalities == ["audio"] and SessionSettings("chat", speaks=False).modalities == ["text"]
    s.update({"type": "realtime", "model": "omni", "output_modalities": ["text"], "instructions": "Be brief.",
              "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                        "output": {"voice": {"id": "ash"}}}, "max_output_tokens": 64})
    assert (s.modalities, s.instructions, s.voice, s.max_tokens) == (["text"], "Be brief.", "ash", 64)
    s.update({"max_output_tokens": "inf"})
    assert s.max_tokens is None and s.voice == "ash"
    doc = s.doc("sess_1")
    assert doc["id"] == "sess_1" and doc["max_output_tokens"] == "inf"
    assert doc["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "ash"}


def test_a_wrong_update_changes_nothing() -> None:
    s = SessionSettings("chat", speaks=False, rate=16000)
    cases = [("nope", "session"), ({"voice": "ash"}, "session.voice"), ({"type": "transcription"}, "session.type"),
             ({"model": "other"}, "session.model"), ({"output_modalities": ["audio"]}, "session.output_modalities"),
             ({"instructions": 3}, "session.instructions"),
             ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}}, "session.audio.output.format"),
             ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 7}}}},
              "session.audio.input.turn_detection.threshold"),
             ({"audio": {"input": {"turn_detection": {"silence_duration_ms": -1}}}},
              "session.audio.input.turn_detection.silence_duration_ms"),
             ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
              "session.audio.input.turn_detection.eagerness"),
             ({"audio": {"input": {"turn_detection": {"type": "ai_vad"}}}}, "session.audio.input.turn_detection.type"),
             ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format"),
             ({"max_output_tokens": 0}, "session.max_output_tokens"),
             ({"instructions": "x", "max_output_tokens": True}, "session.max_output_tokens")]
    for update, param in cases:
        assert refused(s.update, update).param == param, update
    assert (s.instructions, s.max_tokens, s.modalities) == ("", None, ["text"])


def test_a_responses_options() -> None:
    s = SessionSettings("omni", speaks=True, voice="ash", max_tokens=32, instructions="session's")
    opts = s.response_options({})
    assert (opts.modalities, opts.voice, opts.max_tokens, opts.metadata, opts.instructions) == (
        ["audio"], "ash", 32, {}, None)
    opts = s.response_options({"output_modalities": ["text"], "max_output_tokens": "inf", "instructions": "now",
                               "metadata": {"k": "v"}, "audio": {"output": {"voice": "coral"}}})
    assert (opts.modalities, opts.voice, opts.max_tokens, opts.metadata, opts.instructions) == (
        ["text"], "coral", None, {"k": "v"}, "now")
    for r, param in (({"voice": "x"}, "response.voice"), ({"conversation": "none"}, "response.conversation"),
                     ({"tool_choice": "required"}, "response.tools"), ({"metadata": {"k": 1}}, "response.metadata"),
                     ({"audio": {"input": {}}}, "response.audio.input"), ({"instructions": 1}, "response.instructions")):
        assert refused(s.response_options, r).param == param, r


def test_optional_features_omnid_lacks_are_left_off_not_refused() -> None:
    """What livekit-agents sends by default (semantic_vad, input transcription, noise reduction,
    tools): the update applies, the rest comes back off and is named for the log."""
    s = SessionSettings("voice", speaks=True, hears=True)
    assert s.turn is not None and s.doc("s")["audio"]["input"]["turn_detection"] == {
        "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
        "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}     # OpenAI's defaults
    ignored = s.update({"type": "realtime", "instructions": "Be brief.", "tools": [{"type": "function", "name": "f"}],
                        "tool_choice": "auto",
                        "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"},
                                            "noise_reduction": {"type": "near_field"},
                                            "turn_detection": {"type": "semantic_vad", "eagerness": "high",
                                                               "create_response": True, "interrupt_response": True}}}})
    assert ignored == ["session.tools", "session.audio.input.transcription", "session.audio.input.noise_reduction"]
    doc = s.doc("s")
    assert s.instructions == "Be brief." and doc["tools"] == []
    audio_in = doc["audio"]["input"]
    assert audio_in["transcription"] is None and audio_in["noise_reduction"] is None
    assert audio_in["turn_detection"]["type"] == "semantic_vad" and audio_in["turn_detection"]["eagerness"] == "high"
    assert audio_in["turn_detection"]["silence_duration_ms"] == EAGERNESS_MS["high"] == s.turn.silence_duration_ms
    s.update({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7,
                                                     "silence_duration_ms": 800, "idle_timeout_ms": 6000}}}})
    assert s.turn is not None and (s.turn.threshold, s.turn.silence_duration_ms, s.turn.prefix_padding_ms) == (
        0.7, 800, 300)
    s.update({"audio": {"input": {"turn_detection": None}}})
    assert s.turn is None and s.doc("s")["audio"]["input"]["turn_detection"] is None        # manual turns
    # a pipeline that takes no audio has no turn detection: asked for, it is left off
    text = SessionSettings("omni", speaks=True)
    assert text.turn is None
    assert text.update({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}) == [
        "session.audio.input.turn_detection"] and text.turn is None
    # with a transcription pipeline configured, the transcription asked for takes effect
    t = SessionSettings("voice", speaks=True, hears=True, transcribes=True)
    assert t.update({"audio": {"input": {"transcription": {"model": "whisper-1"}, "noise_reduction": None}}}) == []
    assert t.doc("s")["audio"]["input"]["transcription"] == {"model": "whisper-1"}
    t.update({"audio": {"input": {"transcription": None}}})
    assert t.transcription is None
    # without the vad extra installed, a session that hears starts with manual turns
    assert SessionSettings("voice", speaks=True, hears=True, vad=False).turn is None


FORMAT_24K = {"type": "audio/pcm", "rate": 24000}
TOKENS = "must be an integer from 1 to 4096, or \"inf\""
# (optional features omnid lacks, turn detection, transcription, noise reduction and tools, are left
# off, not refused: test_optional_features_omnid_lacks_are_left_off_not_refused)
UPDATE_REFUSED = [
    ("nope", "invalid_value", 'session.update needs "session": an object', "session"),
    ({"voice": "ash"}, "unknown_parameter", "session.voice is not supported here", "session.voice"),
    ({"type": "transcription"}, "invalid_value",
     'session.type must be "realtime" (transcription sessions are not supported)', "session.type"),
    ({"model": "other"}, "invalid_value", "the session's model is 'chat' (the URL's); it cannot change", "session.model"),
    ({"output_modalities": ["audio"]}, "invalid_value",
     "model 'chat' does not speak: its output_modalities can only be [\"text\"]", "session.output_modalities"),
    ({"output_modalities": []}, "invalid_value", 'session.output_modalities must be ["audio"] or ["text"]',
     "session.output_modalities"),
    ({"output_modalities": "text"}, "invalid_value", 'session.output_modalities must be ["audio"] or ["text"]',
     "session.output_modalities"),
    ({"output_modalities": ["text", "video"]}, "invalid_value",
     'session.output_modalities must be ["audio"] or ["text"]', "session.output_modalities"),
    ({"instructions": 3}, "invalid_type", "session.instructions must be a string", "session.instructions"),
    ({"audio": "x"}, "invalid_type", "session.audio must be an object", "session.audio"),
    ({"audio": {"input": "x"}}, "invalid_value", "session.audio.input must be an object", "session.audio.input"),
    ({"audio": {"input": {"speed": 1}}}, "unknown_parameter", "session.audio.input.speed is not supported",
     "session.audio.input.speed"),
    ({"audio": {"output": {"format": FORMAT_24K}}}, "invalid_value",
     'session.audio.output.format: omnid gives {"type": "audio/pcm", "rate": 16000} (PCM16 mono) only',
     "session.audio.output.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "invalid_value",
     'session.audio.input.format: omnid takes {"type": "audio/pcm", "rate": 24000} (PCM16 mono) only',
     "session.audio.input.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "invalid_value",
     'session.audio.input.format: omnid takes {"type": "audio/pcm", "rate": 24000} (PCM16 mono) only',
     "session.audio.input.format"),
    ({"audio": {"input": {"format": "pcm"}}}, "invalid_value",
     'session.audio.input.format: omnid takes {"type": "audio/pcm", "rate": 24000} (PCM16 mono) only',
     "session.audio.input.format"),
    ({"audio": {"output": {"voice": ""}}}, "invalid_value", "session.audio.output.voice must be a voice's name",
     "session.audio.output.voice"),
    ({"audio": {"output": {"voice": 3}}}, "invalid_value", "session.audio.output.voice must be a voice's name",
     "session.audio.output.voice"),
    ({"audio": {"output": {"voice": {"id": ""}}}}, "invalid_value",
     "session.audio.output.voice must be a voice's name", "session.audio.output.voice"),
    ({"max_output_tokens": 0}, "invalid_value", f"session.max_output_tokens {TOKENS}", "session.max_output_tokens"),
    ({"max_output_tokens": 4097}, "invalid_value", f"session.max_output_tokens {TOKENS}", "session.max_output_tokens"),
    ({"max_output_tokens": 1.5}, "invalid_value", f"session.max_output_tokens {TOKENS}", "session.max_output_tokens"),
    ({"max_output_tokens": True}, "invalid_value", f"session.max_output_tokens {TOKENS}", "session.max_output_tokens"),
]


@pytest.mark.parametrize("update, code, message, param", UPDATE_REFUSED)
def test_each_refused_update_says_what_and_where(update: Any, code: str, message: str, param: str) -> None:
    s = SessionSettings("chat", speaks=False, rate=16000, instructions="kept", voice="ash", max_tokens=8)
    e = refused(s.update, update)
    assert (e.code, e.message, e.param) == (code, message, param)
    assert (s.modalities, s.instructions, s.voice, s.max_tokens) == (["text"], "kept", "ash", 8)


RESPONSE_REFUSED = [
    ({"voice": "x"}, "unknown_parameter", "response.voice is not supported here", "response.voice"),
    ({"conversation": "none"}, "unsupported",
     "responses are in the session's conversation only (conversation \"auto\")", "response.conversation"),
    ({"tools": [1]}, "unsupported", "tools are not supported", "response.tools"),
    ({"tool_choice": "required"}, "unsupported", "tools are not supported", "response.tools"),
    ({"metadata": {"k": 1}}, "invalid_value", "response.metadata holds up to 15 string keys and values",
     "response.metadata"),
    ({"metadata": {str(i): "v" for i in range(16)}}, "invalid_value",
     "response.metadata holds up to 15 string keys and values", "response.metadata"),
    ({"metadata": ["a"]}, "invalid_value", "response.metadata holds up to 15 string keys and values",
     "response.metadata"),
    ({"audio": {"input": {}}}, "invalid_value", "response.audio.input must be an object", "response.audio.input"),
    ({"instructions": 1}, "invalid_type", "response.instructions must be a string", "response.instructions"),
    ({"max_output_tokens": 5000}, "invalid_value", f"response.max_output_tokens {TOKENS}", "response.max_output_tokens"),
    ({"output_modalities": ["x"]}, "invalid_value", 'response.output_modalities must be ["audio"] or ["text"]',
     "response.output_modalities"),
]


@pytest.mark.parametrize("response, code, message, param", RESPONSE_REFUSED)
def test_each_refused_response_says_what_and_where(response: Any, code: str, message: str, param: str) -> None:
    e = refused(SessionSettings("omni", speaks=True).response_options, response)
    assert (e.code, e.message, e.param) == (code, message, param)


def test_what_the_bounds_and_the_schema_allow_is_taken() -> None:
    s = SessionSettings("omni", speaks=True)
    s.update({"type": "realtime", "model": "omni", "max_output_tokens": 1, "tools": [], "tool_choice": "none",
              "audio": {"input": {"format": FORMAT_24K, "transcription": None, "noise_reduction": None},
                        "output": {"format": {"type": "audio/pcm"}, "voice": {"id": "verse"}, "speed": 1.0}}})
    assert (s.max_tokens, s.voice, s.modalities) == (1, "verse", ["audio"])
    s.update({"max_output_tokens": 4096, "output_modalities": ["audio", "text"], "audio": {"output": {}}})
    assert (s.max_tokens, s.voice, s.modalities) == (4096, "verse", ["audio"])
    s.update({"instructions": ""})
    assert s.instructions == "" and s.max_tokens == 4096           # what an update leaves out stays
    opts = s.response_options({"metadata": {str(i): "v" for i in range(15)}, "conversation": "auto", "tools": [],
                               "tool_choice": "auto", "max_output_tokens": 4096})
    assert len(opts.metadata) == 15 and opts.max_tokens == 4096 and opts.voice == "verse"
    assert s.response_options({"metadata": None, "max_output_tokens": 2}).metadata == {}


def test_the_session_document_is_openais() -> None:
    s = SessionSettings("omni", speaks=True, rate=16000, instructions="hi", voice="ash", max_tokens=12)
    assert s.doc("sess_9") == {
        "type": "realtime", "object": "realtime.session", "id": "sess_9", "model": "omni",
        "output_modalities": ["audio"], "instructions": "hi", "max_output_tokens": 12, "tools": [], "tool_choice": "auto",
        "audio": {"input": {"format": FORMAT_24K, "transcription": None, "noise_reduction": None,
                            "turn_detection": None},
                  "output": {"format": {"type": "audio/pcm", "rate": 16000}, "voice": "ash"}}}
    doc = s.doc("sess_9")
    doc["output_modalities"].append("text")
    doc["audio"]["input"]["format"]["rate"] = 1
    assert s.modalities == ["audio"] and s.doc("sess_9")["audio"]["input"]["format"]["rate"] == 24000   # copies


TD = "session.audio.input.turn_detection"
TURN_REFUSALS = [
    ("vad", ("invalid_type", f"{TD} must be an object or null", TD)),
    ({"type": "ai_vad"}, ("invalid_value", f"{TD}.type must be \"server_vad\" or \"semantic_vad\"", f"{TD}.type")),
    ({"eagerness": "low"}, ("unknown_parameter", f"{TD}.eagerness is not a server_vad setting", f"{TD}.eagerness")),
    ({"type": "semantic_vad", "threshold": 0.5, "silence_duration_ms": 1},
     ("unknown_parameter", f"{TD}.silence_duration_ms is not a semantic_vad setting", f"{TD}.silence_duration_ms")),
    ({"create_response": 1}, ("invalid_type", f"{TD}.create_response must be true or false", f"{TD}.create_response")),
    ({"interrupt_response": "no"},
     ("invalid_type", f"{TD}.interrupt_response must be true or false", f"{TD}.interrupt_response")),
    ({"type": "semantic_vad", "eagerness": "eager"},
     ("invalid_value", f"{TD}.eagerness must be low, medium, high or auto", f"{TD}.eagerness")),
    *[({"threshold": bad}, ("invalid_value", f"{TD}.threshold must be a number from 0.0 to 1.0", f"{TD}.threshold"))
      for bad in (-0.01, 1.01, True, "0.5")],
    *[({name: bad}, ("invalid_value", f"{TD}.{name} must be an integer from 0 to 10000", f"{TD}.{name}"))
      for name in ("prefix_padding_ms", "silence_duration_ms") for bad in (-1, 10001, 5.0, False)],
    *[({"idle_timeout_ms": bad}, ("invalid_value", f"{TD}.idle_timeout_ms must be an integer from 5000 to 30000, or "
                                  "null", f"{TD}.idle_timeout_ms")) for bad in (4999, 30001, 6000.0, True)],
]


@pytest.mark.parametrize(("raw", "why"), TURN_REFUSALS, ids=lambda v: repr(v)[:40].replace("\\", ""))
def test_turn_detection_refusals_say_code_message_and_param(raw: Any, why: tuple[str, str, str]) -> None:
    e = refused(turn_detection, raw, TD, [])
    assert (e.code, e.message, e.param) == why


def test_turn_detection_takes_every_setting_at_its_bounds() -> None:
    ignored: list[str] = []
    assert turn_detection(None, TD, ignored) is None
    t = turn_detection({}, TD, ignored)
    assert t == TurnDetection() and ignored == []
    for low, high in ((0, 10000), (10000, 0)):
        t = turn_detection({"type": "server_vad", "threshold": low / 10000, "prefix_padding_ms": low,
                            "silence_duration_ms": high, "create_response": False, "interrupt_response": False},
                           TD, ignored)
        assert t == TurnDetection("server_vad", low / 10000, low, high, False, False)
        assert isinstance(t.threshold, float)
    assert turn_detection({"threshold": 1}, TD, ignored).threshold == 1.0 and ignored == []
    for idle in (5000, 30000):
        assert turn_detection({"idle_timeout_ms": idle}, TD, ignored) == TurnDetection()
    assert turn_detection({"idle_timeout_ms": None}, TD, ignored) == TurnDetection()
    assert ignored == [f"{TD}.idle_timeout_ms"] * 2          # taken, left off
    semantic = turn_detection({"type": "semantic_vad", "create_response": False}, TD, ignored)
    assert semantic == TurnDetection("semantic_vad", silence_duration_ms=EAGERNESS_MS["auto"], create_response=False)
    for eagerness, ms in EAGERNESS_MS.items():
        t = turn_detection({"type": "semantic_vad", "eagerness": eagerness, "interrupt_response": False}, TD, [])
        assert (t.eagerness, t.silence_duration_ms, t.interrupt_response) == (eagerness, ms, False)
    assert semantic.doc() == {"type": "semantic_vad", "eagerness": "auto", "create_response": False,
                              "interrupt_response": True, "silence_duration_ms": 800, "threshold": 0.5,
                              "prefix_padding_ms": 300}


def test_session_update_tool_choice_and_optional_features() -> None:
    s = SessionSettings("voice", speaks=True, hears=True)
    for choice in ("auto", "none", "required", {"type": "function", "name": "f"}):
        assert s.update({"tool_choice": choice}) == []
    e = refused(s.update, {"tool_choice": "always"})
    assert (e.code, e.message, e.param) == ("invalid_value", "session.tool_choice must be auto, none, required or a tool",
                                            "session.tool_choice")
    # Off, empty or "auto": nothing asked for, nothing left off; anything else is named.
    assert s.update({"tools": [], "tracing": None, "parallel_tool_calls": False, "truncation": "auto"}) == []
    assert s.update({"tracing": "auto", "parallel_tool_calls": True}) == ["session.parallel_tool_calls"]
    e = refused(s.update, {"audio": {"input": {"noise_reduction": "near"}}})
    assert (e.code, e.message, e.param) == ("invalid_type", "session.audio.input.noise_reduction must be an object or "
                                            "null", "session.audio.input.noise_reduction")
    # An update that does not name turn detection keeps the session's.
    s.update({"audio": {"input": {"turn_detection": {"threshold": 0.9}}}})
    s.update({"instructions": "x", "audio": {"output": {"voice": "ash"}}})
    assert s.turn is not None and s.turn.threshold == 0.9 and s.voice == "ash"
    # The output side names the voice.
    s.update({"audio": {"output": {"voice": "coral"}, "input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
    assert s.voice == "coral"


def test_a_responses_tool_choice_and_audio() -> None:
    s = SessionSettings("omni", speaks=True, voice="ash")
    assert s.response_options({"tool_choice": "none"}).voice == "ash"
    e = refused(s.response_options, {"audio": {"input": {}}})
    assert (e.code, e.param) == ("invalid_value", "response.audio.input")
    e = refused(s.response_options, {"audio": {"output": {"transcription": {}}}})
    assert e.param == "response.audio.output.transcription"
