"""The windows of `StreamingCode2Wav` (omnid/omni/code2wav.py), in-process: which frames each window
makes final, what it decodes around them, and how many codes must have come before it can run.

The schedule is arithmetic on the DiT's block size and the codes' repeat; the decoder here has the
tiny Qwen2.5-Omni's geometry (blocks of 24 frames, 2 frames a code) and never runs a DiT: each
window's mel is zeros of the window's length, handed to `take_mel` as the decode's would be."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from omnid.omni.code2wav import StreamingCode2Wav, Window  # noqa: E402

MEL_DIM = 4


def decoder(**kw: Any) -> StreamingCode2Wav:
    dit = SimpleNamespace(proj_out=SimpleNamespace(weight=torch.zeros(1)), repeats=2, block_size=24, mel_dim=MEL_DIM)
    token2wav = SimpleNamespace(code2wav_dit_model=dit, code2wav_bigvgan_model=None)
    speaker = {"cond": torch.zeros(1, 8), "ref_mel": torch.zeros(1, 8, MEL_DIM)}
    return StreamingCode2Wav(token2wav, speaker, **kw)


def schedule(dec: StreamingCode2Wav, codes: int) -> list[tuple[int, Window]]:
    """Push `codes` codes one at a time, then finish: (codes in when it could run, the window) each."""
    out: list[tuple[int, Window]] = []

    def drain(n: int) -> None:
        while (w := dec.next_window()) is not None:
            vocoder_in, keep = dec.take_mel(w, torch.zeros(1, MEL_DIM, w.end - w.start))
            assert keep == (min(dec.overlap, w.first) * 240, (w.last - w.first) * 240)
            out.append((n, w))
    for n in range(1, codes + 1):
        dec.codes.append(n)
        drain(n)
    dec.finished = True
    drain(codes)
    return out


def test_the_ramp_each_window_waits_for_its_own_look_ahead() -> None:
    """The default ramp (6, 12, 24, 48 codes made final): the first window with 4 codes of look-ahead
    (the vocoder's overlap), every later one with `lookahead_blocks` (one block, 12 codes), and a
    context of 2 blocks before its first frame, on the block grid."""
    got = schedule(decoder(), 110)
    assert [(n, (w.start, w.first, w.last, w.end)) for n, w in got] == [
        (10, (0, 0, 12, 20)),           # 6 codes final once 6 + 4 are in
        (30, (0, 12, 36, 60)),          # 12 more, once 18 + 12 are in
        (54, (0, 36, 84, 108)),
        (102, (24, 84, 180, 204)),      # its context starts 2 blocks before frame 84's block
        (110, (120, 180, 220, 220)),    # the rest, at the end
    ]
    assert got[1][1].codes == list(range(1, 31))            # the codes of frames [start, end)
    assert got[3][1].codes == list(range(13, 103))


def test_fixed_windows_and_a_last_scrap() -> None:
    """`chunk_blocks = 1`: every window one block, the first too with a block of look-ahead; at the
    end a scrap of at most a quarter window joins the last one."""
    got = schedule(decoder(chunk_blocks=1), 38)
    assert [(n, (w.first, w.last, w.end)) for n, w in got] == [(24, (0, 24, 48)), (36, (24, 48, 72)),
                                                               (38, (48, 76, 76))]    # 4 frames joined


def test_a_stream_that_starts_beside_others_has_a_longer_first_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """code2wav's `busy_first`: while another stream is open, a new one's first window makes that many
    codes final (its second comes slower on shared cores); alone, or without it, the ramp's own."""
    from omnid.omni import stages

    monkeypatch.setattr(stages, "_decoder", lambda model, speakers, inputs, params: decoder(ramp=[14, 12, 16]))
    c2w = object.__new__(stages.Code2Wav)
    c2w.model, c2w.speakers, c2w.n_codes, c2w.live = None, {}, 100, set()
    params = {"busy_first": 24}
    alone = c2w.open({"codes": iter(())}, params, None)
    beside = c2w.open({"codes": iter(())}, params, None)
    unset = c2w.open({"codes": iter(())}, {}, None)
    assert (alone.decoder.ramp, beside.decoder.ramp, unset.decoder.ramp) == ((14, 12, 16), (24, 12, 16), (14, 12, 16))
    for job in (alone, beside, unset):
        c2w.close(job)
    assert c2w.open({"codes": iter(())}, params, None).decoder.ramp == (14, 12, 16)    # (closed: alone again)


class _Codes:
    """A streamed `codes` input as the engine hands it: one code a window, read without blocking."""

    def __init__(self) -> None:
        self.waiting: list[Any] = []
        self.done = False

    def ready(self) -> bool:
        return bool(self.waiting) or self.done

    def __iter__(self) -> _Codes:
        return self

    def __next__(self) -> Any:
        if self.waiting:
            return self.waiting.pop(0)
        raise StopIteration


def test_a_session_can_step_once_a_window_is_here_not_at_each_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes come one segment each: a code2wav session asks for a step only when its next window's
    codes (with the look-ahead) are in, or they ended, not at every code (each step that found no
    window cost a step between the decodes, on the cores the codec LM needed). Codes that are none
    of the codec's fail the job at its next step, however often it is asked."""
    from omnid.omni import stages

    monkeypatch.setattr(stages, "_decoder", lambda model, speakers, inputs, params: decoder(ramp=[14, 12, 16]))
    c2w = object.__new__(stages.Code2Wav)
    c2w.model, c2w.speakers, c2w.n_codes, c2w.live = None, {}, 100, set()
    codes = _Codes()
    job = c2w.open({"codes": codes}, {}, None)
    ready_at = []
    for n in range(1, 40):
        codes.waiting.append([n % 100])
        if c2w.ready(job):
            ready_at.append(n)
            break
    alone = decoder(ramp=[14, 12, 16])
    first = next(n for n, _ in schedule(alone, 40))       # (the codes in when its first window could run)
    assert ready_at == [first], (ready_at, first)
    assert job.decoder.next_window() is not None          # (what that step decodes)
    codes.done = True
    assert c2w.ready(job)                                 # the end: the last scrap, or Done
    bad = c2w.open({"codes": _Codes()}, {}, None)
    bad.codes_in._stream.waiting.append([500])            # type: ignore[union-attr]
    assert c2w.ready(bad) and c2w.ready(bad)              # (asked twice: the error is kept)
    with pytest.raises(ValueError, match="not codec codes"):
        bad.absorb()
