"""The speech fixtures (tests/fixtures/speech/*.wav, made once by make.sh there with espeak-ng and
sox): 8 kHz G.711 mu-law WAVs, read here with the standard library and numpy and given as what a
realtime client sends, PCM16 mono at OpenAI's 24 kHz, in chunks as a microphone sends them.
Runs in the test process (and in the client venvs of `make test-agents`, layered on .venv)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

SPEECH = Path(__file__).resolve().parent / "fixtures" / "speech"
RATE = 24000
CHUNK_MS = 40                           # a microphone's chunk


def _mulaw(data: bytes) -> np.ndarray:
    u = ~np.frombuffer(data, dtype=np.uint8)
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    magnitude = ((mantissa.astype(np.int32) << 3) + 0x84) << exponent
    return np.where(sign != 0, 0x84 - magnitude, magnitude - 0x84).astype(np.float32) / 32768.0


def pcm24k(name: str) -> bytes:
    """A fixture (`turn1`, `turn2`, `barge_in`, `pauses`) as PCM16 mono at 24 kHz."""
    raw = (SPEECH / f"{name}.wav").read_bytes()
    assert raw[:4] == b"RIFF" and raw[8:12] == b"WAVE", name
    at, fmt, rate, data = 12, 0, 0, b""
    while at + 8 <= len(raw):
        kind, size = raw[at:at + 4], struct.unpack("<I", raw[at + 4:at + 8])[0]
        body = raw[at + 8:at + 8 + size]
        if kind == b"fmt ":
            fmt, _channels, rate = struct.unpack("<HHI", body[:8])
        elif kind == b"data":
            data = body
        at += 8 + size + (size & 1)
    assert fmt == 7 and rate, (name, fmt, rate)            # WAVE_FORMAT_MULAW
    x = _mulaw(data)
    t = np.arange(int(len(x) * RATE / rate)) * (rate / RATE)
    y = np.interp(t, np.arange(len(x)), x)
    return (np.clip(y, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def silence(ms: int) -> bytes:
    return b"\0\0" * (RATE * ms // 1000)


def chunks(pcm: bytes, ms: int = CHUNK_MS) -> list[bytes]:
    step = RATE * 2 * ms // 1000
    return [pcm[i:i + step] for i in range(0, len(pcm), step)]


def ms(pcm: bytes) -> int:
    return len(pcm) * 1000 // (2 * RATE)
