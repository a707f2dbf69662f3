"""Prompt lengths at the door (`omnid.prompt_length`), with the tiny Llama's own
tokenizer: what cannot fit `max_model_len` is refused, what fits is not, a huge prompt is counted
on a prefix, and a model the supervisor cannot measure is left to its stage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import MODELS, build_tiny_models

from omnid import prompt_length as PL
from omnid.config import StageConfig

pytestmark = pytest.mark.vllm

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def llm() -> Path:
    build_tiny_models("llm")
    return MODELS / "llm"


def stage(model: Path | None, **args: object) -> StageConfig:
    return StageConfig(name="gen", engine="vllm", model=model, args=args)


def tokens(model: Path, text: str) -> int:
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_over_the_window_is_refused_with_the_count_and_the_limit(llm: Path) -> None:
    text = " ".join(f"w{i}" for i in range(400))
    n = tokens(llm, text)
    assert n > 128
    why = PL.too_long(stage(llm, max_model_len=128), text)
    assert why == f"{n} tokens; stage 'gen''s model takes at most 128 (max_model_len)"
    assert PL.too_long(stage(llm, max_model_len=n), text) is None                 # exactly full fits
    assert PL.too_long(stage(llm, max_model_len=n - 1), text) is not None


def test_the_window_defaults_to_the_models_own_context(llm: Path) -> None:
    ctx = json.loads((llm / "config.json").read_text())["max_position_embeddings"]
    assert PL.window_of(stage(llm)).max_len == ctx                  # type: ignore[union-attr]
    over = " ".join(f"w{i}" for i in range(ctx * 2))
    assert f"at most {ctx} (max_model_len)" in (PL.too_long(stage(llm), over) or "")


def test_a_huge_prompt_is_counted_on_a_prefix_quickly(llm: Path) -> None:
    huge = "x " * 10_000_000                                        # 20 MB
    t0 = time.perf_counter()
    why = PL.too_long(stage(llm, max_model_len=512), huge)
    elapsed = time.perf_counter() - t0
    assert why is not None and why.startswith(f"its first {PL.PREFIX_CHARS_PER_TOKEN * 512} characters are ")
    assert elapsed < 2.0, elapsed                                   # (the prefix only: ~15 ms here)


def test_a_chat_counts_its_text_contents(llm: Path) -> None:
    words = " ".join(f"w{i}" for i in range(300))
    chat = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": words}, {"type": "image_url", "image_url": {}}]}]
    assert PL.chat_text(chat) == "be brief\n" + words
    assert PL.too_long(stage(llm, max_model_len=64), PL.chat_text(chat)) is not None
    assert PL.chat_text("not a chat") == ""


def test_what_cannot_be_measured_here_is_left_to_the_stage(llm: Path, tmp_path: Path) -> None:
    long = "word " * 5000
    assert PL.too_long(stage(None, max_model_len=8), long) is None          # no model
    (tmp_path / "config.json").write_text("{}")
    assert PL.too_long(stage(tmp_path, max_model_len=8), long) is None      # no tokenizer.json
    (tmp_path / "tokenizer.json").write_bytes((llm / "tokenizer.json").read_bytes())
    assert PL.too_long(stage(tmp_path), long) is None                       # no window known
    assert PL.too_long(stage(tmp_path, max_model_len=8), long) is not None


@pytest.mark.parametrize("config, ctx", [
    ({"max_position_embeddings": 64}, 64),
    ({"text_config": {"max_position_embeddings": 96}}, 96),                        # a VLM's (LLaVA)
    ({"thinker_config": {"text_config": {"max_position_embeddings": 80}}}, 80),    # Qwen2.5-Omni's
    ({"n_positions": 40, "text_config": {"max_position_embeddings": 96}}, 40),     # its own first
    ({"text_config": {"seq_length": 0, "max_sequence_length": 48}}, 48),
    ({"max_position_embeddings": True, "text_config": None}, 0),
])
def test_the_models_context_is_read_where_its_config_keeps_it(llm: Path, tmp_path: Path, config: dict[str, object],
                                                              ctx: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((llm / "tokenizer.json").read_bytes())
    window = PL.window_of(stage(tmp_path))
    assert (window.max_len if window is not None else 0) == ctx


def test_context_length_from_args_or_the_models_config(tmp_path: Path) -> None:
    assert PL.context_length(stage(None, max_model_len=77)) == 77
    assert PL.context_length(stage(None)) is None
    for bad in (0, -5, True, "77", 77.0):
        assert PL.context_length(stage(None, max_model_len=bad)) is None
    for i, (cfg, want) in enumerate([
            ({"max_position_embeddings": 4096}, 4096), ({"n_positions": 1024}, 1024),
            ({"max_sequence_length": 2048}, 2048), ({"seq_length": 512}, 512),
            ({"max_position_embeddings": 0, "seq_length": 300}, 300),
            ({"max_position_embeddings": True, "n_positions": 64}, 64),
            ({"text_config": {"max_position_embeddings": 8192}}, 8192),
            ({"text_config": None, "thinker_config": {"text_config": {"max_position_embeddings": 32768}}}, 32768),
            ({"max_position_embeddings": 10, "text_config": {"max_position_embeddings": 20}}, 10),
            ({"max_position_embeddings": "4096"}, None), ({}, None)]):
        model = tmp_path / f"m{i}"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        assert PL.context_length(stage(model)) == want, cfg
        assert PL.context_length(stage(model, max_model_len=99)) == 99        # the args win
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert PL.context_length(stage(tmp_path / "broken")) is None
    assert PL.context_length(stage(tmp_path / "absent")) is None


def test_max_tokens_problem_in_vllms_words() -> None:
    s = stage(None, max_model_len=128)
    assert PL.max_tokens_problem(s, 128) is None and PL.max_tokens_problem(s, 1) is None
    assert PL.max_tokens_problem(s, 129) == ("max_tokens=129 cannot be greater than max_model_len=128. Please request "
                                             "fewer output tokens.")
    assert PL.max_tokens_problem(s, 200, "max_completion_tokens").startswith("max_completion_tokens=200 cannot")
    assert PL.max_tokens_problem(s, True) is None and PL.max_tokens_problem(s, 129.0) is None
    assert PL.max_tokens_problem(stage(None), 10**9) is None          # nothing to measure against
