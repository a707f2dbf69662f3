"""An edge transform from a thinker's hidden states to a talker's prompt embeddings.

Omni models (Qwen2.5-Omni, Qwen3-Omni) hand their talker the thinker's hidden states, not its
text: each row is projected to the talker's width, and the talker's own special tokens frame
them. This module does that between two vllm stages (etc/examples/thinker_talker.toml):

    [stages.thinker]  outputs = ["hidden_states", "token_ids"]   # what the transform reads
    [stages.talker]   prompt_embeds = true                       # it takes embeddings
    edges = [{ from = "thinker", to = "talker", transform = "thinker_talker:to_talker" }]

`to_talker(outputs)` runs in the thinker's stage worker (main thread), once per job when the
thinker finishes (a `window = -1` edge), with the thinker's outputs: `hidden_states`
(tokens, hidden) in the model's dtype (tokens, layers, hidden with several `hidden_layers`: the
first listed is used), `token_ids`, `text`. It returns the talker's inputs: `prompt_embeds`
(2 + tokens, talker width), in float32 (the talker casts it to its own dtype).

The projection and the two special-token rows are what a real model trains (Qwen2.5-Omni's
`thinker_to_talker_proj` and its talker's `tts_bos`/`tts_eos` embeddings); here they come from a
file when `OMNID_TALKER_WEIGHTS` names one (a `.safetensors` with `proj.weight` (talker, thinker),
`proj.bias`, `bos`, `eos`), else from a fixed seed, so the example runs on the tiny random
models. The talker's width is read from its config.json (`OMNID_TALKER_MODEL`, default: the
tiny model's 128). Loaded once per worker, cached.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def _weights(thinker_width: int) -> tuple[Any, Any, Any, Any]:
    import torch

    path = os.environ.get("OMNID_TALKER_WEIGHTS")
    if path:
        from safetensors.torch import load_file
        w = load_file(path)
        return w["proj.weight"].float(), w["proj.bias"].float(), w["bos"].float(), w["eos"].float()
    model = os.environ.get("OMNID_TALKER_MODEL")
    width = 128
    if model:
        cfg = json.loads((Path(model) / "config.json").read_text())
        width = int(cfg.get("hidden_size") or cfg["text_config"]["hidden_size"])
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(width, thinker_width, generator=g) / thinker_width ** 0.5
    return proj, torch.zeros(width), torch.randn(width, generator=g) * 0.02, torch.randn(width, generator=g) * 0.02


def to_talker(outputs: dict[str, Any]) -> dict[str, Any]:
    """The thinker's outputs -> the talker's `prompt_embeds` (see the module docstring)."""
    import torch

    states = outputs["hidden_states"]
    if states.dim() == 3:
        states = states[:, 0]           # several hidden_layers: the first listed
    proj, bias, bos, eos = _weights(int(states.shape[1]))
    rows = states.float() @ proj.T + bias
    return {"prompt_embeds": torch.cat([bos[None], rows, eos[None]], dim=0)}
