"""The tiny diffusers pipelines: Stable Diffusion (``ROOT/sd``: UNet, VAE, CLIP text encoder, DDIM)
and a DiT (``ROOT/dit``: a Flux pipeline), both on a tiny CLIP tokenizer whose vocabulary is
written here.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from omnid.tinymodels.build import SEED, build_atomically, offline_env, seed_all

SD_SAMPLE_SIZE = 32  # latent side; the VAE doubles it, so images are 64 px
SD_MAX_LENGTH = 77
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"

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
    offline_env()

    def fill(out: Path) -> None:
        from diffusers import (
            AutoencoderKL,
            DDIMScheduler,
            StableDiffusionPipeline,
            UNet2DConditionModel,
        )
        from transformers import CLIPTextConfig, CLIPTextModel

        tokenizer = _clip_tokenizer()
        seed_all(SEED)
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
        seed_all(SEED + 1)
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
        seed_all(SEED + 2)
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

    return build_atomically(model_dir, "sd", fill)


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
    offline_env()

    def fill(out: Path) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        tokenizer = _clip_tokenizer()
        seed_all(SEED + 10)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, projection_dim=32,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=SD_MAX_LENGTH,
                layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        seed_all(SEED + 11)
        text_encoder_2 = T5EncoderModel(
            T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                     eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
        )
        seed_all(SEED + 12)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=DIT_LATENT_CHANNELS * 4, num_layers=DIT_DOUBLE_LAYERS,
            num_single_layers=DIT_SINGLE_LAYERS, attention_head_dim=DIT_HEAD_DIM,
            num_attention_heads=DIT_HEADS, joint_attention_dim=32, pooled_projection_dim=32,
            guidance_embeds=False, axes_dims_rope=(4, 6, 6),
        )
        seed_all(SEED + 13)
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

    return build_atomically(model_dir, "dit", fill)
