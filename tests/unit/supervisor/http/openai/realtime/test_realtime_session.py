"""A realtime session's pure parts, in-process (no daemon, no socket): the conversation's prompt
bounded by the model's context (the oldest turns dropped, the tiny Llama's own tokenizer counting),
audio kept in the newest turns only, the items and refusals as OpenAI's schemas write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, MODELS, build_tiny_models

from omnid import config as C
from omnid.media import MediaLimits
from omnid.supervisor.http.openai.realtime import conversation as R
from omnid.supervisor.http.openai.realtime import events as E

pytestmark = pytest.mark.vllm              # (the tiny models are built by the vLLM tests' setup)
pytest.importorskip("tokenizers")


def session(tmp: Path, max_model_len: int) -> Any:
    """A session's conversation with only what `prompt` reads: the config, the pipeline, no media limits."""
    build_tiny_models("llm")
    stage: dict[str, Any] = {"engine": "vllm", "model": str(MODELS / "llm"), "args": {"max_model_len": max_model_len}}
    cfg = C.parse({"daemon": {"socket": str(tmp / "s.sock"), "state_dir": str(tmp / "st")},
                   "stages": {"gen": stage}, "pipelines": {"chat": {"stages": ["gen"]}}}, base=tmp)
    return R.Conversation(cfg, cfg.pipelines["chat"], None)


def turns(n: int, words: int = 20) -> list[R.Item]:
    return [R.Item(f"item_{i}", "user" if i % 2 == 0 else "assistant",
                   " ".join(f"w{i}x{k}" for k in range(words))) for i in range(n)]


def test_the_prompt_is_the_conversation_in_order_when_it_fits(tmp_path: Path) -> None:
    s = session(tmp_path, 4096)
    s.items = turns(4)
    messages, parts, dropped = s.prompt("Be brief.", reserve=16)
    assert dropped == 0 and not parts
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[1:]] == [i.text for i in s.items]


def test_the_oldest_turns_are_dropped_to_fit_the_context_less_the_answer(tmp_path: Path) -> None:
    s = session(tmp_path, 512)
    s.items = turns(30, words=5)                # ~30 tokens each: far over 512
    messages, _, dropped = s.prompt("", reserve=64)
    assert 0 < len(messages) < 30 and dropped == 30 - len(messages)
    assert [m["content"] for m in messages] == [i.text for i in s.items[dropped:]]   # the newest, in order
    used = sum((i.tokens or 0) + R.TOKENS_PER_MESSAGE for i in s.items[dropped:])
    assert used <= 512 - 64 < used + s.items[dropped - 1].tokens + R.TOKENS_PER_MESSAGE   # as many as fit
    # a bigger answer leaves room for fewer turns
    assert len(s.prompt("", reserve=320)[0]) < len(messages)
    # the newest turn alone is kept even if it cannot fit (admission then says prompt_too_long)
    s.items = turns(1, words=400)
    assert len(s.prompt("", reserve=64)[0]) == 1


def test_audio_stays_in_the_newest_turns_only(tmp_path: Path) -> None:
    s = session(tmp_path, 4096)
    s.media = MediaLimits(audio=1)              # one clip a job, as the tiny Qwen2-Audio's stage takes
    wav = R.wav(b"\0\0" * 2400)
    s.items = [R.Item("a", "user", audio=wav, audio_ms=100), R.Item("b", "assistant", "heard it"),
               R.Item("c", "user", "and this?", audio=wav, audio_ms=100)]
    messages, parts, dropped = s.prompt("", reserve=16)
    assert dropped == 1                        # the first turn was audio alone: it goes
    assert messages == [{"role": "assistant", "content": "heard it"},
                        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "and this?"}]}]
    assert parts == [("audio", wav, "item c")]


def _validator(name: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    doc = json.loads((FIXTURES / "openai_realtime_schemas.json").read_text())
    return jsonschema.Draft202012Validator({"components": doc["components"], "$ref": f"#/components/schemas/{name}"})


def test_items_and_errors_are_openais_shapes() -> None:
    item = _validator("RealtimeConversationItem")
    for it in (R.Item("i1", "user", "hi"), R.Item("i2", "assistant", "yes", spoken=True),
               R.Item("i3", "assistant", "text only"), R.Item("i4", "system", "be brief"),
               R.Item("i5", "user", "", audio=R.wav(b"\0\0"), audio_ms=0)):
        assert not list(item.iter_errors(it.doc())), it.doc()
    error = _validator("RealtimeServerEventError")
    assert not list(error.iter_errors(E.error("invalid_value", "bad", "session.x", "evt_1")))
    assert len(E.reason("x" * 500)) <= 123 and len(E.reason("é" * 100)) <= 123
    E.reason("é" * 100).decode("utf-8")                     # cut at a character
