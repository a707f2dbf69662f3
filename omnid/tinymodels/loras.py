"""LoRA adapters of the tiny models, built after the models they adapt: PEFT adapters of the tiny
Llama (``ROOT/llm-loras/NAME``) and diffusers LoRA files of the tiny SD's UNet
(``ROOT/sd-loras/NAME``), their matrices random so that an adapter visibly changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnid.tinymodels.build import SEED, build_atomically, offline_env

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
    offline_env()
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

    return build_atomically(model_dir, "llm-loras", fill)


def build_sd_loras(model_dir: Path) -> Path:
    """LoRA adapters of the tiny SD's UNet (its attention projections), one folder per adapter of
    SD_LORAS, written by diffusers' `save_lora_weights` (pytorch_lora_weights.safetensors)."""
    offline_env()
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

    return build_atomically(model_dir, "sd-loras", fill)
