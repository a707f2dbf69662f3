"""The Qwen2.5-Omni talker's decode step for many sessions at once.

Runs in a python stage worker's main thread (the talker stage's `Talker` sessions class); blocks
only on its own forward.

Each live session's KV cache sits in a slot of per-layer buffers, `(slots, kv_heads, capacity,
head_dim)`, grown (doubled) when a session outgrows them. One decode step takes the rows of every
session that has its next input, runs the talker's own modules (its norms, projections, rotary
embedding and MLPs: the weights and functions transformers loaded) once for the whole batch, writes
each session's new key and value at its own length, and attends each row over its own slot only (a
mask hides the rest). So the rows of a batch never mix: a session's logits are what it would get
alone, up to float rounding (a test holds them to transformers' forward).

The text positions of the talker's 3-D rope are one index repeated three times, so one position per
row is enough (`mrope_section` still applies, through transformers' rotary embedding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb


class TalkerBatch:
    """The slots of one talker model, and its batched decode step."""

    def __init__(self, talker: Any, slots: int, capacity: int = 256) -> None:
        cfg = talker.config
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("a talker with sliding-window layers cannot step in a batch here")
        self.talker = talker
        self.layers = list(talker.model.layers)
        attn = self.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        weight = talker.thinker_to_talker_proj.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.capacity = capacity
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.lengths = [0] * slots
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def admit(self, cache: Any) -> int:
        """Copy a session's prefill cache (transformers' DynamicCache, batch 1) into a free slot."""
        slot = self._free.pop()
        length = int(cache.layers[0].keys.shape[2])
        self._grow(length + 1)
        for i, layer in enumerate(cache.layers):
            self.keys[i][slot, :, :length] = layer.keys[0].to(self.dtype)
            self.values[i][slot, :, :length] = layer.values[0].to(self.dtype)
        self.lengths[slot] = length
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.zeros((old.shape[0], self.kv_heads, capacity, self.head_dim), dtype=self.dtype,
                                  device=self.device)
                new[:, :, :self.capacity] = old
                buffers[i] = new
        self.capacity = capacity

    @torch.no_grad()
    def decode(self, slots: list[int], rows: Any, positions: list[int]) -> Any:
        """One decode step for the sessions in `slots`: `rows` (B, width) their inputs before the
        talker's input projection, `positions` their rope positions. Returns the logits (B, vocab),
        float32; each slot's length grows by one."""
        talker = self.talker
        batch = len(slots)
        lengths = torch.tensor([self.lengths[s] for s in slots], device=self.device)
        span = int(lengths.max()) + 1
        self._grow(span)
        index = torch.tensor(slots, device=self.device)
        x = talker.thinker_to_talker_proj(rows.to(self.dtype))[:, None]            # (B, 1, D)
        position_ids = torch.tensor(positions, device=self.device).view(1, batch, 1).expand(3, batch, 1)
        cos, sin = talker.model.rotary_emb(x, position_ids)
        # row b attends to its own slot's positions 0..lengths[b] (its new one included)
        mask = (torch.arange(span, device=self.device)[None, :] <= lengths[:, None])[:, None, None, :]
        groups = self.heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, 1, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.keys[i][index, :, lengths] = k[:, :, 0]
            self.values[i][index, :, lengths] = v[:, :, 0]
            keys = self.keys[i][index, :, :span]
            values = self.values[i][index, :, :span]
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for s in slots:
            self.lengths[s] += 1
        return talker.codec_head(talker.model.norm(x)[:, 0]).float()
