"""omnid.media on its own: headers, limits, WAV decoding, resampling, images, video frames, chats.

Fast (no daemon, no model): what the door and the vLLM engine both rely on.
"""

from __future__ import annotations

import io
import math
import struct
import wave
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omnid import media as M

LIMITS = M.MediaLimits(image=2, audio=1, video=1)


def png(width: int = 32, height: int = 24, mode: str = "RGB", fmt: str = "PNG", **save: Any) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), "red" if mode != "L" else 128).save(buf, fmt, **save)
    return buf.getvalue()


def pcm16_wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def tone(freq: float, rate: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.sin(2 * np.pi * freq * t).astype(np.float32)


def peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


# ------------------------------------------------------------------ image headers


@pytest.mark.parametrize("fmt,save", [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("GIF", {}),
                                      ("BMP", {}), ("WEBP", {"lossless": True}), ("WEBP", {"quality": 50})])
def test_image_info_reads_the_size_from_the_header(fmt: str, save: dict[str, Any]) -> None:
    info = M.image_info(png(37, 21, fmt=fmt, **save))
    assert (info.width, info.height) == (37, 21)
    assert info.format.upper().startswith(fmt[:3])


def test_image_info_reads_only_the_header() -> None:
    data = png(4000, 3000)
    assert M.image_info(data[:64]).width == 4000        # the body is not needed, nor read


@pytest.mark.parametrize("data,words", [
    (b"hello, this is a text file\n", "this is text"),
    (b"", "the file is empty"),
    (b"%PDF-1.7 ...", "this is a PDF"),
    (b"\x00\x01\x02\x03\x04\x05\x06\x07\x08", "starts with bytes 00 01"),
])
def test_not_an_image_says_what_it_looks_like(data: bytes, words: str) -> None:
    with pytest.raises(M.MediaError, match="not an image") as e:
        M.image_info(data)
    assert words in str(e.value)


def test_a_wav_sent_as_an_image_is_named() -> None:
    with pytest.raises(M.MediaError, match="this is a WAV file"):
        M.image_info(pcm16_wav(tone(440, 8000, 0.1), 8000))


def test_truncated_headers_are_refused() -> None:
    with pytest.raises(M.MediaError):
        M.image_info(png()[:20])
    with pytest.raises(M.MediaError, match="JPEG"):
        M.image_info(b"\xff\xd8\xff\xe0\x00\x10JFIF")


def test_an_image_cut_short_is_refused_at_the_door_and_a_whole_one_is_not() -> None:
    limits = M.MediaLimits(image=1)
    for fmt in ("PNG", "JPEG"):
        whole = png(64, 48, fmt=fmt)
        assert M.check_media("image", whole, limits)[0]["format"] == fmt
        for cut in (len(whole) // 2, len(whole) - 2):
            with pytest.raises(M.MediaError, match=f"a truncated {fmt}"):
                M.check_media("image", whole[:cut], limits)
            assert M.image_info(whole[:cut]).format == fmt          # (its header alone is fine)
        with pytest.raises(OSError):        # what a decoder in the stage would find, reading the pixels
            Image.open(io.BytesIO(whole[:len(whole) // 2])).load()
    # a JPEG with bytes after its end marker (some cameras add them) is whole
    assert M.check_media("image", png(8, 8, fmt="JPEG") + b"\x00" * 100, limits)


def test_a_large_jpeg_is_checked_at_its_end() -> None:
    """A JPEG's end marker is at its end: one of many KiB is whole, and cut short it is refused."""
    noise = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "JPEG", quality=95)
    whole = buf.getvalue()
    assert len(whole) > 2 * 4096
    limits = M.MediaLimits(image=1)
    assert M.check_media("image", whole, limits)[0]["format"] == "JPEG"
    for cut in (len(whole) - 2, 4096, 5000):
        with pytest.raises(M.MediaError, match="a truncated JPEG"):
            M.check_media("image", whole[:cut], limits)


# ------------------------------------------------------------------ the door's checks


def test_check_media_applies_every_limit() -> None:
    small = M.MediaLimits(image=1, audio=1, max_pixels=1000, max_bytes=100_000, max_audio_s=1.0)
    assert M.check_media("image", png(20, 20), small) == [{"format": "PNG", "width": 20, "height": 20}]
    with pytest.raises(M.MediaError, match=r"40x40 PNG image \(1600 pixels\).*at most 1000 pixels"):
        M.check_media("image", png(40, 40), small)
    # the bound itself: exactly max_pixels passes, one pixel more does not
    assert M.check_media("image", png(40, 25), small) == [{"format": "PNG", "width": 40, "height": 25}]
    with pytest.raises(M.MediaError, match=r"1001 pixels"):
        M.check_media("image", png(1001, 1), small)
    with pytest.raises(M.MediaError, match="2 images, but the stage takes at most 1"):
        M.check_media("image", [png(), png()], small)
    with pytest.raises(M.MediaError, match="bytes; the stage takes at most 100000"):
        M.check_media("image", png(20, 20) + b"\0" * 100_000, small)
    with pytest.raises(M.MediaError, match=r"2\.0 s of audio; the stage takes at most 1 s"):
        M.check_media("audio", pcm16_wav(tone(440, 8000, 2.0), 8000), small)
    assert M.check_media("audio", pcm16_wav(tone(440, 8000, 0.5), 8000), small) == \
        [{"seconds": 0.5, "rate": 8000, "channels": 1}]


def test_check_media_names_the_item_of_several() -> None:
    with pytest.raises(M.MediaError, match="image 2 of 2: not an image"):
        M.check_media("image", [png(), b"plain text"], LIMITS)


def test_video_is_a_list_of_frames() -> None:
    frames = [png(16, 16)] * 3
    assert M.as_items("video", frames) == [frames]                  # one video
    assert M.as_items("video", [frames, frames]) == [frames, frames]
    assert M.check_media("video", frames, LIMITS) == [{"frames": 3, "size": 3 * len(frames[0])}]
    few = M.MediaLimits(video=1, max_video_frames=2)
    with pytest.raises(M.MediaError, match="3 frames; the stage takes at most 2"):
        M.check_media("video", frames, few)
    with pytest.raises(M.MediaError, match="frame 2: not an image"):
        M.check_media("video", [png(), b"nope"], LIMITS)
    whole = png(16, 16, fmt="JPEG")
    with pytest.raises(M.MediaError, match="frame 2: a truncated JPEG"):
        M.check_media("video", [whole, whole[:len(whole) - 2], whole], LIMITS)
    with pytest.raises(M.MediaError, match="frame 1: a truncated PNG"):
        M.check_media("video", [frames[0][:-12]], LIMITS)


# ------------------------------------------------------------------ WAV


def test_wav_pcm16_and_the_standard_library_agree() -> None:
    x = tone(440, 8000, 0.25) * 0.5
    data = pcm16_wav(x, 8000)
    info = M.wav_info(data)
    assert (info.rate, info.channels, info.bits, info.frames) == (8000, 1, 16, 2000)
    samples, rate = M.decode_wav(data)
    assert rate == 8000 and samples.shape == (2000, 1)
    assert np.max(np.abs(samples[:, 0] - x)) < 1e-3


def test_samples_to_wav_is_a_float_wav() -> None:
    data = M.samples_to_wav([0.0, 0.5, -0.25, 1.0], 22050)
    info = M.wav_info(data)
    assert info.is_float and info.bits == 32 and info.rate == 22050 and info.frames == 4
    samples, _ = M.decode_wav(data)
    assert samples[:, 0].tolist() == [0.0, 0.5, -0.25, 1.0]


@pytest.mark.parametrize("samples,rate,words", [
    ([], 16000, "non-empty"), ([0.1, float("nan")], 16000, "finite"), ([0.1, "x"], 16000, "finite"),
    ([0.1], 0, "sample rate"), ([0.1], 16000.5, "sample rate"), ([0.1], True, "sample rate"),
])
def test_samples_to_wav_refuses_bad_values(samples: list[Any], rate: Any, words: str) -> None:
    with pytest.raises(M.MediaError, match=words):
        M.samples_to_wav(samples, rate)


def test_wav_8_and_24_bit_and_stereo() -> None:
    x = np.array([0.0, 0.5, -0.5, 0.25], dtype=np.float32)
    u8 = (x * 127 + 128).astype(np.uint8).tobytes()
    s8, _ = M.decode_wav(M.wav_bytes(u8, 8000, bits=8))
    assert np.allclose(s8[:, 0], x, atol=0.01)
    i24 = b"".join(struct.pack("<i", int(v * (2 ** 23 - 1)))[:3] for v in x)
    s24, _ = M.decode_wav(M.wav_bytes(i24, 8000, bits=24))
    assert np.allclose(s24[:, 0], x, atol=1e-6)
    stereo = np.stack([x, -x], axis=1).reshape(-1)
    data = M.wav_bytes((stereo * 32767).astype("<i2").tobytes(), 16000, channels=2)
    s2, _ = M.decode_wav(data)
    assert s2.shape == (4, 2)
    mono = M.load_audio(data, LIMITS, 16000)                        # channels averaged
    assert np.allclose(mono, 0, atol=1e-4)


def test_a_streamed_wav_header_means_to_the_end_of_the_file() -> None:
    """The demo's vocoder writes 0xFFFFFFFF sizes (its length was not known yet)."""
    pcm = (tone(300, 16000, 0.5) * 8000).astype("<i2").tobytes()
    header = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))
    info = M.wav_info(header + pcm)
    assert info.frames == 8000 and info.seconds == 0.5


def test_wave_format_extensible_and_odd_chunks() -> None:
    pcm = (tone(300, 16000, 0.1) * 8000).astype("<i2").tobytes()
    ext = struct.pack("<HHIIHHHHIH14s", 0xFFFE, 1, 16000, 32000, 2, 16, 22, 16, 4, 1, b"\x00" * 14)
    data = (b"RIFF" + struct.pack("<I", 0) + b"WAVE" + b"LIST" + struct.pack("<I", 3) + b"abc\0"
            + b"fmt " + struct.pack("<I", len(ext)) + ext + b"data" + struct.pack("<I", len(pcm)) + pcm)
    assert M.wav_info(data).frames == 1600


@pytest.mark.parametrize("data,words", [
    (b"not audio at all", "not a WAV file"),
    (png(), "not a WAV file"),
    (b"RIFF\0\0\0\0WAVEdata\4\0\0\0abcd", "before their format"),
    (M.wav_bytes(b"\0" * 8, 8000, bits=12), "12-bit"),
    (b"RIFF\0\0\0\0WAVEfmt \x10\0\0\0" + struct.pack("<HHIIHH", 85, 1, 8000, 8000, 1, 8)
     + b"data\1\0\0\0\0", "format 85"),
])
def test_bad_wavs_are_refused(data: bytes, words: str) -> None:
    with pytest.raises(M.MediaError, match=words):
        M.wav_info(data)


# ------------------------------------------------------------------ resampling


def test_resample_keeps_a_tone_and_its_level() -> None:
    x = tone(1000, 44100, 1.0)
    y = M.resample(x, 44100, 16000)
    assert y.dtype == np.float32 and len(y) == 16000
    assert abs(peak_hz(y, 16000) - 1000) <= 2
    middle = y[1000:-1000]
    assert abs(np.sqrt(np.mean(middle ** 2)) - math.sqrt(0.5)) < 0.01     # RMS of a unit sine


def test_resample_downwards_does_not_alias() -> None:
    """12 kHz is above the 8 kHz Nyquist frequency of 16 kHz: it must be removed, not folded to 4 kHz."""
    y = M.resample(tone(12000, 44100, 1.0), 44100, 16000)
    assert np.sqrt(np.mean(y[1000:-1000] ** 2)) < 0.01       # below -37 dB of the input's RMS


def test_resample_upwards_and_identity() -> None:
    x = tone(440, 8000, 0.5)
    y = M.resample(x, 8000, 16000)
    assert len(y) == 8000 and abs(peak_hz(y, 16000) - 440) <= 2
    assert np.max(np.abs(y[::2][100:-100] - x[100:-100])) < 0.02   # the original samples stay where they were
    assert M.resample(x, 8000, 8000) is not None and np.array_equal(M.resample(x, 8000, 8000), x)


def test_load_audio_takes_samples_with_their_rate() -> None:
    x = tone(440, 22050, 0.5)
    for value in ((x, 22050), {"samples": x, "rate": 22050}, {"array": x.tolist(), "sampling_rate": 22050},
                  M.samples_to_wav(x.tolist(), 22050), pcm16_wav(x, 22050)):
        y = M.load_audio(value, LIMITS, 16000)
        assert len(y) == 8000 and abs(peak_hz(y, 16000) - 440) <= 3, type(value)
    with pytest.raises(M.MediaError, match="WAV file or samples with their rate"):
        M.load_audio("hello", LIMITS, 16000)
    with pytest.raises(M.MediaError, match="sample rate"):
        M.load_audio((x, "fast"), LIMITS, 16000)
    with pytest.raises(M.MediaError, match="at most 30 s"):
        M.load_audio((np.zeros(31 * 1000, np.float32), 1000), LIMITS, 16000)


# ------------------------------------------------------------------ images and video in the worker


def test_load_image_takes_files_pil_images_and_arrays() -> None:
    assert M.load_image(png(10, 8, mode="RGBA"), LIMITS).mode == "RGB"
    assert M.load_image(Image.new("L", (5, 5)), LIMITS).mode == "RGB"
    assert M.load_image(np.zeros((8, 10, 3), np.uint8), LIMITS).size == (10, 8)
    chw = M.load_image(np.ones((3, 8, 10), np.float32), LIMITS)        # (C, H, W) floats from 0 to 1
    assert chw.size == (10, 8) and chw.getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(M.MediaError, match="not an image"):
        M.load_image(np.zeros((4,), np.uint8), LIMITS)
    with pytest.raises(M.MediaError, match="a PIL image or an array"):
        M.load_image("cat.png", LIMITS)
    with pytest.raises(M.MediaError, match="at most 100 pixels"):
        M.load_image(Image.new("RGB", (20, 20)), M.MediaLimits(image=1, max_pixels=100))


def test_a_corrupt_image_body_fails_in_the_decoder() -> None:
    data = png(64, 64)
    broken = data[:40] + b"\0" * (len(data) - 40)          # the header is fine, the pixels are not
    assert M.image_info(broken).width == 64                  # the door lets it through ...
    with pytest.raises(M.MediaError, match="cannot be decoded"):
        M.load_image(broken, LIMITS)                         # ... the engine says what is wrong


def test_load_video_stacks_frames() -> None:
    video = M.load_video([png(16, 12)] * 4, LIMITS)
    assert video.shape == (4, 12, 16, 3) and video.dtype == np.uint8
    assert M.load_video(np.zeros((2, 12, 16, 3), np.uint8), LIMITS).shape == (2, 12, 16, 3)
    with pytest.raises(M.MediaError, match="not all the same size"):
        M.load_video([png(16, 12), png(8, 8)], LIMITS)
    with pytest.raises(M.MediaError, match="list of frames"):
        M.load_video(png(), LIMITS)


# ------------------------------------------------------------------ chats and models


def test_chat_for_a_prompt_puts_the_media_first() -> None:
    assert M.chat_for_media(None, "What is it?", {"image": 2}) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert M.chat_for_media(None, "", {"audio": 1}) == [{"role": "user", "content": [{"type": "audio"}]}]


def test_chat_with_placed_parts_must_match_the_items() -> None:
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
    assert M.chat_for_media(chat, "", {"image": 1}) is chat
    with pytest.raises(M.MediaError, match="1 image part"):
        M.chat_for_media(chat, "", {"image": 2})


def test_chat_without_parts_gets_the_media_in_its_last_user_message() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and this?"}]
    out = M.chat_for_media(chat, "", {"audio": 1})
    assert out[3]["content"] == [{"type": "audio"}, {"type": "text", "text": "and this?"}]
    assert chat[3]["content"] == "and this?"                 # the caller's chat is not changed
    with pytest.raises(M.MediaError, match="no user message"):
        M.chat_for_media([{"role": "system", "content": "x"}], "", {"image": 1})
    plain = [{"role": "user", "content": "hi"}]
    assert M.chat_for_media(plain, "", {}) is plain           # no media: the chat as it is


def test_detect_kinds_reads_config_json(tmp_path: Any) -> None:
    import json

    cases = {"llama": ({"model_type": "llama"}, ()),
             "llava": ({"vision_config": {}, "image_token_index": 3}, ("image",)),
             "qwen2_audio": ({"audio_config": {}}, ("audio",)),
             "qwen2_vl": ({"vision_config": {}, "video_token_id": 5}, ("image", "video")),
             "omni": ({"thinker_config": {"vision_config": {}, "audio_config": {}}}, ("image", "audio"))}
    for name, (config, kinds) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert M.detect_kinds(tmp_path / name) == kinds, name
    assert M.detect_kinds(tmp_path / "missing") == ()
    assert M.detect_kinds(None) == ()


def test_vllm_limits() -> None:
    assert M.MediaLimits(image=2, detected=("image",)).vllm_limits() == {"image": 2}
    assert M.MediaLimits(image=0, audio=1, detected=("image", "audio")).vllm_limits() == {"image": 0, "audio": 1}
    assert M.NO_MEDIA.vllm_limits() == {}


# ------------------------------------------------------------------ headers, byte by byte


@pytest.mark.parametrize("data,words", [
    (b"", "the file is empty"),
    (png(), "this is a PNG image"), (png(fmt="JPEG"), "this is a JPEG image"), (png(fmt="GIF"), "this is a GIF image"),
    (b"ID3\x04\0\0\0\0\0\0\0\0\0\0\0\0", "this is an MP3 file"), (b"fLaC\0\0\0\x22", "this is a FLAC file"),
    (b"OggS\0\x02", "this is an Ogg file"), (png(fmt="WEBP"), "this is a WebP image"), (b"%PDF-1.7", "this is a PDF"),
    (b"two\nlines\tand a tab", "this is text"), (b"hello world, 16!\xff", "this is text"),   # (its first 16 bytes)
    (b"a\tb", "it starts with bytes 61 09 62"), (b"\xff\xfe\x00\x01\x02\x03\x04\x05\x06", "it starts with bytes ff fe 00 "
                                                                                       "01 02 03 04 05)"),
    (b"RIFF\0\0\0\0AVI LIST", "it starts with bytes 52 49 46 46 00 00 00 00)"),
])
def test_not_a_wav_says_what_it_looks_like(data: bytes, words: str) -> None:
    with pytest.raises(M.MediaError) as e:
        M.wav_info(data)
    assert str(e.value) == f"not a WAV file ({words.removesuffix(')')})"


def test_not_an_image_reads_its_first_32_bytes() -> None:
    with pytest.raises(M.MediaError, match=r"; this is text\)$"):
        M.image_info(b"a" * 32 + b"\xff")
    with pytest.raises(M.MediaError, match="not an image"):          # an IHDR needs the PNG signature before it
        M.image_info(b"\0" * 12 + b"IHDR" + struct.pack(">II", 5, 5))
    with pytest.raises(M.MediaError) as e:
        M.image_info(png()[:20])
    assert str(e.value) == f"a truncated image (expected {M.IMAGE_FORMATS})"


def test_image_sizes_use_the_whole_unsigned_fields() -> None:
    big_png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR" + struct.pack(">II", 2**31, 3)
    assert M.image_info(big_png) == M.ImageInfo("PNG", 2**31, 3)
    for version in (b"GIF87a", b"GIF89a"):
        assert M.image_info(version + struct.pack("<HH", 40000, 2)) == M.ImageInfo("GIF", 40000, 2)
    bmp = b"BM" + b"\0" * 16 + struct.pack("<ii", 5, -7)        # 26 bytes; a top-down BMP's height is negative
    assert M.image_info(bmp) == M.ImageInfo("BMP", 5, 7)
    with pytest.raises(M.MediaError, match="not an image"):
        M.image_info(bmp[:25])


def webp(chunk: bytes, body: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(body)) + b"WEBP" + chunk + struct.pack("<I", len(body)) + body


def test_webp_headers_of_each_kind() -> None:
    vp8x = webp(b"VP8X", b"\x10\0\0\0" + (70000 - 1).to_bytes(3, "little") + (300 - 1).to_bytes(3, "little"))
    assert M.image_info(vp8x) == M.ImageInfo("WebP", 70000, 300)
    bits = (16384 - 1) | ((1000 - 1) << 14)
    vp8l = webp(b"VP8L", b"\x2f" + bits.to_bytes(4, "little") + b"\0" * 8)
    assert M.image_info(vp8l) == M.ImageInfo("WebP", 16384, 1000)
    # a lossy frame whose frame tag's first byte looks like VP8L's signature is still read as lossy
    vp8 = webp(b"VP8 ", b"\x2f\0\0" + b"\x9d\x01\x2a" + struct.pack("<HH", 0xC000 | 640, 0x4000 | 480) + b"\0" * 8)
    assert M.image_info(vp8) == M.ImageInfo("WebP", 640, 480)
    for bad in (webp(b"VP8L", b"\x00" + bits.to_bytes(4, "little") + b"\0" * 8),
                webp(b"VP8 ", b"\0\0\0\0\0\0" + b"\0" * 12), webp(b"vp8x", b"\0" * 18)):
        with pytest.raises(M.MediaError) as e:
            M.image_info(bad)
        assert str(e.value) == "a WebP file whose header cannot be read"
    with pytest.raises(M.MediaError, match="a WebP image of 0x480 pixels"):
        M.image_info(webp(b"VP8 ", b"\0\0\0" + b"\x9d\x01\x2a" + struct.pack("<HH", 0xC000, 480) + b"\0" * 8))


def jpeg(*segments: bytes) -> bytes:
    return b"\xff\xd8" + b"".join(segments)


def seg(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", 2 + len(body)) + body


def test_jpeg_header_walk() -> None:
    sof = seg(0xC0, b"\x08" + struct.pack(">HH", 40000, 50000) + b"\x03")
    assert M.image_info(jpeg(sof)) == M.ImageInfo("JPEG", 50000, 40000)
    # fill bytes, a second SOI, TEM, restart markers and an application segment before the frame header
    walk = jpeg(b"\xff\xff", b"\xff\xd8", b"\xff\x01", b"\xff\xd0", b"\xff\xd7", seg(0xE0, b"JFIF\0" + b"\0" * 9), sof)
    assert M.image_info(walk) == M.ImageInfo("JPEG", 50000, 40000)
    for marker in (0xC2, 0xCF):
        assert M.image_info(jpeg(seg(marker, sof[4:]))).height == 40000
    refused = "a JPEG without a frame header (truncated or not a JPEG)"
    for bad in (jpeg(seg(0xDA, b"\0" * 4), sof),        # image data before any frame header
                jpeg(b"\xff\xe1\x00\x01", sof),         # a length under 2
                jpeg(b"\xff\xe1\x00\x02", sof[:3]),     # a segment that ends where the file ends
                jpeg(b"\x00\x00", sof),                 # not a marker
                jpeg(b"\xff\xd9\x00\x00\x00", sof),     # EOI is no fill or restart marker: its "length" runs past
                b"\xff\xd8\xff\xd8"):
        with pytest.raises(M.MediaError) as e:
            M.image_info(bad)
        assert str(e.value) == refused, bad
    assert M.image_info(jpeg(b"\xff\xd8", sof)).width == 50000         # a marker ending 4 bytes before the frame header


def test_wav_headers_byte_by_byte() -> None:
    def refused(data: bytes) -> str:
        with pytest.raises(M.MediaError) as e:
            M.wav_info(data)
        return str(e.value)

    head = b"RIFF\0\0\0\0WAVE"
    fmt16 = struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16)
    assert refused(head) == "a WAV file without a format chunk"
    assert refused(b"RIFF\0\0\0\0WAVX") == "not a WAV file (it starts with bytes 52 49 46 46 00 00 00 00)"
    assert refused(b"RIFX\0\0\0\0WAVE") == "not a WAV file (it starts with bytes 52 49 46 58 00 00 00 00)"
    assert refused(head + b"data\0\0\0\0") == "a WAV file whose samples come before their format"
    assert refused(head + b"fmt \x10\0\0\0" + fmt16) == "a WAV file without samples (no data chunk)"
    assert refused(head + b"fmt \x08\0\0\0" + fmt16 + b"data\0\0\0\0") == "a WAV file with a truncated format chunk"
    assert refused(head + b"fmt \x10\0\0\0" + fmt16[:15]) == "a WAV file with a truncated format chunk"
    ext = struct.pack("<HHIIHHHHIH14s", 0xFFFE, 1, 8000, 16000, 2, 16, 22, 16, 4, 0x9999, b"\x00" * 14)
    assert refused(head + b"fmt " + struct.pack("<I", len(ext)) + ext + b"data\0\0\0\0") == \
        "a WAV file of format 39321 with 16-bit samples (omnid reads 8/16/24/32-bit PCM and 32/64-bit float)"
    for tag, bits in ((1, 33), (3, 16), (3, 65), (2, 16)):
        assert f"of format {tag} with {bits}-bit samples" in refused(M.wav_bytes(b"\0" * 8, 8000, bits=bits)[:20]
                                                                     + struct.pack("<H", tag)
                                                                     + M.wav_bytes(b"\0" * 8, 8000, bits=bits)[22:])
    for bits, floats in ((32, False), (32, True), (64, True)):
        info = M.wav_info(M.wav_bytes(b"\0" * 16, 8000, bits=bits, float_samples=floats))
        assert (info.bits, info.is_float, info.frames) == (bits, floats, 16 * 8 // bits)
    assert M.wav_info(M.wav_bytes(b"\0\0", 1)).rate == 1
    assert refused(M.wav_bytes(b"\0\0", 8000, channels=0)) == "a WAV file of 0 channels at 8000 Hz"
    assert refused(M.wav_bytes(b"\0\0", 0)) == "a WAV file of 1 channels at 0 Hz"


def test_check_media_at_each_bound_in_words() -> None:
    frame = png(4, 4)
    lim = M.MediaLimits(image=3, audio=2, video=1, max_video_frames=2, max_bytes=100_000, max_audio_s=0.5)

    def refused(kind: str, value: Any) -> str:
        with pytest.raises(M.MediaError) as e:
            M.check_media(kind, value, lim)
        return str(e.value)

    # video: frames counted and summed at their bounds
    assert M.check_media("video", [[frame, frame]], lim) == [{"frames": 2, "size": 2 * len(frame)}]
    assert refused("video", [[]]) == "a video without frames"
    assert refused("video", [[frame] * 3]) == ("a video of 3 frames; the stage takes at most 2 "
                                               "(media.max_video_frames)")
    big = M.MediaLimits(video=1, max_video_frames=2, max_bytes=2 * len(frame) - 1)
    with pytest.raises(M.MediaError, match=f"a video of {2 * len(frame)} bytes; the stage takes at most"):
        M.check_media("video", [[frame, frame]], big)
    assert M.check_media("video", [[frame, frame]], M.MediaLimits(video=1, max_video_frames=2, max_bytes=2 * len(frame)))
    assert M.check_media("video", np.zeros((2, 4, 4, 3), dtype=np.uint8), lim) == [{}]      # decoded frames
    # an item at max_bytes passes, one byte more does not
    assert M.check_media("image", png(8, 8, fmt="JPEG"), M.MediaLimits(image=1, max_bytes=len(png(8, 8, fmt="JPEG"))))
    # audio: exactly max_audio_s passes; no samples at all is refused; its length in ms
    assert M.check_media("audio", pcm16_wav(tone(440, 8000, 0.5), 8000), lim) == \
        [{"seconds": 0.5, "rate": 8000, "channels": 1}]
    assert M.check_media("audio", M.wav_bytes(b"\0\0" * 7, 8000), lim) == [{"seconds": 0.001, "rate": 8000,
                                                                             "channels": 1}]
    assert refused("audio", M.wav_bytes(b"", 8000)) == "a WAV file without samples"
    assert refused("audio", pcm16_wav(tone(440, 8000, 0.6), 8000)) == \
        "0.6 s of audio; the stage takes at most 0.5 s per clip (media.max_audio_s)"
    assert M.check_media("audio", M.wav_bytes(b"\0\0", 8000), lim)[0]["seconds"] == 0.0
    # how many, in words: a single item is named without a number, audio has no plural
    assert refused("audio", [M.wav_bytes(b"", 8000)] * 3) == "3 audio, but the stage takes at most 2 per job"
    assert refused("image", [frame] * 4) == "4 images, but the stage takes at most 3 per job"
    assert refused("video", [[frame], [frame]]) == "2 videos, but the stage takes at most 1 per job"
    assert refused("image", [b"x"]) .startswith("not an image")
    assert refused("image", [frame, b"x"]).startswith("image 2 of 2: not an image")
