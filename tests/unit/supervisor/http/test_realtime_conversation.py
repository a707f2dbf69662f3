"""A realtime conversation's items as a client adds them, in process
(`omnid.supervisor.http.realtime_conversation`): `conversation.item.create` checked, the input audio
buffer (its limit, its commit as a WAV item), an assistant's speech truncated to what was played.
(The conversation as a prompt: test_realtime_session.py.)"""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path
from typing import Any

import pytest

from omnid.config import DaemonConfig, Config, PipelineConfig, StageConfig
from omnid.media import MediaLimits
from omnid.supervisor.http.realtime_conversation import INPUT_RATE, MAX_ITEMS, Conversation, Item
from omnid.supervisor.http.realtime_events import EventError

D = Path("/nonexistent")


def conversation(media: MediaLimits | None = None) -> Conversation:
    cfg = Config(None, DaemonConfig(socket=D, state_dir=D, lock_dir=D),
                 {"gen": StageConfig("gen", "vllm", model=D)}, {"chat": PipelineConfig("chat", ("gen",), ())})
    return Conversation(cfg, cfg.pipelines["chat"], media)


def refused(call: Any, *args: Any) -> EventError:
    with pytest.raises(EventError) as e:
        call(*args)
    return e.value


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_items_are_added_at_the_end() -> None:
    c = conversation()
    item = c.new_item({"item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hello"}, {"type": "input_text", "text": "there"}]}})
    assert (item.role, item.text, item.audio) == ("user", "hello\nthere", None)
    assert c.append(item) is None and c.last_id == item.id
    spoken = c.new_item({"previous_item_id": item.id, "item": {"id": "mine", "role": "assistant", "content": [
        {"type": "output_audio", "transcript": "hi"}]}})
    assert (spoken.id, spoken.text) == ("mine", "hi")
    assert c.append(spoken) == item.id and c.find("mine") is spoken
    assert refused(c.find, "nope").code == "item_not_found"
    for _ in range(MAX_ITEMS):
        c.append(Item("x", "user"))
    assert len(c.items) == MAX_ITEMS and c.items[0].id == "x"      # the oldest went


def test_what_an_item_may_not_be() -> None:
    c = conversation()
    c.append(Item("first", "user", "hi"))
    cases = [({"item": "text"}, "item"), ({"item": {"type": "function_call"}}, "item.type"),
             ({"item": {"role": "tool"}}, "item.role"),
             ({"previous_item_id": "elsewhere", "item": {"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "x"}]}},
              "previous_item_id"),
             ({"item": {"role": "user", "content": []}}, "item.content"),
             ({"item": {"role": "system", "content": [{"type": "input_audio", "audio": b64(b"\0\0")}]}},
              "item.content[0]"),
             ({"item": {"id": "first", "role": "user", "content": [{"type": "input_text", "text": "x"}]}},
              "item.id")]
    for ev, param in cases:
        assert refused(c.new_item, ev).param == param, ev
    e = refused(c.new_item, {"item": {"role": "user", "content": [{"type": "input_audio", "audio": b64(b"\0\0")}]}})
    assert (e.code, e.param) == ("audio_not_accepted", "item.content[0]")     # the model takes no audio


def test_the_input_audio_buffer() -> None:
    c = conversation(MediaLimits(audio=1, max_audio_s=1.0))
    assert refused(c.commit).code == "input_audio_buffer_commit_empty"
    assert refused(c.buffer_append, b64(b"\0\0\0")).message == "PCM16 audio is an even number of bytes"
    assert refused(c.buffer_append, "not base64!").message == "audio is not valid base64"
    c.buffer_append(b64(b"\1\0" * (INPUT_RATE // 2)))
    assert refused(c.buffer_append, b64(b"\1\0" * (INPUT_RATE // 2 + 1))).code == "input_audio_buffer_too_large"
    item = c.commit()
    assert (item.role, item.audio_ms, c.buffer) == ("user", 500, bytearray())
    assert item.audio is not None
    with wave.open(io.BytesIO(item.audio)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (INPUT_RATE, 1, INPUT_RATE // 2)


def test_an_assistants_speech_is_cut_to_what_was_played() -> None:
    c = conversation()
    said = Item("a1", "assistant", "one two three four", audio_ms=1000, spoken=True, tokens=4)
    c.append(said)
    c.append(Item("u1", "user", "stop"))
    assert refused(c.truncation, {"item_id": "u1", "audio_end_ms": 0}).message == \
        "only an assistant's audio can be truncated"
    assert refused(c.truncation, {"item_id": "a1", "audio_end_ms": 1001}).param == "audio_end_ms"
    assert refused(c.truncation, {"item_id": "a1", "audio_end_ms": 5, "content_index": 1}).param == "content_index"
    item, end = c.truncation({"item_id": "a1", "audio_end_ms": 500})
    c.truncate(item, end)
    assert (said.text, said.tokens, said.audio_ms, said.status) == ("one two", None, 500, "incomplete")
