"""The seconds of audio in a segment (omnid.engines.base.audio_seconds), and their sum when the
worker coalesces segments: what the supervisor's time-to-first-audio, real-time factor and
underrun figures count."""

from __future__ import annotations

import struct

from omnid import protocol as P
from omnid.engines.base import audio_seconds
from omnid.worker.reporter import _coalesce


def _header(rate: int, channels: int = 1, bits: int = 16) -> bytes:
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, bits)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def test_a_streamed_wav_is_counted_from_its_header_on() -> None:
    wav: dict[str, int] = {}
    assert audio_seconds({"audio": _header(24000) + b"\0" * 4800}, wav) == 0.1      # 2400 samples of 2 bytes
    assert audio_seconds({"audio": b"\0" * 48000}, wav) == 1.0                       # the rate remembered
    assert audio_seconds({"other": b"\0" * 48000, "text": "hi"}, wav) == 0.0       # not a WAV stream
    assert audio_seconds({"audio": _header(16000, channels=2) + b"\0" * 64000}, {}) == 1.0


def test_coalesced_segments_add_their_audio() -> None:
    a = P.Segment(job="j", index=0, is_last=False, audio_s=0.24)
    b = P.Segment(job="j", index=1, is_last=False, audio_s=0.24)
    (merged,) = _coalesce([a, b])
    assert isinstance(merged, P.Segment) and merged.count == 2 and abs(merged.audio_s - 0.48) < 1e-9


def test_coalesced_segments_keep_the_last_ones_end_and_finish_reason() -> None:
    """A stream's last segment joined with the step before it still says it is the last, and why
    the answer ended (a chat sends `finish_reason` with it)."""
    a = P.Segment(job="j", index=0, is_last=False, text="the ")
    b = P.Segment(job="j", index=1, is_last=True, text="sea", finish_reason="stop")
    (merged,) = _coalesce([a, b])
    assert isinstance(merged, P.Segment)
    assert (merged.text, merged.is_last, merged.finish_reason) == ("the sea", True, "stop")
