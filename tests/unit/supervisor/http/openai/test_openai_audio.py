"""A chat that asks for speech, in process (`ChatCompletionRequest.audio_format`, openai/chat.py):
`modalities` and `audio` checked as OpenAI does, the format asked given back."""

from __future__ import annotations

from typing import Any

import pytest

from omnid.supervisor.http.openai.chat import ChatCompletionRequest
from omnid.supervisor.http.openai.common import OpenAiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def audio_request(body: dict[str, Any]) -> str | None:
    return ChatCompletionRequest.parse({**CHAT, **body}).audio_format()


def refused(body: dict[str, Any]) -> OpenAiError:
    with pytest.raises(OpenAiError) as e:
        audio_request(body)
    assert e.value.status == 400
    return e.value


def test_the_audio_a_chat_asks_for() -> None:
    assert audio_request({}) is None
    assert audio_request({"modalities": ["text"]}) is None
    assert audio_request({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}) == "wav"
    assert audio_request({"modalities": ["audio"], "audio": {"voice": {"id": "v"}, "format": "pcm16"}}) == "pcm16"


def test_what_a_chat_may_not_ask() -> None:
    assert refused({"modalities": "audio"}).param == "modalities"
    assert refused({"modalities": ["text", "video"]}).param == "modalities"
    assert refused({"audio": {"voice": "alloy", "format": "wav"}}).param == "audio"        # without the modality
    assert refused({"modalities": ["audio"]}).param == "audio"                             # without `audio`
    assert refused({"modalities": ["audio"], "audio": {"format": "wav"}}).param == "audio"  # without a voice
    e = refused({"modalities": ["audio"], "audio": {"voice": "alloy", "format": "mp3"}})
    assert e.param == "audio.format" and "mp3, opus, flac and aac are not supported), not 'mp3'" in e.message
