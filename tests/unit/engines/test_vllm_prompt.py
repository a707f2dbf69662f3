"""A job's inputs as a vllm stage's prompt (omnid/engines/vllm_prompt.py), without vLLM: a chat
rendered by a stand-in tokenizer, prompt tensors checked against a stand-in engine's model, media
checked against the stage's `[media]` and decoded (a real PNG through PIL), and the chat a
stand-in processor renders for them.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omnid import media as M
from omnid.config_types import StageConfig
from omnid.engines.vllm_prompt import chat_prompt, media_chat, media_inputs, tensor_prompt
from omnid.engines.vllm_tensors import TensorInputError


def stage(**more: Any) -> StageConfig:
    return StageConfig(name="gen", engine="vllm", model=Path("/nonexistent"), **more)


class Tokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tokenize: bool) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + ("|assistant:" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [len(word) for word in text.split("|")]


def test_a_chat_is_rendered_with_the_template_as_token_ids() -> None:
    got = chat_prompt(Tokenizer(), "m", '[{"role": "user", "content": "hello"}]')
    assert got == {"prompt_token_ids": [len("user:hello"), len("assistant:")]}
    with pytest.raises(ValueError, match="must be a list"):
        chat_prompt(Tokenizer(), "m", {"role": "user"})
    bare = Tokenizer()
    bare.chat_template = ""
    with pytest.raises(ValueError, match="the tokenizer of m has no chat template"):
        chat_prompt(bare, "m", [{"role": "user", "content": "hi"}])


ENGINE = SimpleNamespace(model_config=SimpleNamespace(dtype="float32", get_vocab_size=lambda: 100))


def test_prompt_tensors_are_checked_against_the_model() -> None:
    assert tensor_prompt({"prompt": "x"}, stage(), ENGINE, 8, 16) is None
    assert tensor_prompt({"prompt_token_ids": [1, 2, 3]}, stage(), ENGINE, 8, 16) == {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(TensorInputError):
        tensor_prompt({"prompt_token_ids": [1, 200]}, stage(), ENGINE, 8, 16)     # past the vocabulary
    with pytest.raises(TensorInputError, match="stage 'gen' takes no prompt_embeds"):
        tensor_prompt({"prompt_embeds": [[0.0] * 8]}, stage(), ENGINE, 8, 16)


def png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 3), (255, 0, 0)).save(out, format="PNG")
    return out.getvalue()


def test_media_are_checked_against_the_stage_and_decoded() -> None:
    two_images = stage(media=M.MediaLimits(image=2))
    assert media_inputs({"prompt": "x"}, two_images, 16000) == {}
    got = media_inputs({"image": [png(), png()]}, two_images, 16000)
    assert [im.size for im in got["image"]] == [(4, 3), (4, 3)]
    with pytest.raises(M.MediaError, match=r"input 'image': 3 items, but stage 'gen' takes at most 2 per job"):
        media_inputs({"image": [png()] * 3}, two_images, 16000)
    with pytest.raises(M.MediaError, match=r"input 'audio': stage 'gen' takes no audio input \(the media its "
                                           r"model takes: image\)"):
        media_inputs({"audio": b"RIFF"}, two_images, 16000)
    with pytest.raises(M.MediaError, match=r"input 'image' \(item 2 of 2\): "):
        media_inputs({"image": [png(), b"not an image"]}, two_images, 16000)


class Processor:
    def apply_chat_template(self, chat: list[dict[str, Any]], add_generation_prompt: bool, tokenize: bool) -> list[str]:
        return [repr(chat)]             # (a batch of one, as some processors answer)


def test_media_go_in_a_chat_the_processor_renders() -> None:
    media = {"image": ["<image>"]}
    got = media_chat(Processor(), "gen", None, "what is it?", media)
    assert got["multi_modal_data"] is media
    assert got["prompt"] == repr(M.chat_for_media(None, "what is it?", {"image": 1}))
    with pytest.raises(M.MediaError, match="stage 'gen' takes no media inputs"):
        media_chat(None, "gen", None, "x", media)
    with pytest.raises(ValueError, match="must be a list"):
        media_chat(Processor(), "gen", '{"role": "user"}', "x", media)
