"""Custom `python` stages used by the demo configuration (etc/omnid-demo.toml).

They run inside stage worker processes (imported through the stage's
`python_path`), one call at a time, in the worker's main thread. Each is
`fn(inputs, params, ctx)`: it returns (or yields) a dict of named outputs,
polls `ctx.cancelled()` and reports `ctx.progress(done, total)`.
"""

from __future__ import annotations

import io
import math
import struct
import wave
from collections.abc import Iterator
from typing import Any


def frame(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Post-processing: upscale the image and print its prompt under it."""
    from PIL import Image, ImageDraw, ImageOps

    image = inputs["image"].convert("RGB")
    scale = int(params.get("scale", 4))
    image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    prompt = str(inputs.get("prompt", ""))
    border = int(params.get("border", 8))
    framed = ImageOps.expand(image, border=border, fill="white")
    canvas = Image.new("RGB", (framed.width, framed.height + 40), "white")
    canvas.paste(framed, (0, 0))
    ImageDraw.Draw(canvas).text((border, framed.height + 4), prompt[:60], fill="black")
    ctx.progress(1, 1)
    return {"image": canvas, "prompt": prompt}


def vocoder(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any]]:
    """A toy vocoder: one tone per word of the text, streamed as WAV chunks.

    Yields raw 16-bit PCM segments as it goes (streaming), then a final
    segment with the whole utterance as a WAV file.
    """
    rate = int(params.get("sample_rate", 16000))
    words = str(inputs.get("text", "")).split() or ["..."]
    pcm = bytearray()
    for i, word in enumerate(words):
        if ctx.cancelled():
            return
        freq = 220.0 + (sum(map(ord, word)) % 24) * 20.0
        n = int(rate * float(params.get("seconds_per_word", 0.12)))
        chunk = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * t / rate)
                                              * min(1.0, t / 200, (n - t) / 200)))
                         for t in range(n))
        pcm += chunk
        ctx.progress(i + 1, len(words))
        yield {"text": word + " "}
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(pcm))
    yield {"audio": buf.getvalue()}
