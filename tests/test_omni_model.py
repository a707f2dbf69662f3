"""The tiny Qwen2.5-Omni that `make models` builds (`.models/omni`): transformers' own classes.

- Its thinker's text model, exported as a plain Qwen2 LM (`.models/omni/thinker`), runs in a real
  vLLM stage of a real daemon and writes the same greedy text as transformers' thinker
  (`Qwen2_5OmniThinkerForConditionalGeneration`) on the same prompts: the export is faithful.
- The whole model (thinker → talker → token2wav) speaks: audible 24 kHz audio, its own for each
  prompt (the random BigVGAN is calibrated at build time; uncalibrated it is silent).

transformers runs in the test process (the reference); vLLM only in the daemon's worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import MODELS, RunningDaemon, module_daemon, short_tmpdir

pytestmark = [pytest.mark.engines, pytest.mark.vllm]

OMNI = MODELS / "omni"
PROMPTS = ["the cat sat on the mat", "A small boat moved slowly across the harbor while", "hi"]
MAX_TOKENS = 16


def _built() -> None:
    if not (OMNI / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)


@pytest.fixture(scope="module")
def omni_model() -> Any:
    _built()
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(OMNI)).eval()


@pytest.fixture(scope="module")
def thinker_daemon() -> Iterator[RunningDaemon]:
    _built()
    stages = {"thinker": {"engine": "vllm", "model": str(OMNI / "thinker"), "devices": [],
                          "args": {"max_model_len": 512, "dtype": "float32", "enforce_eager": True},
                          "defaults": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}}
    with module_daemon(short_tmpdir(), stages, {"think": {"stages": ["thinker"]}}) as rd:
        yield rd


def test_the_build_has_the_whole_omni_model_and_a_plain_thinker_lm() -> None:
    _built()
    whole = json.loads((OMNI / "config.json").read_text())
    assert whole["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "token2wav_config"} <= whole.keys()
    plain = json.loads((OMNI / "thinker" / "config.json").read_text())
    assert plain["architectures"] == ["Qwen2ForCausalLM"]
    text = whole["thinker_config"]["text_config"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert plain[key] == text[key], key
    assert plain["head_dim"] >= 64                  # vLLM's CPU attention kernels need it
    assert (OMNI / "spk_dict.pt").is_file()
    # The talker's text ids are the thinker tokenizer's own special tokens.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(OMNI))
    assert whole["talker_config"]["tts_text_pad_token_id"] == tok.convert_tokens_to_ids("<|tts_pad|>")
    assert whole["talker_config"]["tts_text_start_token_id"] == tok.convert_tokens_to_ids("<|tts_bos|>")


def test_vllm_runs_the_exported_thinker_with_transformers_greedy_tokens(
        thinker_daemon: RunningDaemon, omni_model: Any) -> None:
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(OMNI))
    jobs = [thinker_daemon.submit("think", {"prompt": p}) for p in PROMPTS]
    texts = []
    for job in jobs:
        assert thinker_daemon.wait(job)["state"] == "succeeded", thinker_daemon.diagnose(job)
        texts.append(thinker_daemon.client.output(job, "text")[0].decode())
    for prompt, text in zip(PROMPTS, texts):
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            out = omni_model.thinker.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                              do_sample=False)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text == expected.strip(), (prompt, text, expected)      # (omnid strips its final text)
    assert len(set(texts)) > 1, texts                # the prompts matter


def test_the_whole_model_speaks_audibly_and_each_prompt_its_own_audio(omni_model: Any) -> None:
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(OMNI))
    waves = []
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([tok(prompt).input_ids])
        _text, wav = omni_model.generate(input_ids=ids, thinker_max_new_tokens=8, thinker_do_sample=False,
                                         talker_max_new_tokens=40, talker_do_sample=False, token2wav_num_steps=2)
        waves.append(wav.float())
    for wav in waves:
        assert wav.ndim == 1 and wav.numel() >= 480 * 10, wav.shape      # 480 samples a codec token
        rms = float(wav.pow(2).mean().sqrt())
        assert 0.02 < rms < 0.9, rms                                      # audible, not clipped
    n = min(w.numel() for w in waves)
    assert float((waves[0][:n] - waves[1][:n]).abs().mean()) > 1e-3
