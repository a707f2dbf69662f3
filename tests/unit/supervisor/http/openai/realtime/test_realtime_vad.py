"""Server VAD in process (`omnid.supervisor.http.openai.realtime.vad`): the real Silero model (the ONNX file
the silero-vad package ships, on onnxruntime) over the committed speech fixtures, fed in
microphone-sized chunks as a session feeds it; and what it imports (no torch)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from conftest import ROOT

from omnid.supervisor.http.openai.realtime import vad as V

pytest.importorskip("onnxruntime")
speech = pytest.importorskip("speech")          # tests/speech.py (numpy)
if not V.available():
    pytest.skip("the vad extra is not installed", allow_module_level=True)


def edges(pcm: bytes, silence_ms: int, threshold: float = 0.5) -> list[tuple[str, int]]:
    async def go() -> list[tuple[str, int]]:
        d = V.Detector(threshold, silence_ms)
        out: list[V.VadEvent] = []
        for chunk in speech.chunks(pcm):
            out += await d.feed(chunk)
        return [(e.kind, e.ms) for e in out]
    return asyncio.run(go())


def test_every_pause_longer_than_the_silence_ends_a_turn_and_no_shorter_one_does() -> None:
    # pauses.wav: one (200 ms) two (350 ms) three (800 ms) four (250 ms) five (1200 ms)
    lead = 500
    pcm = speech.silence(lead) + speech.pcm24k("pauses")
    two = edges(pcm, 500)
    assert [k for k, _ in two] == ["started", "stopped", "started", "stopped"], two
    (_, s1), (_, e1), (_, s2), (_, e2) = two
    assert abs(s1 - lead) <= 100 and e1 < s2 and s2 - e1 >= 700, two      # the 800 ms pause split it
    one = edges(pcm, 1000)                       # only the last 1200 ms pause is longer
    assert [k for k, _ in one] == ["started", "stopped"] and abs(one[1][1] - e2) <= 64, one
    assert edges(pcm, 400) == two                # 200, 250 and 350 ms pauses never end a turn
    assert [k for k, _ in edges(pcm, 300)].count("stopped") == 3        # at 300 ms the 350 ms one does
    assert edges(speech.silence(3000), 500) == []    # silence is no speech
    assert edges(pcm, 500, threshold=1.0) == []       # nothing is that sure


def test_each_fixture_is_one_turn_with_its_short_pause_inside() -> None:
    for name in ("turn1", "turn2", "barge_in"):
        pcm = speech.silence(300) + speech.pcm24k(name)
        e = edges(pcm, 500)
        assert [k for k, _ in e] == ["started", "stopped"], (name, e)
        assert e[1][1] - e[0][1] > 800, (name, e)


def test_server_vad_imports_no_torch() -> None:
    code = ("import sys, asyncio; sys.path.insert(0, 'tests'); import speech; "
            "from omnid.supervisor.http.openai.realtime import session, vad as V; "
            "d = V.Detector(); asyncio.run(d.feed(speech.pcm24k('turn2'))); "
            "print(sorted(m for m in ('torch', 'silero_vad', 'vllm', 'transformers') if m in sys.modules), d.frames)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    mods, frames = out.stdout.split("] ")
    assert mods == "[" and int(frames) > 50, out.stdout
