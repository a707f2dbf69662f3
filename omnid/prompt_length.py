"""A text prompt measured at the door, in tokens, against the model's context window.

A vLLM stage refuses a prompt longer than its `max_model_len`; without this, the job was taken
(201) and then failed in the stage. Here the stage's own tokenizer (its model's `tokenizer.json`,
read by the `tokenizers` library: Rust, no torch, no vLLM) counts the prompt's tokens, and admission
refuses a prompt that cannot fit with a 400 that names the input, the count and the limit.

What is counted is a lower bound of what the engine sees: the prompt itself (a chat's text contents;
a chat template and a `prompt_template` only add tokens), so nothing that fits is refused. A prompt
longer than `PREFIX_CHARS_PER_TOKEN` characters per token of the window is counted on a prefix of
that many characters: its tokens alone already exceed the window, or the engine says.

Cost, measured on 2 cores with the tiny Llama's tokenizer: loading it once per model (cached by
path and mtime) ~3 ms; a 3,000-word prompt ~7 ms; a 20 MB prompt, cut to its prefix, ~15 ms.

Runs in the supervisor's event loop (admission's pure functions); reads the model's files once.
Without `tokenizers` installed, or a model without `tokenizer.json`, nothing is measured here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnid.config import StageConfig

PREFIX_CHARS_PER_TOKEN = 64         # no tokenizer's tokens average this many characters of text
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class Window:
    """A stage's tokenizer and its context window (`max_model_len`, in tokens)."""
    tokenizer: Any
    max_len: int


_cache: dict[tuple[str, float, int], Window | None] = {}
_lock = threading.Lock()


def window_of(stage: StageConfig) -> Window | None:
    """The stage's tokenizer and window, or None when either cannot be known here."""
    model = stage.args.get("tokenizer") or stage.model
    if not model:
        return None
    path = Path(str(model)) / "tokenizer.json"
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    explicit = stage.args.get("max_model_len")
    key = (str(path), mtime, int(explicit) if isinstance(explicit, int) and not isinstance(explicit, bool) else 0)
    with _lock:
        if key in _cache:
            return _cache[key]
    window = _load(path, Path(str(stage.model)) if stage.model else None, key[2])
    with _lock:
        _cache[key] = window
    return window


def _load(tokenizer_file: Path, model: Path | None, explicit: int) -> Window | None:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    max_len = explicit or _model_context(model)
    if not max_len:
        return None
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception:
        return None                 # (the stage's own load says what is wrong with it)
    tokenizer.no_truncation()
    return Window(tokenizer, max_len)


def context_length(stage: StageConfig) -> int | None:
    """The stage's context window in tokens (`args.max_model_len`, else its model's config.json, as
    vLLM takes it), or None when it cannot be known here."""
    explicit = stage.args.get("max_model_len")
    if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit > 0:
        return explicit
    return _model_context(Path(str(stage.model)) if stage.model else None) or None


def max_tokens_problem(stage: StageConfig, max_tokens: Any, name: str = "max_tokens") -> str | None:
    """A `max_tokens` the context window cannot hold, in `vllm serve`'s words (its 400); None if it fits
    or cannot be measured. (A prompt that leaves less room shortens the answer, as vLLM does: its
    finish_reason is then "length".)"""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return None
    limit = context_length(stage)
    if limit is None or max_tokens <= limit:
        return None
    return f"{name}={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer output tokens."


def _model_context(model: Path | None) -> int:
    """The model's own context length from its config.json (vLLM's default max_model_len)."""
    if model is None:
        return 0
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    for cfg in (config, config.get("text_config") or {}, config.get("thinker_config", {}).get("text_config") or {}):
        if isinstance(cfg, Mapping):
            for k in _CONTEXT_KEYS:
                v = cfg.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return 0


def count(window: Window, text: str) -> tuple[int, bool]:
    """The text's tokens (without special tokens), and whether only a prefix was counted."""
    limit = PREFIX_CHARS_PER_TOKEN * window.max_len
    cut = len(text) > limit
    if cut:
        text = text[:limit]
    return len(window.tokenizer.encode(text, add_special_tokens=False).ids), cut


def chat_text(messages: Any) -> str:
    """A chat's text contents, one per line (its parts' text; media parts count nothing here)."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(out)


def too_long(stage: StageConfig, text: str) -> str | None:
    """Why the text cannot fit the stage's window, or None (it fits, or cannot be measured here)."""
    window = window_of(stage)
    if window is None or not text:
        return None
    n, cut = count(window, text)
    if n <= window.max_len:
        return None
    counted = f"its first {PREFIX_CHARS_PER_TOKEN * window.max_len} characters are {n} tokens" if cut \
        else f"{n} tokens"
    return f"{counted}; stage {stage.name!r}'s model takes at most {window.max_len} (max_model_len)"
