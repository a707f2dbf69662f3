"""The omni speech halves (omnid.omni) on the tiny Qwen2.5-Omni, against transformers' own.

In process (torch and transformers in the test process), on the real model classes and weights:
- the incremental talker (one thinker vector per step, its KV cache kept) gives the same greedy
  codec tokens as transformers' whole-reply `generate`, also with two jobs' sessions interleaved
  on one model (no state shared between them);
- the streamed code2wav (block by block, with context) gives the whole-sequence decode's audio,
  with no seams; without context it has them (so the context is what makes it right);
- the stage functions turn a thinker's outputs into codes and the codes into a WAV.
The same functions in a real daemon's pipeline are tested where the pipeline is.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import MODELS

pytestmark = pytest.mark.engines

OMNI = MODELS / "omni"
CODES = 40


@pytest.fixture(scope="module")
def model() -> Any:
    if not (OMNI / ".omnid-tiny-ok").exists():
        subprocess.run([sys.executable, "-m", "omnid.tinymodels", str(MODELS)], check=True)
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(OMNI)).eval()


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(OMNI))


def _reference(model: Any, ids: Any, n_text: int) -> tuple[Any, list[int]]:
    """transformers' own: the thinker's greedy text, and the talker's greedy codes on all of it."""
    captured: dict[str, list[int]] = {}
    generate = model.talker.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs)
        captured["codes"] = out[0, kwargs["input_ids"].shape[1]:].tolist()
        return out

    model.talker.generate = spy
    try:
        text, _wav = model.generate(input_ids=ids, thinker_max_new_tokens=n_text, thinker_do_sample=False,
                                    talker_do_sample=False, talker_max_new_tokens=CODES, token2wav_num_steps=1)
    finally:
        del model.talker.generate
    codes = []
    for c in captured["codes"]:
        if c in (model.talker.codec_pad_token, model.talker.codec_eos_token):
            break
        codes.append(c)
    return text, codes


def _rows(model: Any, sequence: Any) -> Any:
    """The thinker's final post-norm hidden state at every position (what the vLLM tap gives)."""
    import torch

    with torch.no_grad():
        return model.thinker.model(input_ids=sequence).last_hidden_state[0]


def test_the_incremental_talker_gives_generates_codes_also_with_two_jobs_interleaved(model: Any, tok: Any) -> None:
    import torch

    from omnid.omni.talker import TalkerSession

    prompts, n_text = ["the cat sat on the mat", "A small boat moved slowly across the harbor"], 10
    runs = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt).input_ids])
        text, expected = _reference(model, ids, n_text)
        length = ids.shape[1]
        rows = _rows(model, text[:, :-1])       # the last generated token is never forwarded
        gen = text[0, length:].tolist()
        session = TalkerSession(model.talker, model.thinker.get_input_embeddings(), model.speaker_map["Chelsie"],
                                ids[0], rows[:length], gen[0], rows[length], max_codes=CODES)
        runs.append({"session": session, "gen": gen, "rows": rows, "length": length, "fed": 1, "codes": [],
                     "expected": expected})
    assert runs[0]["expected"] != runs[1]["expected"]
    # Feed the two jobs' thinker vectors in turn, one at a time, stepping each whenever it can.
    while any(not r["session"].done for r in runs):
        for r in runs:
            s = r["session"]
            if r["fed"] < n_text - 1:
                s.feed(r["gen"][r["fed"]], r["rows"][r["length"] + r["fed"]])
                r["fed"] += 1
            elif not s.text_ended:
                s.end_text()
            while (code := s.step()) is not None:
                r["codes"].append(code)
    for r in runs:
        assert len(r["codes"]) == len(r["expected"]) > 10
        assert r["codes"] == r["expected"]


def _reference_scores(model: Any, ids: Any, n_text: int) -> tuple[Any, list[int], list[Any]]:
    """As `_reference`, with the talker's processed scores at every step (generate's `scores`)."""
    captured: dict[str, Any] = {}
    generate = model.talker.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        captured["codes"] = out.sequences[0, kwargs["input_ids"].shape[1]:].tolist()
        captured["scores"] = [score[0] for score in out.scores]
        return out.sequences

    model.talker.generate = spy
    try:
        text, _wav = model.generate(input_ids=ids, thinker_max_new_tokens=n_text, thinker_do_sample=False,
                                    talker_max_new_tokens=CODES, talker_do_sample=False, return_audio=True)
    finally:
        del model.talker.generate
    codes: list[int] = []
    for c in captured["codes"]:
        if c in (model.talker.codec_pad_token, model.talker.codec_eos_token):
            break
        codes.append(c)
    return text, codes, captured["scores"]


def test_batched_talker_steps_give_each_sessions_codes_and_generates_scores(model: Any, tok: Any) -> None:
    """Four sessions, joined at different steps, stepped by one batched forward per step
    (`TalkerBatch`): each one's codes are generate's, exactly, and its processed logits at every
    step are generate's scores (a position off by one, or rows mixed between sessions, moves them)."""
    import torch

    from omnid.omni.talker import TalkerSession
    from omnid.omni.talker_batch import TalkerBatch

    prompts = ["the cat sat on the mat", "A small boat moved slowly across the harbor", "hello there",
               "one two three four five six"]
    n_text = 8
    batch = TalkerBatch(model.talker, slots=4, capacity=8)          # (small: it must grow on the way)
    runs = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt).input_ids])
        text, expected, scores = _reference_scores(model, ids, n_text)
        length = ids.shape[1]
        rows = _rows(model, text[:, :-1])
        gen = text[0, length:].tolist()
        runs.append({"ids": ids, "gen": gen, "rows": rows, "length": length, "expected": expected,
                     "scores": scores, "codes": [], "fed": 1, "session": None, "slot": None, "logits": [],
                     "raw": [], "rows_in": []})
    assert len({tuple(r["expected"]) for r in runs}) == 4

    def join(r: dict[str, Any]) -> None:
        n = r["length"]
        r["session"] = s = TalkerSession(model.talker, model.thinker.get_input_embeddings(),
                                         model.speaker_map["Chelsie"], r["ids"][0], r["rows"][:n], r["gen"][0],
                                         r["rows"][n], max_codes=CODES)
        r["slot"] = batch.admit(s.cache)
        r["raw"].append(s._logits[0].clone())
        r["logits"].append(s._process(s.history, s._logits)[0])
        r["codes"].append(s.pick())

    step = 0
    while any(r["session"] is None or not r["session"].done for r in runs):
        for i, r in enumerate(runs):
            if r["session"] is None and step >= 2 * i:              # joining between steps
                join(r)
        live = [r for r in runs if r["session"] is not None and not r["session"].done]
        for r in live:
            s = r["session"]
            if r["fed"] < n_text - 1:
                s.feed(r["gen"][r["fed"]], r["rows"][r["length"] + r["fed"]])
                r["fed"] += 1
            elif not s.text_ended:
                s.end_text()
        inputs = [(r, r["session"].next_input()) for r in live]
        inputs = [(r, x) for r, x in inputs if x is not None]
        if inputs:
            logits = batch.decode([r["slot"] for r, _ in inputs], torch.stack([x[0] for _, x in inputs]),
                                  [x[1] for _, x in inputs])
            for (r, x), row in zip(inputs, logits):
                s = r["session"]
                r["rows_in"].append(x[0])
                r["raw"].append(row.clone())
                s.take_logits(row)
                r["logits"].append(s._process(s.history, s._logits)[0])
                r["codes"].append(s.pick())
        for r in live:
            if r["session"].done and r["slot"] is not None:
                batch.release(r["slot"])
                r["slot"] = None
        step += 1
    assert batch.capacity > 8 and batch.free == 4
    for r in runs:
        codes = [c for c in r["codes"] if c is not None]
        assert codes == r["expected"], (codes, r["expected"])
        # every step's logits against one forward of transformers' talker over the whole input,
        # with its own positions (get_rope_index), no cache
        t = model.talker
        rows = torch.cat([r["session"].prefill_rows, torch.stack(r["rows_in"])])
        text_ids = torch.cat([r["ids"][0], torch.zeros(rows.shape[0] - r["ids"].shape[1], dtype=torch.long)])[None]
        positions, _ = t.get_rope_index(text_ids, None, None, torch.ones_like(text_ids))
        with torch.no_grad():
            whole = t.codec_head(t.model(inputs_embeds=t.thinker_to_talker_proj(rows[None]), position_ids=positions,
                                         attention_mask=torch.ones_like(text_ids)).last_hidden_state[0]).float()
        n_prefill = r["session"].prefill_rows.shape[0]
        steps = whole[n_prefill - 1:n_prefill - 1 + len(r["raw"])]
        worst = float((torch.stack(r["raw"]) - steps).abs().max())
        assert worst < 1e-5, worst                  # (seen: 6e-7; a position one off: 5e-4)
        # and generate's processed scores, within what its own thinker rows (computed step by step
        # in its generate, not in one forward as here) move them
        for got, want in zip(r["logits"], r["scores"]):
            finite = torch.isfinite(want)
            assert torch.allclose(got[finite], want[finite], atol=0.05), float((got - want)[finite].abs().max())


def test_the_talker_starts_about_one_thinker_step_behind(model: Any, tok: Any) -> None:
    import torch

    from omnid.omni.talker import TalkerSession

    ids = torch.tensor([tok("hello there").input_ids])
    text, _ = _reference(model, ids, 6)
    rows = _rows(model, text[:, :-1])
    n, gen = ids.shape[1], text[0, ids.shape[1]:].tolist()
    s = TalkerSession(model.talker, model.thinker.get_input_embeddings(), model.speaker_map["Chelsie"], ids[0],
                      rows[:n], gen[0], rows[n], max_codes=CODES)
    assert s.step() is not None                 # the first code comes from the prefill alone
    assert s.step() is None and not s.done      # the next one waits for the next thinker vector
    s.feed(gen[1], rows[n + 1])
    assert s.step() is not None and s.step() is None


def _decode(model: Any, codes: list[int], ramp: list[int], **kw: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Push `codes` in windows of `ramp` (the edge's), then finish: the streamed PCM, the whole
    decode's, and how it went (the codes in when the first packet came, the packets, the windows)."""
    import torch

    from omnid.omni.code2wav import StreamingCode2Wav

    dec = StreamingCode2Wav(model.token2wav, model.speaker_map["Chelsie"], num_steps=2, **kw)
    chunks, i, k, first = [], 0, 0, None
    while i < len(codes):
        w = ramp[min(k, len(ramp) - 1)]
        chunks += dec.push(codes[i:i + w])
        i, k = i + w, k + 1
        if chunks and first is None:
            first = min(i, len(codes))
    chunks += dec.finish()
    return torch.cat(chunks), dec.decode_whole(codes), {"first": first, "packets": chunks, "windows": dec._windows}


def test_streamed_code2wav_has_the_whole_decodes_audio_and_no_seams(model: Any) -> None:
    """The chunk ramp (the default: windows making 6, 12, 24, then 48 codes final, the first with
    only the vocoder's overlap as look-ahead) against the whole-sequence decode: over 60 dB (SNR),
    its first packet too, with the first packet after 10 codes where fixed one-block windows need
    24, and fewer windows (the DiT's context and look-ahead shared by more blocks)."""
    import torch

    codes = torch.randint(0, 8192, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    pcm, whole, ramp = _decode(model, codes, [2])
    assert pcm.shape == whole.shape == (96 * 480,)
    first = ramp["packets"][0]
    assert ramp["first"] == 10 and first.shape == (6 * 480,)        # 6 codes made final, 4 of look-ahead
    assert _snr(pcm, whole) > 60 and _snr(first, whole[:len(first)]) > 60, (_snr(pcm, whole), _snr(first, whole[:len(first)]))
    fixed_pcm, _, fixed = _decode(model, codes, [2], chunk_blocks=1)
    assert fixed["first"] == 24 and _snr(fixed_pcm, whole) > 60
    assert ramp["windows"] < fixed["windows"]
    # Without the DiT's context the blocks do not join: the same decode, context 0, has seams.
    bare, _, _ = _decode(model, codes, [4, 8, 16, 25], chunk_blocks=1, context_blocks=0, lookahead_blocks=0)
    assert _snr(bare, whole) < 30, _snr(bare, whole)


def test_code2wav_decodes_as_transformers_token2wav_from_the_same_noise(model: Any) -> None:
    import torch

    from omnid.omni.code2wav import StreamingCode2Wav

    dit = model.token2wav.code2wav_dit_model
    spk = model.speaker_map["Chelsie"]
    codes = list(range(100, 150))
    torch.manual_seed(5)
    expected = dit.sample(spk["cond"], spk["ref_mel"], torch.tensor([codes]), num_steps=3)
    torch.manual_seed(5)
    noise = torch.randn([1, len(codes) * 2, dit.mel_dim])
    dec = StreamingCode2Wav(model.token2wav, spk, num_steps=3)
    dec._noise_for = lambda first, frames: noise        # type: ignore[method-assign]
    assert torch.allclose(dec._mel_of(0, codes), expected, atol=1e-5)


@dataclass
class _Ctx:
    stage: str
    model: str
    job: str = "j"

    def cancelled(self) -> bool:
        return False


def test_the_stage_functions_turn_thinker_outputs_into_a_wav(model: Any, tok: Any) -> None:
    import io
    import wave

    import torch

    from omnid.omni.stages import code2wav, talker

    ids = torch.tensor([tok("the cat sat on the mat").input_ids])
    text, expected = _reference(model, ids, 8)
    n = ids.shape[1]
    states = _rows(model, text[:, :-1])
    segments = [s for s in talker({"prompt_ids": ids[0], "ids": text[0, n:], "states": states},
                                  {"max_codes": CODES}, _Ctx("talker", str(OMNI))) if s is not None]
    codes = torch.cat([s["codes"] for s in segments])
    assert codes.tolist() == expected
    audio = b"".join(s["audio"] for s in code2wav({"codes": codes}, {"num_steps": 2}, _Ctx("code2wav", str(OMNI)))
                     if s is not None)
    with wave.open(io.BytesIO(audio)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        frames = w.readframes(10 ** 7)
    assert len(frames) == len(codes) * 480 * 2
    import numpy as np
    pcm = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32767
    assert 0.02 < float(np.sqrt((pcm ** 2).mean())) < 0.9


def test_the_talker_sessions_class_gives_each_job_its_codes_in_one_batch(model: Any, tok: Any) -> None:
    """`sessions = "omnid.omni.stages:Talker"` as the engine drives it: three jobs opened at once,
    stepped together (one forward a step for all), each gets generate's codes; a fourth, cancelled
    mid-stream (closed at a step boundary), frees its slot and leaves the others' codes as they are;
    closing frees the slots."""
    import torch

    from omnid.engines.python_engine import LoadContext
    from omnid.omni.stages import Talker

    stage = Talker(LoadContext("talker", str(OMNI), (), max_inflight=4))
    jobs, expected, inputs = [], [], {}
    for prompt in ["the cat sat on the mat", "hello there", "A small boat moved slowly across the harbor"]:
        ids = torch.tensor([tok(prompt).input_ids])
        text, codes = _reference(model, ids, 8)
        n = ids.shape[1]
        inputs = {"prompt_ids": ids[0], "ids": text[0, n:], "states": _rows(model, text[:, :-1])}
        jobs.append(stage.open(inputs, {"max_codes": CODES}, _Ctx("talker", str(OMNI))))
        expected.append(codes)
    jobs.append(stage.open(inputs, {"max_codes": CODES}, _Ctx("talker", str(OMNI))))     # (the one cancelled)
    slots_taken: list[int] = []
    step = stage.step

    def counting(batch: list[Any]) -> list[Any]:
        out = step(batch)
        slots_taken.append(stage.batch.free)
        return out

    stage.step = counting                   # type: ignore[method-assign]
    segments, widest = _drive(stage, jobs, cancel={3: 5})
    assert widest == 4 and stage.batch.free == 4          # a slot per max_inflight, all free again
    assert slots_taken[4] == 0 and slots_taken[5] == 1    # the cancelled one's slot, freed at once
    assert 0 < len(segments[3]) < len(expected[2])        # (it had begun)
    assert [[c for seg in segs for c in seg["codes"].tolist()] for segs in segments[:3]] == expected


def _drive(stage: Any, jobs: list[Any], cancel: dict[int, int] | None = None,
           errors: dict[int, Exception] | None = None) -> tuple[list[list[dict[str, Any]]], int]:
    """Step a sessions class as the engine does, every ready session together, until all are done
    (closing each); each job's segments, and the most sessions one step took. `cancel` closes job i
    after step n, as a cancel does (at a step boundary, never stepped again); an exception result
    goes into `errors` (none is allowed without it)."""
    from omnid.engines.python_sessions import Done

    segments: list[list[dict[str, Any]]] = [[] for _ in jobs]
    live, widest = list(range(len(jobs))), 0
    for n in range(500):
        for i, after in (cancel or {}).items():
            if n == after and i in live:
                getattr(stage, "close", lambda job: None)(jobs[i])
                live.remove(i)
        ready = [i for i in live if stage.ready(jobs[i])]
        if not ready:
            break
        widest = max(widest, len(ready))
        for i, result in zip(ready, stage.step([jobs[i] for i in ready])):
            if isinstance(result, Exception):
                assert errors is not None, result
                errors[i] = result
                getattr(stage, "close", lambda job: None)(jobs[i])
                live.remove(i)
                continue
            segment = result.last if isinstance(result, Done) else result
            if segment is not None:
                segments[i].append(segment)
            if isinstance(result, Done):
                getattr(stage, "close", lambda job: None)(jobs[i])
                live.remove(i)
    assert not live, f"{len(live)} sessions never ended"
    return segments, widest


def _snr(got: Any, want: Any) -> float:
    import torch

    noise = (got - want).pow(2).mean()
    return float(10 * torch.log10(want.pow(2).mean() / noise)) if float(noise) > 0 else 200.0


def test_code2wav_sessions_decode_many_jobs_in_one_batch_as_each_alone(model: Any) -> None:
    """`sessions = "omnid.omni.stages:Code2Wav"`: three jobs with their own codes and speakers' seeds,
    stepped together (their DiT windows in one ODE, their vocoder inputs in one call when they
    match): each one's audio is its decoder's alone (within 60 dB), and a WAV; a fourth, cancelled
    mid-stream, and a fifth, failing on its first step, leave the others' audio as it is."""
    import io
    import wave

    import numpy as np
    import torch

    from omnid.omni.code2wav import StreamingCode2Wav
    from omnid.omni.stages import Code2Wav

    class Load:
        stage, model, devices = "code2wav", str(OMNI), ()

    stage = Code2Wav(Load())
    lengths = [60, 96, 30, 200]
    codes = [torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(k)).tolist()
             for k, n in enumerate(lengths)]
    jobs = [stage.open({"codes": torch.tensor(c)}, {"num_steps": 2, "seed": k}, _Ctx("code2wav", str(OMNI)))
            for k, c in enumerate(codes)]
    # and one whose codes are not codec codes: its exception fails it alone
    jobs.append(stage.open({"codes": torch.tensor([5, 99999])}, {"num_steps": 2}, _Ctx("code2wav", str(OMNI))))
    errors: dict[int, Exception] = {}
    segments, widest = _drive(stage, jobs, cancel={3: 2}, errors=errors)     # job 3 cancelled mid-stream
    assert list(errors) == [4] and "99999" in str(errors[4]), errors
    assert 0 < len(segments[3]) and sum(len(s["audio"]) for s in segments[3]) < 200 * 480 * 2
    audio = [b"".join(seg["audio"] for seg in segs) for segs in segments[:3]]
    assert widest == 5
    for k, (c, wav) in enumerate(zip(codes, audio)):
        with wave.open(io.BytesIO(wav)) as w:
            pcm = np.frombuffer(w.readframes(10 ** 7), dtype="<i2").astype(np.float32) / 32767
        alone = StreamingCode2Wav(model.token2wav, model.speaker_map["Chelsie"], num_steps=2, seed=k)
        want = torch.cat(alone.push(c) + alone.finish())
        assert pcm.shape == (len(c) * 480,)
        assert _snr(torch.from_numpy(pcm), (want.clamp(-1, 1) * 32767).round() / 32767) > 60
