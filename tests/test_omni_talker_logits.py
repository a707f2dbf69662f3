"""The incremental talker's logits at every step are transformers' own (omnid/omni/talker.py), on the
tiny Qwen2.5-Omni (.models/omni), in process.

Greedy codes alone do not pin the talker's positions: a decode position off by one (every step's
query and key rotated one place back) leaves this model's greedy codes as they were. Its logits
move, by far more than float rounding: so each step's raw logits (before the logits processors)
are held to those of transformers' own `generate` of the talker (`output_logits`), which keeps
its own KV cache and computes its own positions, on the same thinker output.

The reference is the talker's `generate` with the arguments `Qwen2_5OmniForConditionalGeneration.
generate` gives it (captured), whose prefill rows get the codec pad and bos embeddings added to
the last two, as the talker's forward adds them when it is given an attention mask (transformers
5's generate passes the talker none, and then its forward leaves them out; omnid's session adds
them, as the model was trained).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from conftest import MODELS

pytestmark = pytest.mark.engines

OMNI = MODELS / "omni"
N_TEXT = 8
CODES = 24


@pytest.fixture(scope="module")
def model() -> Any:
    if not (OMNI / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(OMNI)).eval()


def reference(model: Any, ids: Any) -> tuple[Any, list[int], list[Any]]:
    """The thinker's greedy text, and transformers' talker on it: its greedy codes (up to an end
    code) and its raw logits at each step."""
    import torch

    talker = model.talker
    generate = talker.generate
    captured: dict[str, Any] = {}

    def spy(*args: Any, **kwargs: Any) -> Any:
        captured.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        return generate(*args, **kwargs)

    talker.generate = spy
    try:
        text, _wav = model.generate(input_ids=ids, thinker_max_new_tokens=N_TEXT, thinker_do_sample=False,
                                    talker_do_sample=False, talker_max_new_tokens=CODES, token2wav_num_steps=1)
    finally:
        del talker.generate
    codec = talker.get_input_embeddings()
    with torch.no_grad():
        embeds = captured["inputs_embeds"]
        embeds[:, -1] += codec(torch.tensor([talker.codec_bos_token]))[0]
        embeds[:, -2] += codec(torch.tensor([talker.codec_pad_token]))[0]
        out = generate(**captured, output_logits=True, return_dict_in_generate=True)
    codes = []
    for c in out.sequences[0, captured["input_ids"].shape[1]:].tolist():
        if c in (talker.codec_pad_token, talker.codec_eos_token):
            break
        codes.append(c)
    return text, codes, [step[0].float() for step in out.logits]


def test_every_steps_logits_are_transformers_generates(model: Any) -> None:
    import torch
    from transformers import AutoTokenizer

    from omnid.omni.talker import TalkerSession

    tok = AutoTokenizer.from_pretrained(str(OMNI))
    ids = torch.tensor([tok("the cat sat on the mat").input_ids])
    text, expected, logits = reference(model, ids)
    n = ids.shape[1]
    with torch.no_grad():       # the thinker's final hidden state at each position (what the vLLM tap gives)
        rows = model.thinker.model(input_ids=text[:, :-1]).last_hidden_state[0]
    gen = text[0, n:].tolist()
    session = TalkerSession(model.talker, model.thinker.get_input_embeddings(), model.speaker_map["Chelsie"],
                            ids[0], rows[:n], gen[0], rows[n], max_codes=CODES)
    codes: list[int] = []
    got: list[Any] = []
    fed = 1
    while not session.done:
        if fed < N_TEXT - 1:
            session.feed(gen[fed], rows[n + fed])
            fed += 1
        elif not session.text_ended:
            session.end_text()
        while (code := session.step()) is not None:
            codes.append(code)
            got.append(session._logits[0].float().clone())      # the raw logits this code came from
    assert len(codes) > 10 and codes == expected
    worst = [float((g - r).abs().max()) for g, r in zip(got, logits)]
    assert len(worst) == len(codes)
    scale = max(float(r.abs().max()) for r in logits)
    # float32 on both sides: they agree to ~1e-7 of logits of ~1; a position off by one moves them ~1e-4
    assert max(worst) < 1e-5 * max(1.0, scale), [f"step {i}: {w:.2e}" for i, w in enumerate(worst) if w >= 1e-5]
