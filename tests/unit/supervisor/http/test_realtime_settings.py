"""A realtime session's settings, in process (`omnid.supervisor.http.realtime_settings`):
`session.update` checked whole before any of it applies, a response's options filled from the
session's, and the session as OpenAI's RealtimeSession writes it."""

from __future__ import annotations

from typing import Any

import pytest

from omnid.supervisor.http.realtime_events import EventError
from omnid.supervisor.http.realtime_settings import SessionSettings


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
             ({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}, "session.audio.input.turn_detection"),
             ({"max_output_tokens": 0}, "session.max_output_tokens"), ({"tools": [{}]}, "session.tools"),
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
