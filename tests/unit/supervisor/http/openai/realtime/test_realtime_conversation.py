"""A realtime conversation's items as a client adds them, in process
(`omnid.supervisor.http.openai.realtime.conversation`): `conversation.item.create` checked, the input audio
buffer (its limit, its commit as a WAV item), an assistant's speech truncated to what was played.
(The conversation as a prompt: test_realtime_session.py.)"""

from __future__ import annotations

import base64
import io
import wave
from pathlib import Path
from typing import Any

import pytest

from omnid.config import Config, DaemonConfig, PipelineConfig, StageConfig
from omnid.media import MediaLimits
from omnid.supervisor.http.openai.realtime.conversation import INPUT_RATE, MAX_ITEMS, Conversation, Item
from omnid.supervisor.http.openai.realtime.events import EventError

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


def _text(t: Any) -> dict[str, Any]:
    return {"type": "input_text", "text": t}


def _user(*parts: Any, **item: Any) -> dict[str, Any]:
    return {"item": {"role": "user", "content": list(parts), **item}}


USER_PARTS = "input_text (text) or input_audio (base64 PCM16, 24 kHz mono)"
ITEM_ID = "item.id must be a new string of up to 64 characters"
ITEM_REFUSED = [
    ({"item": "text"}, "invalid_value", 'conversation.item.create needs "item": an object', "item"),
    ({"item": {"type": "function_call"}}, "unsupported", "item.type 'function_call' is not supported: messages only",
     "item.type"),
    ({"item": {"role": "tool"}}, "invalid_value", "item.role must be user, assistant or system", "item.role"),
    ({"item": {}}, "invalid_value", "item.role must be user, assistant or system", "item.role"),
    ({"previous_item_id": "elsewhere", **_user(_text("x"))}, "unsupported",
     "items are added at the end of the conversation only", "previous_item_id"),
    (_user(), "invalid_value", "item.content must be a non-empty array of content parts", "item.content"),
    ({"item": {"role": "user", "content": "x"}}, "invalid_value",
     "item.content must be a non-empty array of content parts", "item.content"),
    ({"item": {"role": "system", "content": [{"type": "input_audio", "audio": b64(b"\0\0")}]}}, "invalid_value",
     "item.content[0]: a system message's parts are input_text (text)", "item.content[0]"),
    (_user({"type": "input_audio", "audio": b64(b"\0\0")}, {"type": "input_audio", "audio": b64(b"\0\0")}),
     "invalid_value", "one input_audio part per item", "item.content[1]"),
    (_user({"type": "input_audio", "audio": b64(b"\0\0\0")}), "invalid_value", "PCM16 audio is an even number of bytes",
     "item.content[0]"),
    (_user({"type": "input_audio", "audio": "!!"}), "invalid_value", "item.content[0] is not valid base64",
     "item.content[0]"),
    (_user(_text("x"), {"type": "input_audio", "audio": 3}), "invalid_value",
     f"item.content[1]: a user message's parts are {USER_PARTS}", "item.content[1]"),
    (_user({"type": "output_audio", "transcript": "x"}), "invalid_value",
     f"item.content[0]: a user message's parts are {USER_PARTS}", "item.content[0]"),
    (_user("x"), "invalid_value", f"item.content[0]: a user message's parts are {USER_PARTS}", "item.content[0]"),
    ({"item": {"role": "assistant", "content": [_text(3)]}}, "invalid_value",
     "item.content[0]: a assistant message's parts are input_text (text)", "item.content[0]"),
    (_user(_text("x"), id="first"), "invalid_value", ITEM_ID, "item.id"),
    (_user(_text("x"), id=""), "invalid_value", ITEM_ID, "item.id"),
    (_user(_text("x"), id="x" * 65), "invalid_value", ITEM_ID, "item.id"),
    (_user(_text("x"), id=5), "invalid_value", ITEM_ID, "item.id"),
]


@pytest.mark.parametrize("ev, code, message, param", ITEM_REFUSED)
def test_each_refused_item_says_what_and_where(ev: dict[str, Any], code: str, message: str, param: str) -> None:
    c = conversation(MediaLimits(audio=1, max_audio_s=1.0))
    c.append(Item("first", "user", "hi"))
    e = refused(c.new_item, ev)
    assert (e.code, e.message, e.param) == (code, message, param)


def test_an_items_parts_and_its_place() -> None:
    c = conversation(MediaLimits(audio=1, max_audio_s=1.0))
    first = c.new_item({"previous_item_id": "root", "item": {"type": "message", "role": "system",
                                                             "content": [{"type": "text", "text": "be brief"}]}})
    assert (first.role, first.text, first.audio, first.audio_ms, first.spoken, first.id[:5]) == \
        ("system", "be brief", None, 0, False, "item_")
    c.append(first)
    spoken = c.new_item({"previous_item_id": first.id, "item": {"id": "x" * 64, "role": "assistant", "content": [
        {"type": "output_text", "text": "one"}, {"type": "output_audio", "transcript": "two"}]}})
    assert (spoken.id, spoken.text, spoken.spoken) == ("x" * 64, "one\ntwo", False)
    heard = c.new_item(_user({"type": "input_audio", "audio": b64(b"\1\0" * 4800)}, _text("and this")))
    assert (heard.text, heard.audio_ms) == ("and this", 200) and heard.audio is not None
    with wave.open(io.BytesIO(heard.audio)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.readframes(2)) == (INPUT_RATE, 1, 2, b"\1\0\1\0")
    assert c.new_item(_user(_text(""))).text == ""


def test_what_a_truncation_may_not_be() -> None:
    c = conversation()
    c.append(Item("u1", "user", "hi"))
    c.append(Item("a0", "assistant", "written"))
    c.append(Item("a1", "assistant", "x", audio_ms=100, spoken=True))
    length = "audio_end_ms must be from 0 to 100 (the audio's length)"
    for ev, code, message, param in [
            ({"item_id": "nope"}, "item_not_found", "no item 'nope' in this conversation", "item_id"),
            ({"item_id": "u1", "audio_end_ms": 0}, "invalid_value", "only an assistant's audio can be truncated", "item_id"),
            ({"item_id": "a0", "audio_end_ms": 0}, "invalid_value", "only an assistant's audio can be truncated", "item_id"),
            ({"item_id": "a1", "audio_end_ms": 1, "content_index": 1}, "invalid_value", "content_index must be 0",
             "content_index"),
            ({"item_id": "a1", "audio_end_ms": True}, "invalid_value", length, "audio_end_ms"),
            ({"item_id": "a1", "audio_end_ms": -1}, "invalid_value", length, "audio_end_ms"),
            ({"item_id": "a1", "audio_end_ms": "5"}, "invalid_value", length, "audio_end_ms"),
            ({"item_id": "a1", "audio_end_ms": 101}, "invalid_value", length, "audio_end_ms")]:
        e = refused(c.truncation, ev)
        assert (e.code, e.message, e.param) == (code, message, param), ev
    assert c.truncation({"item_id": "a1", "audio_end_ms": 0, "content_index": 0})[1] == 0
    assert c.truncation({"item_id": "a1", "audio_end_ms": 100})[1] == 100
    silent = Item("a2", "assistant", "a b", audio_ms=0, spoken=True)
    c.truncate(silent, 0)
    assert (silent.text, silent.status) == ("", "incomplete")


def test_what_the_input_audio_buffer_refuses() -> None:
    c = conversation(MediaLimits(audio=1, max_audio_s=1.0))
    for call, code, message, param in [
            (lambda: c.buffer_append(3), "invalid_value", "audio must be base64 text", "audio"),
            (lambda: c.buffer_append(b64(b"\0\0" * (INPUT_RATE + 1))), "input_audio_buffer_too_large",
             "the input audio buffer would hold more than 1 s (the stage's media.max_audio_s); commit or clear it",
             "audio"),
            (lambda: conversation().buffer_append(b64(b"\0\0")), "audio_not_accepted",
             "model 'chat' takes no audio (its first stage's model takes none)", "audio"),
            (lambda: conversation(MediaLimits(audio=0)).buffer_append(b64(b"\0\0")), "audio_not_accepted",
             "model 'chat' takes no audio (its first stage's model takes none)", "audio"),
            (c.commit, "input_audio_buffer_commit_empty", "the input audio buffer is empty: append audio first", None)]:
        e = refused(call)
        assert (e.code, e.message, e.param) == (code, message, param)
    c.buffer_append(b64(b"\0\0" * INPUT_RATE))                  # exactly the limit
    assert len(c.buffer) == 2 * INPUT_RATE and c.commit().audio_ms == 1000


def test_items_as_openai_writes_them() -> None:
    head = {"object": "realtime.item", "type": "message"}
    assert Item("i1", "user", "hi").doc() == {"id": "i1", **head, "status": "completed", "role": "user",
                                              "content": [{"type": "input_text", "text": "hi"}]}
    assert Item("i2", "user", "", audio=b"x").doc()["content"] == [{"type": "input_audio"}]
    assert Item("i3", "user", "t", audio=b"x").doc()["content"] == [{"type": "input_audio"},
                                                                     {"type": "input_text", "text": "t"}]
    assert Item("i4", "assistant", "yo", spoken=True, status="incomplete").doc() == {
        "id": "i4", **head, "status": "incomplete", "role": "assistant",
        "content": [{"type": "output_audio", "transcript": "yo"}]}
    assert Item("i5", "assistant", "yo").doc()["content"] == [{"type": "output_text", "text": "yo"}]
    assert Item("i6", "system", "be").doc()["content"] == [{"type": "input_text", "text": "be"}]


def test_a_huge_wrong_value_is_cut_in_the_error() -> None:
    """A client's wrong value is shown cut, never echoed whole (an event may hold megabytes)."""
    c = conversation()
    for e in (refused(c.find, "x" * 1_000_000), refused(c.new_item, {"item": {"type": "y" * 1_000_000}})):
        assert len(e.message) < 200 and "characters)" in e.message, e.message[:300]
