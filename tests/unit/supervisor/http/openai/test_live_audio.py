"""A live job's speech read as it is written, in process (`omnid.supervisor.http.openai.live_audio`): the
WAV in `.stream/` found by its header and read as PCM16 while it grows (never half a sample), and a
streamed WAV made whole."""

from __future__ import annotations

import io
import wave
from pathlib import Path

from omnid.paths import STREAM_DIR
from omnid.supervisor.http.openai.live_audio import WAV_HEADER_BYTES, LiveAudio, wav_bytes


def streamed_wav(pcm: bytes, rate: int = 24000) -> bytes:
    """A WAV as a stream writes it: its size fields say "to the end of the file"."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    data = out.getvalue()
    return data[:4] + b"\xff\xff\xff\xff" + data[8:40] + b"\xff\xff\xff\xff" + data[44:]


def test_a_streamed_wav_is_made_whole() -> None:
    pcm = bytes(range(200))
    whole = wav_bytes(streamed_wav(pcm))
    with wave.open(io.BytesIO(whole)) as w:
        assert w.getnframes() == 100 and w.readframes(100) == pcm
    assert wav_bytes(b"not a wav") == b"not a wav"


def test_the_stream_is_read_as_it_grows(tmp_path: Path) -> None:
    folder = tmp_path / STREAM_DIR
    reader = LiveAudio(tmp_path)
    assert reader.read() == b""                     # no folder yet
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"some text, not audio")
    data = streamed_wav(b"", rate=16000)
    f = open(folder / "speech.wav", "wb")
    f.write(data[:20])
    f.flush()
    assert reader.read() == b""                     # the header is not whole yet
    f.write(data[20:] + b"\x01\x02\x03")
    f.flush()
    assert reader.read() == b"\x01\x02"             # half a sample waits
    assert int.from_bytes(reader.header[24:28], "little") == 16000 and len(reader.header) == WAV_HEADER_BYTES
    f.write(b"\x04")
    f.close()
    (folder / "speech.wav").unlink()                # the worker removes it at the job's end: still read
    assert reader.read() == b"\x03\x04"
    assert reader.read() == b""
    reader.close()
