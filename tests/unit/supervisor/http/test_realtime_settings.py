"""A realtime session's settings, in process (`omnid.supervisor.http.realtime_settings`):
`session.update` checked whole before any of it applies, a response's options filled from the
session's, and the session as OpenAI's RealtimeSession writes it."""

from __future__ import annotations

from typing import Any

import pytest

from omnid.supervisor.http.realtime_events import EventError
from omnid.supervisor.http.realtime_settings import EAGERNESS_MS, SessionSettings


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
