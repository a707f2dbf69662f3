"""A live job's speech, read as it is written: the WAV a last stage streams into `.stream/` in the
job's folder, read as PCM16 while it grows; and a streamed WAV made whole (its size fields set).

Runs in the supervisor's event-loop thread, called by the speech and audio-chat answers
(speech.py, chat.py) and a realtime response (realtime/responses.py) at each event of their job. The
reads are small, non-blocking reads of a local file that is being appended to; no other state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from omnid.paths import STREAM_DIR

WAV_HEADER_BYTES = 44           # omnid's streamed WAVs: RIFF, fmt (16 bytes of PCM format), data


def wav_bytes(data: bytes) -> bytes:
    """A whole WAV from a streamed one: the size fields set to the real length (a stream wrote
    "to the end of the file")."""
    if len(data) < WAV_HEADER_BYTES or data[:4] != b"RIFF" or data[36:40] != b"data":
        return data
    n = len(data) - WAV_HEADER_BYTES
    return b"RIFF" + (n + 36).to_bytes(4, "little") + data[8:40] + n.to_bytes(4, "little") + data[WAV_HEADER_BYTES:]


class LiveAudio:
    """A live job's audio stream file (a last stage's WAV as it is written: `.stream/` in the job's
    folder), read as PCM16 while it grows. The file is found by its WAV header; kept open once
    found, so the rest is still read after the worker removes it at the job's end."""

    def __init__(self, job_dir: Path) -> None:
        self.folder = job_dir / STREAM_DIR
        self._f: BinaryIO | None = None
        self._header = True
        self.header = b""                        # the stream's WAV header, once read

    def _open(self) -> BinaryIO | None:
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return None
        for name in names:
            try:
                f = open(self.folder / name, "rb")
            except OSError:
                continue
            if f.read(4) == b"RIFF":
                f.seek(0)
                return f
            f.close()
        return None

    def read(self) -> bytes:
        """The PCM written since the last read (no WAV header)."""
        if self._f is None:
            self._f = self._open()
            if self._f is None:
                return b""
        if self._header:
            if os.fstat(self._f.fileno()).st_size < WAV_HEADER_BYTES:
                return b""
            self.header = self._f.read(WAV_HEADER_BYTES)
            self._header = False
        data = self._f.read()
        if len(data) % 2:
            self._f.seek(-1, os.SEEK_CUR)        # half a sample: next time
            data = data[:-1]
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
