"""Media inputs of vLLM stages: images, audio and video frames. What a value is, whether it fits a
stage's limits, and (in the stage worker) the decoded form vLLM takes.

Two sides, one module, so that the door and the engine cannot disagree:

- **The door** (the supervisor's event-loop thread, and `omnid --check`): standard library only.
  `image_info` and `wav_info` read a file's header, never its body (microseconds, whatever the
  file's size); `check_media` applies a stage's `MediaLimits` to a job's input and raises
  `MediaError`; `detect_kinds` reads what a model takes from its config.json; `samples_to_wav`
  turns JSON samples into a WAV file.
- **The stage worker** (its main thread, inside `VllmEngine.add`): `load_image`, `load_audio` and
  `load_video` decode with PIL and numpy, imported there (never at module import: the supervisor
  and omnictl stay light), and `resample` brings audio to the rate the model's feature extractor
  wants. `chat_for_media` builds the chat whose template writes the model's placeholders.

Nothing here imports torch or vLLM. Nothing blocks but the CPU work of decoding one job's media.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEDIA_KINDS = ("image", "audio", "video")
IMAGE_FORMATS = "PNG, JPEG, GIF, BMP or WebP"

DEFAULT_MAX_BYTES = 20 << 20            # one item's encoded size (a file; a video's frames together)
DEFAULT_MAX_PIXELS = 4096 * 4096        # an image's (or a video frame's) width x height
DEFAULT_MAX_AUDIO_S = 30.0              # one clip (Whisper-style encoders take 30 s windows)
DEFAULT_MAX_VIDEO_FRAMES = 64

# What makes a model's config.json say it takes a kind of media: the sub-config of its encoder,
# or the id of its placeholder token. (Checked at the top level and in a `thinker_config`, where
# Qwen's omni models keep theirs.)
_MARKERS: dict[str, tuple[str, ...]] = {
    "image": ("vision_config", "image_token_index", "image_token_id", "vision_tower", "mm_vision_tower",
              "visual", "embd_layer"),
    "audio": ("audio_config", "audio_token_index", "audio_token_id"),
    "video": ("video_token_index", "video_token_id"),
}


class MediaError(ValueError):
    """A media value that is not what it should be, or over a limit. The message says why, without
    naming the input: the caller (the door, the engine) does that."""


@dataclass(frozen=True)
class MediaLimits:
    """A vLLM stage's `[stages.NAME.media]`: how many items of each kind a job may give it (0: its
    model takes none) and how large each may be."""

    image: int = 0
    audio: int = 0
    video: int = 0
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_audio_s: float = DEFAULT_MAX_AUDIO_S
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    detected: tuple[str, ...] = ()      # the kinds the model's config.json says it takes

    def count(self, kind: str) -> int:
        return int(getattr(self, kind))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds a job may send this stage."""
        return tuple(k for k in MEDIA_KINDS if self.count(k) > 0)

    def vllm_limits(self) -> dict[str, int]:
        """vLLM's `limit_mm_per_prompt`: every kind the model takes, 0 for those turned off
        (vLLM then reserves no memory for them)."""
        return {k: self.count(k) for k in MEDIA_KINDS if k in self.detected or self.count(k) > 0}

    def as_api(self) -> dict[str, Any]:
        return {"image": self.image, "audio": self.audio, "video": self.video, "max_bytes": self.max_bytes,
                "max_pixels": self.max_pixels, "max_audio_s": self.max_audio_s,
                "max_video_frames": self.max_video_frames}


NO_MEDIA = MediaLimits()


def detect_kinds(model_dir: Path | None) -> tuple[str, ...]:
    """The kinds of media a model takes, by its config.json (none when there is none to read)."""
    if model_dir is None:
        return ()
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    if not isinstance(config, dict):
        return ()
    scopes = [config] + [config[k] for k in ("thinker_config",) if isinstance(config.get(k), dict)]
    return tuple(kind for kind in MEDIA_KINDS
                 if any(scope.get(marker) is not None for scope in scopes for marker in _MARKERS[kind]))


# ------------------------------------------------------------------ images: headers


@dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int
    height: int


def image_info(data: bytes | bytearray) -> ImageInfo:
    """The format and size of an encoded image, from its header; MediaError if it is none."""
    head = bytes(data[:32])
    try:
        if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
            width, height = struct.unpack(">II", head[16:24])
            return _sized("PNG", width, height)
        if head.startswith(b"\xff\xd8"):
            return _jpeg_info(data)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack("<HH", head[6:10])
            return _sized("GIF", width, height)
        if head.startswith(b"BM") and len(data) >= 26:
            width, height = struct.unpack("<ii", bytes(data[18:26]))
            return _sized("BMP", width, abs(height))
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_info(bytes(data[:64]))      # pragma: no mutate (equivalent: it reads 30 bytes)
    except struct.error:
        raise MediaError(f"a truncated image (expected {IMAGE_FORMATS})") from None
    raise MediaError(f"not an image (expected {IMAGE_FORMATS}; {_what(head)})")


def check_whole(info: ImageInfo, data: bytes | bytearray) -> None:
    """An encoded image that was cut short (a PNG without its IEND, a JPEG without its end marker):
    MediaError at the door, not a decoder's failure in the stage. Reads chunk lengths only."""
    if info.format == "PNG":
        _png_whole(data)
    elif info.format == "JPEG" and b"\xff\xd9" not in bytes(data[-4096:]):
        raise MediaError(f"a truncated JPEG ({len(data)} bytes, without its end-of-image marker)")


def _png_whole(data: bytes | bytearray) -> None:
    i, n = 8, len(data)
    while i + 8 <= n:
        (length,) = struct.unpack(">I", bytes(data[i:i + 4]))
        kind = bytes(data[i + 4:i + 8])
        end = i + 12 + length
        if end > n:
            raise MediaError(f"a truncated PNG ({n} bytes: its {kind.decode('latin-1')!r} chunk needs {end})")
        if kind == b"IEND":
            return
        i = end
    raise MediaError(f"a truncated PNG ({n} bytes, without its IEND chunk)")


def _sized(fmt: str, width: int, height: int) -> ImageInfo:
    if width <= 0 or height <= 0:
        raise MediaError(f"a {fmt} image of {width}x{height} pixels")
    return ImageInfo(fmt, width, height)


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_info(data: bytes | bytearray) -> ImageInfo:
    """Walk the JPEG's marker segments to its frame header (SOFn), which holds the size."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:                  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", bytes(data[i + 2:i + 4]))
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", bytes(data[i + 5:i + 9]))
            return _sized("JPEG", width, height)
        if marker == 0xDA or length < 2:    # image data began before any frame header
            break
        i += 2 + length
    raise MediaError("a JPEG without a frame header (truncated or not a JPEG)")


def _webp_info(head: bytes) -> ImageInfo:
    chunk = head[12:16]
    if chunk == b"VP8X":
        width = 1 + int.from_bytes(head[24:27], "little")
        height = 1 + int.from_bytes(head[27:30], "little")
        return _sized("WebP", width, height)
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return _sized("WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return _sized("WebP", width & 0x3FFF, height & 0x3FFF)
    raise MediaError("a WebP file whose header cannot be read")


def _what(head: bytes) -> str:
    """A few words on what a file that is not the expected kind looks like."""
    if not head:
        return "the file is empty"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "this is a WAV file"
    for magic, name in ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
                        (b"ID3", "an MP3 file"), (b"fLaC", "a FLAC file"), (b"OggS", "an Ogg file")):
        if head.startswith(magic):
            return f"this is {name}"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "this is a WebP image"
    if head[:4] == b"%PDF":
        return "this is a PDF"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"it starts with bytes {head[:8].hex(' ')}"
    return "this is text" if text.isprintable() or "\n" in text else f"it starts with bytes {head[:8].hex(' ')}"


# ------------------------------------------------------------------ audio: WAV headers

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


@dataclass(frozen=True)
class WavInfo:
    rate: int
    channels: int
    bits: int
    is_float: bool
    offset: int         # where the samples start
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def wav_info(data: bytes | bytearray) -> WavInfo:
    """A WAV file's format and length, from its chunks; MediaError if it is not one omnid reads.

    Reads PCM (8, 16, 24, 32 bit) and IEEE float (32, 64 bit) samples, plain or
    WAVE_FORMAT_EXTENSIBLE. A size field that runs past the end of the file (0xFFFFFFFF: a
    stream's header, written before its length was known) means "to the end of the file".
    (The standard library's `wave` reads neither float samples nor such streams.)
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise MediaError(f"not a WAV file ({_what(bytes(data[:16]))})")
    fmt: tuple[int, int, int, int] | None = None
    i, n = 12, len(data)
    while i + 8 <= n:
        cid = bytes(data[i:i + 4])
        (size,) = struct.unpack("<I", bytes(data[i + 4:i + 8]))
        body = i + 8
        if cid == b"fmt ":
            if size < 16 or body + 16 > n:
                raise MediaError("a WAV file with a truncated format chunk")
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", bytes(data[body:body + 16]))
            if tag == _EXTENSIBLE and size >= 40 and body + 26 <= n:
                (tag,) = struct.unpack("<H", bytes(data[body + 24:body + 26]))     # the sub-format GUID
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                raise MediaError("a WAV file whose samples come before their format")
            tag, channels, rate, bits = fmt
            if tag not in (_PCM, _FLOAT) or (tag == _PCM and bits not in (8, 16, 24, 32)) \
                    or (tag == _FLOAT and bits not in (32, 64)):
                raise MediaError(f"a WAV file of format {tag} with {bits}-bit samples (omnid reads "
                                 "8/16/24/32-bit PCM and 32/64-bit float)")
            if channels < 1 or rate < 1:
                raise MediaError(f"a WAV file of {channels} channels at {rate} Hz")
            length = min(size, n - body)
            frame = channels * bits // 8
            return WavInfo(rate, channels, bits, tag == _FLOAT, body, length // frame)
        i = body + size + (size & 1)
    raise MediaError("a WAV file without samples (no data chunk)" if fmt else "a WAV file without a format chunk")


def samples_to_wav(samples: Sequence[Any], rate: Any) -> bytes:
    """JSON samples (numbers from -1 to 1, mono) at `rate` Hz as a 32-bit float WAV file."""
    if isinstance(rate, bool) or not isinstance(rate, int) or not 1 <= rate <= 768_000:
        raise MediaError(f"\"rate\" must be a sample rate in Hz (an integer from 1 to 768000), not {rate!r}")
    if not isinstance(samples, list) or not samples:
        raise MediaError("\"samples\" must be a non-empty array of numbers")
    for x in samples:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise MediaError(f"\"samples\" must hold finite numbers only, not {x!r}")
    pcm = array("f", samples)
    if sys.byteorder != "little":
        pcm.byteswap()
    return wav_bytes(pcm.tobytes(), rate, channels=1, bits=32, float_samples=True)


def wav_bytes(pcm: bytes, rate: int, channels: int = 1, bits: int = 16, float_samples: bool = False) -> bytes:
    """A WAV file around little-endian samples."""
    frame = channels * bits // 8
    fmt = struct.pack("<HHIIHH", _FLOAT if float_samples else _PCM, channels, rate, rate * frame, frame, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(pcm)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(pcm)) + pcm)


# ------------------------------------------------------------------ the door


def as_items(kind: str, value: Any) -> list[Any]:
    """A media input's items: an image or audio input is one item or a list of them; a video
    input is one video (a list of frames, or an array of them) or a list of videos."""
    if kind == "video":
        if isinstance(value, list) and value and all(_is_video(v) for v in value):
            return list(value)
        return [value]
    if isinstance(value, list):
        return list(value)
    return [value]


def _is_video(value: Any) -> bool:
    return isinstance(value, list) or getattr(value, "ndim", 0) == 4


def check_media(kind: str, value: Any, limits: MediaLimits) -> list[dict[str, Any]]:
    """Check a job's `kind` input at the door against a stage's limits: the number of items and,
    for each encoded item (bytes), its type and size from its header. Returns a summary per item;
    MediaError says what is wrong (item numbers from 1 when there are several).

    Values that are not bytes (an upstream stage's image, say) are checked by the engine.
    """
    items = as_items(kind, value)
    allowed = limits.count(kind)
    if len(items) > allowed:
        raise MediaError(f"{len(items)} {_plural(kind, len(items))}, but the stage takes at most {allowed} per job")
    summaries = []
    for index, item in enumerate(items):
        where = f"{kind} {index + 1} of {len(items)}: " if len(items) > 1 else ""
        try:
            summaries.append(_check_item(kind, item, limits))
        except MediaError as e:
            raise MediaError(f"{where}{e}") from None
    return summaries


def _plural(kind: str, n: int) -> str:
    return kind if n == 1 or kind == "audio" else f"{kind}s"


def _check_item(kind: str, item: Any, limits: MediaLimits) -> dict[str, Any]:
    if kind == "video":
        frames = item if isinstance(item, list) else None
        if frames is None:
            return {}
        if not frames:
            raise MediaError("a video without frames")
        if len(frames) > limits.max_video_frames:
            raise MediaError(f"a video of {len(frames)} frames; the stage takes at most {limits.max_video_frames} "
                             "(media.max_video_frames)")
        size = sum(len(f) for f in frames if isinstance(f, (bytes, bytearray)))
        if size > limits.max_bytes:
            raise MediaError(f"a video of {size} bytes; the stage takes at most {limits.max_bytes} (media.max_bytes)")
        for i, frame in enumerate(frames):
            if isinstance(frame, (bytes, bytearray)):
                try:
                    info = image_info(frame)
                    _check_pixels(info, limits)
                    check_whole(info, frame)
                except MediaError as e:
                    raise MediaError(f"frame {i + 1}: {e}") from None
        return {"frames": len(frames), "size": size}
    if not isinstance(item, (bytes, bytearray)):
        return {}
    if len(item) > limits.max_bytes:
        raise MediaError(f"{len(item)} bytes; the stage takes at most {limits.max_bytes} per item (media.max_bytes)")
    if kind == "image":
        info = image_info(item)
        _check_pixels(info, limits)
        check_whole(info, item)
        return {"format": info.format, "width": info.width, "height": info.height}
    wav = wav_info(item)
    if wav.seconds > limits.max_audio_s:
        raise MediaError(f"{wav.seconds:.1f} s of audio; the stage takes at most {limits.max_audio_s:g} s per clip "
                         "(media.max_audio_s)")
    if wav.frames == 0:
        raise MediaError("a WAV file without samples")
    return {"seconds": round(wav.seconds, 3), "rate": wav.rate, "channels": wav.channels}


def _check_pixels(info: ImageInfo, limits: MediaLimits) -> None:
    if info.width * info.height > limits.max_pixels:
        raise MediaError(f"a {info.width}x{info.height} {info.format} image ({info.width * info.height} pixels); "
                         f"the stage takes at most {limits.max_pixels} pixels (media.max_pixels)")


# ------------------------------------------------------------------ chats


def chat_media_counts(messages: Any) -> dict[str, int]:
    """How many parts of each media kind a chat's messages hold (`{"type": "image"}`, ...)."""
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    if not isinstance(messages, list):
        return counts
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in counts:
                    counts[kind] += 1
    return counts


def chat_for_media(messages: list[dict[str, Any]] | None, text: str, counts: Mapping[str, int]) -> list[dict[str, Any]]:
    """The chat a model's template renders for a media job: each item is a `{"type": KIND}` part,
    where the template writes the model's placeholder (its processor then expands it into the
    item's tokens).

    - A prompt (`messages` None): one user message, the items first, then the text.
    - A chat whose messages place their media parts: as it is; its parts must match the items.
    - A chat without media parts: the items go first in its last user message (a chat without
      either: as it is).
    """
    if messages is not None and not any(counts.values()) and not any(chat_media_counts(messages).values()):
        return messages                 # a plain chat: as it is
    if messages is None:
        parts: list[dict[str, Any]] = [{"type": k} for k in MEDIA_KINDS for _ in range(counts.get(k, 0))]
        if text:
            parts.append({"type": "text", "text": text})
        return [{"role": "user", "content": parts}]
    placed = chat_media_counts(messages)
    if any(placed.values()):
        for kind in MEDIA_KINDS:
            if placed[kind] != counts.get(kind, 0):
                raise MediaError(f"the messages have {placed[kind]} {kind} part(s) but the job gives "
                                 f"{counts.get(kind, 0)} {_plural(kind, counts.get(kind, 0))}")
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise MediaError("the messages have no user message to put the media in")
    at = users[-1]
    content = messages[at].get("content")
    parts = [{"type": k} for k in MEDIA_KINDS for _ in range(counts.get(k, 0))]
    if isinstance(content, str):
        parts.append({"type": "text", "text": content})
    elif isinstance(content, list):
        parts += content
    out = [dict(m) for m in messages]
    out[at]["content"] = parts
    return out


# ------------------------------------------------------------------ the stage worker: decoding


def load_image(value: Any, limits: MediaLimits) -> Any:
    """An image input as an RGB PIL image: encoded bytes, a PIL image, or an array or tensor of
    (H, W, C) or (C, H, W) pixels (floats from 0 to 1, or 0 to 255 integers)."""
    from PIL import Image

    if isinstance(value, (bytes, bytearray)):
        if len(value) > limits.max_bytes:
            raise MediaError(f"{len(value)} bytes; the stage takes at most {limits.max_bytes} (media.max_bytes)")
        _check_pixels(image_info(value), limits)
        import io
        try:
            with Image.open(io.BytesIO(value)) as opened:
                opened.load()
                image = opened.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise MediaError(f"the image cannot be decoded: {e}") from None
        return image
    if isinstance(value, Image.Image):
        _check_pixels(ImageInfo("PIL", value.width, value.height), limits)
        return value.convert("RGB") if value.mode != "RGB" else value
    array_ = _as_array(value)
    if array_ is not None:
        return _array_image(array_, limits)
    raise MediaError(f"an image must be a file (PNG, JPEG, ...), a PIL image or an array of pixels, "
                     f"not {type(value).__name__}")


def _as_array(value: Any) -> Any:
    """A numpy array of an array or a torch tensor (without importing torch), else None."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):     # a torch tensor
        return value.detach().cpu().float().numpy()
    return None


def _array_image(a: Any, limits: MediaLimits) -> Any:
    import numpy as np
    from PIL import Image

    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)               # (C, H, W) -> (H, W, C)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise MediaError(f"an array of shape {tuple(a.shape)} is not an image (H, W, C)")
    _check_pixels(ImageInfo("array", int(a.shape[1]), int(a.shape[0])), limits)
    if a.dtype.kind == "f":
        a = np.clip(np.nan_to_num(a) * 255.0 + 0.5, 0, 255)
    a = np.ascontiguousarray(a.astype(np.uint8))
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    return Image.fromarray(a[:, :, :3], "RGB")


def load_audio(value: Any, limits: MediaLimits, rate: int) -> Any:
    """An audio input as float32 mono samples at `rate` Hz (a numpy array): a WAV file, or samples
    with their rate, as `(samples, rate)` or `{"samples": ..., "rate": ...}` (also `array` and
    `sampling_rate`, as Hugging Face writes them). Channels are averaged; the rate is converted
    with `resample`."""
    import numpy as np

    if isinstance(value, (bytes, bytearray)):
        samples, src = decode_wav(bytes(value))
    else:
        pair = _samples_and_rate(value)
        if pair is None:
            raise MediaError("audio must be a WAV file or samples with their rate ((samples, rate) or "
                             f"{{\"samples\", \"rate\"}}), not {type(value).__name__}")
        raw, src = pair
        arr = _as_array(raw)
        samples = np.asarray(raw if arr is None else arr, dtype=np.float32)
        if isinstance(src, bool) or not isinstance(src, (int, float)) or not 1 <= src <= 768_000:
            raise MediaError(f"the audio's rate must be a sample rate in Hz, not {src!r}")
        src = int(src)
        if samples.ndim == 2 and samples.shape[0] < samples.shape[1] and samples.shape[0] <= 8:
            samples = samples.T                 # (channels, frames) -> (frames, channels)
        if samples.ndim not in (1, 2):
            raise MediaError(f"audio samples of shape {tuple(samples.shape)}; expected (frames,) or (frames, channels)")
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if samples.size == 0:
        raise MediaError("audio without samples")
    if not np.all(np.isfinite(samples)):
        raise MediaError("audio samples that are not finite numbers")
    seconds = samples.shape[0] / src
    if seconds > limits.max_audio_s:
        raise MediaError(f"{seconds:.1f} s of audio; the stage takes at most {limits.max_audio_s:g} s per clip "
                         "(media.max_audio_s)")
    return resample(samples.astype(np.float32), src, rate)


def _samples_and_rate(value: Any) -> tuple[Any, Any] | None:
    if isinstance(value, tuple) and len(value) == 2:
        return value[0], value[1]
    if isinstance(value, Mapping):
        samples = value.get("samples", value.get("array"))
        rate = value.get("rate", value.get("sampling_rate", value.get("sample_rate")))
        if samples is not None and rate is not None:
            return samples, rate
    return None


def decode_wav(data: bytes) -> tuple[Any, int]:
    """A WAV file's samples as float32 from -1 to 1, shape (frames, channels), and its rate."""
    import numpy as np

    info = wav_info(data)
    frame = info.channels * info.bits // 8
    raw = data[info.offset:info.offset + info.frames * frame]
    if info.is_float:
        samples = np.frombuffer(raw, dtype="<f4" if info.bits == 32 else "<f8").astype(np.float32)
    elif info.bits == 8:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif info.bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16))
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / float(1 << 23)
    else:
        dtype = "<i2" if info.bits == 16 else "<i4"
        samples = np.frombuffer(raw, dtype=dtype).astype(np.float32) / float(1 << (info.bits - 1))
    return samples.reshape(-1, info.channels), info.rate


RESAMPLE_ZEROS = 8          # zero crossings of the sinc on each side (at the lower of the two rates)
RESAMPLE_BETA = 6.0         # the Kaiser window's shape (about 60 dB of stop-band attenuation)
_RESAMPLE_CHUNK = 8192      # output samples computed at once (bounds the memory of one step)


def resample(samples: Any, src: int, dst: int) -> Any:
    """Mono float32 samples from `src` Hz to `dst` Hz by band-limited interpolation: each output
    sample is the input convolved with a Kaiser-windowed sinc centred on its time, cut off at the
    lower rate's Nyquist frequency (times 0.95), so downsampling does not alias.

    Polyphase: output n sits at input time n * src / dst, whose fraction takes only dst / gcd
    values, so the filter's taps are computed once per phase and each output sample is one dot
    product. numpy only; about 3 ms per second of 44.1 kHz audio on one CPU core.
    """
    import numpy as np

    x = np.asarray(samples, dtype=np.float32)
    if src == dst or x.size == 0:
        return x
    n_out = max(1, (x.shape[0] * dst + src // 2) // src)
    cutoff = min(1.0, dst / src) * 0.95             # of the input's Nyquist frequency
    half = int(math.ceil(RESAMPLE_ZEROS / cutoff))  # taps on each side, in input samples
    offsets = np.arange(-half + 1, half + 1)
    g = math.gcd(src, dst)
    phases = dst // g                               # output n is at input base + (phase * g) / dst
    taps = _sinc_taps((np.arange(phases) * g / dst)[:, None] - offsets[None, :], cutoff, half)
    padded = np.concatenate([np.zeros(half, np.float32), x, np.zeros(half + 1, np.float32)])
    out: Any = np.empty(n_out, dtype=np.float32)
    for start in range(0, n_out, _RESAMPLE_CHUNK):
        n: Any = np.arange(start, min(n_out, start + _RESAMPLE_CHUNK), dtype=np.int64) * src
        base: Any = n // dst
        phase: Any = (n % dst) // g
        window = padded[base[:, None] + (offsets + half)[None, :]]
        out[start:start + n.shape[0]] = np.einsum("ij,ij->i", window, taps[phase])
    return out


def _sinc_taps(d: Any, cutoff: float, half: int) -> Any:
    """The Kaiser-windowed sinc at distances `d` (in input samples), as float32."""
    import numpy as np

    window = np.i0(RESAMPLE_BETA * np.sqrt(np.clip(1.0 - (d / half) ** 2, 0.0, 1.0))) / np.i0(RESAMPLE_BETA)
    return (cutoff * np.sinc(cutoff * d) * window).astype(np.float32)


def load_video(value: Any, limits: MediaLimits) -> Any:
    """A video input as a uint8 array of RGB frames, shape (frames, H, W, 3): a list of frames
    (each as `load_image` takes it) or an array of them."""
    import numpy as np

    array_ = _as_array(value)
    if array_ is not None:
        if array_.ndim != 4:
            raise MediaError(f"an array of shape {tuple(array_.shape)} is not a video (frames, H, W, C)")
        frames = [_array_image(f, limits) for f in array_]
    elif isinstance(value, list):
        frames = [load_image(f, limits) for f in value]
    else:
        raise MediaError(f"a video must be a list of frames or an array of them, not {type(value).__name__}")
    if not frames:
        raise MediaError("a video without frames")
    if len(frames) > limits.max_video_frames:
        raise MediaError(f"a video of {len(frames)} frames; the stage takes at most {limits.max_video_frames} "
                         "(media.max_video_frames)")
    size = frames[0].size
    if any(f.size != size for f in frames):
        raise MediaError("a video whose frames are not all the same size")
    return np.stack([np.asarray(f) for f in frames])
