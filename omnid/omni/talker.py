"""One job's Qwen2.5-Omni talker, stepped as the thinker's vectors arrive.

Runs in a stage worker's main thread (a `python` stage); blocks only on its own forward passes.

What the talker eats (transformers' `Qwen2_5OmniForConditionalGeneration.generate`, measured): with
D the thinker's width, h(x) the thinker's final post-norm hidden state at token x (the row that
feeds its lm_head) and e(x) the thinker's embedding of x,
- the prefill, once: [h(p) + e(p) for each prompt token p; e(speaker bos); reply(g0)], with the
  codec pad and bos embeddings added to its last two rows, where reply(g) = h(g) + e(g) and g0 is
  the first generated token;
- step t: the codec embedding of the last code plus R[t], where R = reply(g1), reply(g2), ...,
  then e(tts_eos) once the text has ended, then e(tts_pad) for ever.
So the talker runs about one thinker step behind: R[t] needs h(g_{t+1}), which the thinker computes
on the step that consumes g_{t+1}.

Positions are computed here (3-D rope; for text they are the plain indices) and kept per session,
so several sessions interleave on one model: transformers' own forward keeps `rope_deltas` on the
module, shared by every caller. Greedy decoding applies the same logits processors as
transformers' generate (repetition penalty, the codec bos suppressed), so a session's codes equal
`generate`'s on the same thinker output (a test checks it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

DEFAULT_REPETITION_PENALTY = 1.05       # transformers' Qwen2.5-Omni generate default
DEFAULT_MAX_CODES = 4096


class TalkerSession:
    """One job's talker state: KV cache, positions, codes so far, thinker vectors not yet used."""

    def __init__(self, talker: Any, text_embedding: Any, speaker: Mapping[str, Any], prompt_ids: Any,
                 prompt_hidden: Any, first_id: int, first_hidden: Any, *,
                 repetition_penalty: float = DEFAULT_REPETITION_PENALTY, max_codes: int = DEFAULT_MAX_CODES) -> None:
        """Prefill from the prompt's rows (`prompt_ids` (L,), `prompt_hidden` (L, D)) and the first
        generated token's (`first_id`, `first_hidden` (D,)). `talker` is a
        Qwen2_5OmniTalkerForConditionalGeneration, `text_embedding` the thinker's input embedding
        table, `speaker` one entry of the model's speaker map (`spk_dict.pt`)."""
        import torch
        from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

        self._torch = torch
        self.talker = talker
        self._embed_text = text_embedding
        self._embed_codec = talker.get_input_embeddings()
        self.dtype = talker.thinker_to_talker_proj.weight.dtype
        self.device = talker.thinker_to_talker_proj.weight.device
        self.eos_codes = {talker.codec_pad_token, talker.codec_eos_token}
        self.max_codes = max_codes
        with torch.no_grad():
            prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.device).reshape(-1)
            bos = torch.tensor([int(speaker["bos_token"])], device=self.device)
            first = torch.tensor([int(first_id)], device=self.device)
            rows = torch.cat([
                self._hidden(prompt_hidden).reshape(len(prompt_ids), -1) + self._text(prompt_ids),
                self._text(bos),
                self._hidden(first_hidden).reshape(1, -1) + self._text(first),
            ])
            rows[-1] += self._codec(talker.codec_bos_token)
            rows[-2] += self._codec(talker.codec_pad_token)
            self.prefill_rows = rows                # (its input rows, before the talker's projection)
            self._eos_row = self._text(torch.tensor([talker.text_eos_token], device=self.device))[0]
            self._pad_row = self._text(torch.tensor([talker.text_pad_token], device=self.device))[0]
            text_ids = torch.cat([prompt_ids, bos, first])[None]
            self._length = text_ids.shape[1]
            positions, deltas = talker.get_rope_index(text_ids, None, None, torch.ones_like(text_ids))
            self._delta = deltas.to(self.device)
            # The talker's own input ids (for the repetition penalty, as generate sees them).
            self.history = torch.tensor([[talker.codec_mask_token] * len(prompt_ids)
                                         + [talker.codec_pad_token, talker.codec_bos_token]], device=self.device)
            self._process = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(repetition_penalty),
                                                 SuppressTokensLogitsProcessor([talker.codec_bos_token],
                                                                               device=self.device)])
            out = talker.model(inputs_embeds=talker.thinker_to_talker_proj(rows[None]), position_ids=positions,
                               attention_mask=torch.ones(1, self._length, device=self.device), use_cache=True)
            self._cache = out.past_key_values
            self._logits = talker.codec_head(out.last_hidden_state[:, -1]).float()
        self.codes: list[int] = []
        self._replies: deque[Any] = deque()
        self.text_ended = False
        self.done = False

    def _hidden(self, rows: Any) -> Any:
        return self._torch.as_tensor(rows).to(device=self.device, dtype=self.dtype)

    def _text(self, ids: Any) -> Any:
        return self._embed_text(ids).to(self.dtype)

    def _codec(self, code: int) -> Any:
        return self._embed_codec(self._torch.tensor([code], device=self.device))[0].to(self.dtype)

    # -- input ------------------------------------------------------------------------------------

    def feed(self, token_id: int, hidden: Any) -> None:
        """One more generated thinker token and its hidden row (D,)."""
        with self._torch.no_grad():
            row = self._hidden(hidden).reshape(-1) + self._text(self._torch.tensor([int(token_id)],
                                                                                    device=self.device))[0]
        self._replies.append(row)

    def end_text(self) -> None:
        """The thinker has finished: the talker reads tts_eos once, then tts_pad until it stops."""
        if not self.text_ended:
            self._replies.append(self._eos_row)
            self.text_ended = True

    # -- output -----------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether `step` can make a code now (not done, and its input is there)."""
        return not self.done and (not self.codes or bool(self._replies) or self.text_ended)

    def step(self) -> int | None:
        """The next codec token, or None when it needs the next thinker vector first, or when done
        (an end code, or max_codes). The end code itself is not returned. One session alone: its
        forward through transformers' own model and cache (`TalkerBatch` steps many at once)."""
        if self.done:
            return None
        if self.codes:
            step = self.next_input()
            if step is None:
                return None
            row, position = step
            torch = self._torch
            with torch.no_grad():
                out = self.talker.model(inputs_embeds=self.talker.thinker_to_talker_proj(row[None, None]),
                                        position_ids=torch.tensor([[[position]]], device=self.device).expand(3, 1, 1),
                                        past_key_values=self._cache,
                                        attention_mask=torch.ones(1, self._length, device=self.device),
                                        use_cache=True)
                self._cache = out.past_key_values
                self._logits = self.talker.codec_head(out.last_hidden_state[:, -1]).float()
        return self.pick()

    def wants_forward(self) -> bool:
        """Whether its next code needs a forward (every code but the first, which the prefill gave)."""
        return bool(self.codes)

    def has_input(self) -> bool:
        """Whether `next_input` has its thinker vector (or needs none: the text has ended)."""
        return not self.done and bool(self.codes) and (bool(self._replies) or self.text_ended)

    def next_input(self) -> tuple[Any, int] | None:
        """The next decode step's input row (the talker's input width, before its projection) and
        its position, taking the next thinker vector; None when that vector is not here yet."""
        if self._replies:
            reply = self._replies.popleft()
        elif self.text_ended:
            reply = self._pad_row
        else:
            return None
        with self._torch.no_grad():
            row = self._codec(self.codes[-1]) + reply
        position = int(self._length + self._delta.reshape(-1)[0])
        self._length += 1
        return row, position

    def take_logits(self, logits: Any) -> None:
        """The decode step's logits for this session (V,), from a batched forward."""
        self._logits = logits.reshape(1, -1)

    def pick(self) -> int | None:
        """The code the last logits give (the logits processors as generate applies them), or None
        when it is an end code or max_codes is reached (then the session is done)."""
        torch = self._torch
        with torch.no_grad():
            code = int(self._process(self.history, self._logits).argmax(dim=-1))
        self.history = torch.cat([self.history, torch.tensor([[code]], device=self.device)], dim=1)
        if code in self.eos_codes or len(self.codes) >= self.max_codes:
            self.done = True
            return None
        self.codes.append(code)
        return code

    @property
    def cache(self) -> Any:
        """The prefill's KV cache (transformers' DynamicCache): what `TalkerBatch.admit` copies."""
        return self._cache
