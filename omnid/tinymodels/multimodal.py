"""The tiny multimodal LMs: LLaVA (``ROOT/vlm``: a CLIP vision tower and the tiny Llama) and
Qwen2-Audio (``ROOT/alm``: a Whisper-style encoder and a tiny Qwen2), with their processors, saved
as vLLM loads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnid.tinymodels.build import SEED, build_atomically, offline_env, seed_all
from omnid.tinymodels.text import (
    LLM_DTYPE,
    LLM_HEAD_DIM,
    LLM_HEADS,
    LLM_HIDDEN,
    LLM_INTERMEDIATE,
    LLM_LAYERS,
    LLM_MAX_POSITIONS,
    nudge_llm_weights,
    train_llm_tokenizer,
    wordlike_token_ids,
)

VLM_IMAGE_SIZE = 64         # px; the CLIP tower sees 64x64 images ...
VLM_PATCH = 16              # ... in 16 px patches: 16 image tokens per image
VLM_MAX_POSITIONS = 512
ALM_MAX_POSITIONS = 2048    # a 30 s clip alone is 750 tokens
ALM_SAMPLE_RATE = 16000
# LLaVA's template: like LLM_CHAT_TEMPLATE, with an <image> placeholder per image part (the
# processor expands each into the image's 16 tokens). (The newline is an expression: transformers
# renders templates with trim_blocks, which would eat one written after a block tag.)
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def mm_tokenizer(extra: list[str], max_length: int = LLM_MAX_POSITIONS) -> Any:
    """The tiny LLM's tokenizer plus the placeholder tokens a multimodal model needs, taking up to
    `max_length` tokens, its LM's context (a processor truncates there: vLLM's warm-up feeds the
    longest media a model takes, and its placeholders must all fit)."""
    tokenizer = train_llm_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.model_max_length = max_length
    return tokenizer


def _mm_text_config(cls: Any, tokenizer: Any, **extra: Any) -> Any:
    """The language model's config: the tiny LLM's sizes."""
    return cls(vocab_size=len(tokenizer), hidden_size=LLM_HIDDEN, intermediate_size=LLM_INTERMEDIATE,
               num_hidden_layers=LLM_LAYERS, num_attention_heads=LLM_HEADS, num_key_value_heads=LLM_HEADS,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


def _save_mm(model: Any, tokenizer: Any, processor: Any, out: Path, *,
             rename: tuple[str, str] | None = None, architecture: str | None = None) -> None:
    """Nudge the language model to word-like output, save model and processor; then the fixes
    vLLM needs on what transformers wrote (weight names, the architecture to load)."""
    from types import SimpleNamespace

    import torch

    nudge_llm_weights(SimpleNamespace(model=model.model.language_model, lm_head=model.lm_head),
                       wordlike_token_ids(tokenizer))
    model.to(getattr(torch, LLM_DTYPE)).eval().save_pretrained(out)
    processor.save_pretrained(out)
    if rename is not None:
        from safetensors.torch import load_file, save_file

        weights = out / "model.safetensors"
        save_file({k.replace(*rename, 1): v for k, v in load_file(weights).items()}, weights,
                  metadata={"format": "pt"})
    if architecture is not None:       # (save_pretrained writes the class's own name)
        config = out / "config.json"
        data = json.loads(config.read_text(encoding="utf-8"))
        data["architectures"] = [architecture]
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_vlm(model_dir: Path) -> Path:
    """Build the tiny LLaVA and its processor into `model_dir`; return the folder."""
    offline_env()

    def fill(out: Path) -> None:
        from transformers import (
            CLIPVisionConfig,
            LlamaConfig,
            LlavaConfig,
            LlavaForConditionalGeneration,
            LlavaProcessor,
        )
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        seed_all(SEED)
        tokenizer = mm_tokenizer(["<image>"], VLM_MAX_POSITIONS)
        config = LlavaConfig(
            text_config=_mm_text_config(LlamaConfig, tokenizer, head_dim=LLM_HEAD_DIM,
                                        max_position_embeddings=VLM_MAX_POSITIONS),
            vision_config=CLIPVisionConfig(hidden_size=LLM_HIDDEN, intermediate_size=LLM_INTERMEDIATE,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=VLM_IMAGE_SIZE, patch_size=VLM_PATCH),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            image_seq_length=(VLM_IMAGE_SIZE // VLM_PATCH) ** 2,
            vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
        )
        # The PIL image processor: the default one is torchvision's, not installed on CPU hosts.
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": VLM_IMAGE_SIZE},
                                                crop_size={"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE})
        processor = LlavaProcessor(image_processor, tokenizer, patch_size=VLM_PATCH,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=VLM_CHAT_TEMPLATE)
        seed_all(SEED)
        # vLLM's own LLaVA module imports torchvision: load it through vLLM's Transformers backend.
        _save_mm(LlavaForConditionalGeneration(config), tokenizer, processor, out,
                 architecture="TransformersMultiModalForCausalLM")

    return build_atomically(model_dir, "vlm", fill)


def build_alm(model_dir: Path) -> Path:
    """Build the tiny Qwen2-Audio and its processor into `model_dir`; return the folder."""
    offline_env()

    def fill(out: Path) -> None:
        from transformers import (
            Qwen2AudioConfig,
            Qwen2AudioEncoderConfig,
            Qwen2AudioForConditionalGeneration,
            Qwen2AudioProcessor,
            Qwen2Config,
            WhisperFeatureExtractor,
        )

        seed_all(SEED)
        tokenizer = mm_tokenizer(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"],
                                  ALM_MAX_POSITIONS)
        config = Qwen2AudioConfig(
            text_config=_mm_text_config(Qwen2Config, tokenizer, max_position_embeddings=ALM_MAX_POSITIONS),
            # vLLM's schema wants 3000 mel frames (30 s): max_source_positions 1500, chunk_length 30
            audio_config=Qwen2AudioEncoderConfig(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                                                 encoder_ffn_dim=LLM_INTERMEDIATE, d_model=LLM_HIDDEN,
                                                 max_source_positions=1500),
            audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
        )
        features = WhisperFeatureExtractor(feature_size=128, sampling_rate=ALM_SAMPLE_RATE, hop_length=160,
                                           chunk_length=30)
        seed_all(SEED)
        # transformers saves the LM's weights as language_model.model.model.*; vLLM wants one
        # "model." less.
        _save_mm(Qwen2AudioForConditionalGeneration(config), tokenizer, Qwen2AudioProcessor(features, tokenizer),
                 out, rename=("language_model.model.model.", "language_model.model."))

    return build_atomically(model_dir, "alm", fill)
