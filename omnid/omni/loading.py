"""Load one part of a Qwen2.5-Omni checkpoint (the talker, or token2wav) without the rest.

Runs in a stage worker's main thread, once, while the stage loads; blocks on reading the weights.
A real checkpoint is mostly thinker (7B of its ~10.7B parameters): a talker or code2wav stage
builds only its own module from its sub-config and reads only the tensors under its prefix from
the safetensors files (one file, or shards listed in `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEAKERS_FILE = "spk_dict.pt"


def _weight_files(model_dir: Path) -> dict[str, list[str]]:
    """Each safetensors file of the checkpoint with the tensor names it holds (None: all of them)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text(encoding="utf-8"))["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    if (model_dir / "model.safetensors").is_file():
        return {"model.safetensors": []}
    raise FileNotFoundError(f"{model_dir}: no model.safetensors (or index) to load")


def read_tensors(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The checkpoint's tensors whose names start with one of `prefixes`, by full name."""
    from safetensors import safe_open

    found: dict[str, Any] = {}
    for file, names in _weight_files(model_dir).items():
        if names and not any(n.startswith(prefixes) for n in names):
            continue
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefixes):
                    found[name] = f.get_tensor(name)
    return found


def _load_into(module: Any, tensors: Mapping[str, Any], prefix: str, what: str) -> None:
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    # Buffers that are computed, not saved (rope frequencies), may be missing; weights may not.
    missing = [k for k in missing if not k.endswith(("inv_freq", "original_inv_freq"))]
    if missing or unexpected:
        raise ValueError(f"{what}: the checkpoint does not fit its config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def speakers(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's speakers (`spk_dict.pt`): name -> {bos_token, cond, ref_mel}."""
    import torch

    path = model_dir / SPEAKERS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no {SPEAKERS_FILE} (the speakers a Qwen2.5-Omni checkpoint ships)")
    return dict(torch.load(path, weights_only=True))


def load_config(model_dir: Path) -> Any:
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(str(model_dir))


def load_talker(model_dir: Path, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any]:
    """(talker, the thinker's input embedding table): all a talker stage needs of the model."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniTalkerForConditionalGeneration

    config = load_config(model_dir)
    tensors = read_tensors(model_dir, ("talker.", "thinker.model.embed_tokens."))
    talker = Qwen2_5OmniTalkerForConditionalGeneration._from_config(config.talker_config)
    _load_into(talker, tensors, "talker.", "the talker")
    table = tensors["thinker.model.embed_tokens.weight"]
    embedding = torch.nn.Embedding(table.shape[0], table.shape[1])
    embedding.weight.data.copy_(table)
    dtype = dtype or table.dtype
    return talker.to(device=device, dtype=dtype).eval(), embedding.to(device=device, dtype=dtype).eval()


def load_token2wav(model_dir: Path, device: str = "cpu") -> Any:
    """token2wav (DiT and BigVGAN), in float32 as Qwen2.5-Omni runs it."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    config = load_config(model_dir)
    model = Qwen2_5OmniToken2WavModel._from_config(config.token2wav_config)
    _load_into(model, read_tensors(model_dir, ("token2wav.",)), "token2wav.", "token2wav")
    return model.to(device=device, dtype=torch.float32).eval()
