"""A job's inputs as the prompt a `vllm` stage gives vLLM (omnid/engines/vllm_engine.py, `add`): a
chat (`messages`) rendered with the tokenizer's chat template, the job's `prompt_token_ids` or
`prompt_embeds`, or its media (`image`, `audio`, `video`) decoded and placed in a chat that the
model's processor renders with its own template (a `{"type": "image"}` part per item, where the
template writes the model's placeholder, which vLLM's processing expands into the item's tokens).

Runs in a stage worker's main thread, where vLLM is; each function raises what names the job's bad
input (`MediaError`, `TensorInputError`, `ValueError`), which fails that job alone. transformers
is imported where the processor is loaded, once, at the engine's load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from omnid import media as M
from omnid.config_types import StageConfig
from omnid.engines.vllm_tensors import TensorInputError, prompt_embeds, prompt_token_ids

DEFAULT_AUDIO_RATE = 16000      # when the processor does not say (Whisper-style encoders take 16 kHz)


def chat_prompt(tokenizer: Any, model: object, messages: Any) -> dict[str, Any]:
    """`messages` (a list of {"role", "content"}, or that list as JSON text) rendered with the
    tokenizer's chat template, as token ids (the template writes its own special tokens)."""
    if isinstance(messages, str):
        messages = json.loads(messages)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("\"messages\" must be a list of {\"role\", \"content\"} objects")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template: send a \"prompt\"")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {"prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}


def tensor_prompt(inputs: Mapping[str, Any], stage: StageConfig, engine: Any, hidden: int,
                  max_len: int) -> dict[str, Any] | None:
    """The job's prompt_embeds or prompt_token_ids as vLLM takes them, or None if it gives neither;
    TensorInputError says what is wrong with one. `engine`: vLLM's (its model's dtype and vocabulary)."""
    if inputs.get("prompt_embeds") is not None:
        if not stage.takes_embeds:
            raise TensorInputError(f"stage {stage.name!r} takes no prompt_embeds: set prompt_embeds = "
                                   "true in its config (vLLM's enable_prompt_embeds)")
        return {"prompt_embeds": prompt_embeds(inputs["prompt_embeds"], hidden, max_len,
                                               engine.model_config.dtype)}
    if inputs.get("prompt_token_ids") is not None:
        vocab = int(engine.model_config.get_vocab_size())
        return {"prompt_token_ids": prompt_token_ids(inputs["prompt_token_ids"], vocab, max_len)}
    return None


def load_processor(stage: StageConfig) -> tuple[Any, int | None]:
    """The model's processor (its chat template writes the media placeholders), and the audio
    rate its feature extractor wants (None when it does not say)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(stage.model),
                                              trust_remote_code=bool(stage.args.get("trust_remote_code")))
    template = getattr(processor, "chat_template", None) or \
        getattr(getattr(processor, "tokenizer", None), "chat_template", None)
    if not template:
        raise RuntimeError(f"stage {stage.name!r} takes {', '.join(stage.media.kinds)} inputs, but the "
                           f"processor of {stage.model} has no chat template to place them with")
    rate = getattr(getattr(processor, "feature_extractor", None), "sampling_rate", None)
    return processor, rate if isinstance(rate, int) and rate > 0 else None


def media_inputs(inputs: Mapping[str, Any], stage: StageConfig, audio_rate: int) -> dict[str, list[Any]]:
    """The job's media inputs, decoded as vLLM takes them, by kind; MediaError names the input.

    The door checked a job's own files already; this is the check of what arrives through an
    edge (an upstream stage's image, say), and the decoding of everything.
    """
    media = stage.media
    found: dict[str, list[Any]] = {}
    for kind in M.MEDIA_KINDS:
        if inputs.get(kind) is None:
            continue
        items = M.as_items(kind, inputs[kind])
        allowed = media.count(kind)
        if not allowed:
            takes = ", ".join(media.kinds) or "none"
            raise M.MediaError(f"input {kind!r}: stage {stage.name!r} takes no {kind} input "
                               f"(the media its model takes: {takes})")
        if len(items) > allowed:
            raise M.MediaError(f"input {kind!r}: {len(items)} items, but stage {stage.name!r} takes at "
                               f"most {allowed} per job (media.{kind})")
        decoded = []
        for index, item in enumerate(items):
            try:
                decoded.append(_decode(kind, item, media, audio_rate))
            except M.MediaError as e:
                where = f" (item {index + 1} of {len(items)})" if len(items) > 1 else ""
                raise M.MediaError(f"input {kind!r}{where}: {e}") from None
        if decoded:
            found[kind] = decoded
    return found


def _decode(kind: str, item: Any, media: Any, audio_rate: int) -> Any:
    if kind == "image":
        return M.load_image(item, media)
    if kind == "audio":
        return (M.load_audio(item, media, audio_rate), audio_rate)
    return M.load_video(item, media)


def media_chat(processor: Any, stage: str, messages: Any, text: str, media: dict[str, list[Any]]) -> dict[str, Any]:
    """A prompt with its media, before vLLM renders it: the chat (one user message of the media and
    `text`, or the job's `messages`) rendered by the model's processor's chat template, and the
    decoded items."""
    if processor is None:
        raise M.MediaError(f"stage {stage!r} takes no media inputs")
    if isinstance(messages, str):
        messages = json.loads(messages)
    if messages is not None and (not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages)):
        raise ValueError("\"messages\" must be a list of {\"role\", \"content\"} objects")
    counts = {kind: len(items) for kind, items in media.items()}
    chat = M.chat_for_media(messages, text, counts)
    rendered = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if isinstance(rendered, list):      # (some processors answer a batch of one)
        rendered = rendered[0]
    prompt: dict[str, Any] = {"prompt": rendered}
    if media:
        prompt["multi_modal_data"] = media
    return prompt
