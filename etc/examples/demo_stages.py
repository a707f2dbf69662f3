"""Custom `python` stages used by the demo configuration (etc/omnid-demo.toml).

They run inside stage worker processes (imported through the stage's
`python_path`), one call at a time, in the worker's main thread. Each is
`fn(inputs, params, ctx)`: it returns (or yields) a dict of named outputs,
polls `ctx.cancelled()` and reports `ctx.progress(done, total)`.
"""

from __future__ import annotations

import math
import struct
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


def wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream whose length is not known yet.

    The size fields say "as long as the file" (0xFFFFFFFF), as streaming servers write them:
    players read such a file to its end, so the header plus every PCM chunk, concatenated, is
    the whole WAV, and a client can play it while it is still being written.
    """
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def _tone(word: str, rate: int, seconds: float) -> bytes:
    freq = 220.0 + (sum(map(ord, word)) % 24) * 20.0
    n = int(rate * seconds)
    return b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * t / rate)
                                          * min(1.0, t / 200, (n - t) / 200)))
                    for t in range(n))


def vocoder(inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> Iterator[dict[str, Any]]:
    """A toy streaming vocoder: one tone per word, spoken as the text arrives.

    Its `text` input is either the whole text (a `window = -1` edge) or, on a streaming edge,
    an iterable of text windows that it speaks one by one while the LLM is still writing.
    Each segment is an audio chunk: the first one starts with a WAV header, so the `audio`
    output (all chunks, concatenated) is a WAV file, readable while it grows (`?stream=1`).
    """
    rate = int(params.get("sample_rate", 16000))
    seconds = float(params.get("seconds_per_word", 0.12))
    text = inputs.get("text", "")
    windows = [text] if isinstance(text, str) else text
    header = wav_header(rate)
    carry = ""                          # a word cut in two by a window's end waits for the rest
    spoken = 0
    for window in windows:
        words = (carry + str(window)).split(" ")
        carry = words.pop()             # the last piece may continue in the next window
        words = [w for w in words if w.strip()]
        if not words:
            continue
        spoken += len(words)
        yield {"audio": header + b"".join(_tone(w, rate, seconds) for w in words), "text": " ".join(words) + " "}
        header = b""
    last = carry.split() or ([] if spoken else ["..."])
    if last:
        yield {"audio": header + b"".join(_tone(w, rate, seconds) for w in last), "text": " ".join(last)}


# What each function produces, known before any job runs (omnid reads these lines from this file:
# `/v1/models` lists them, and an endpoint that needs another kind answers 400 at once).
frame.produces = ("image", "text")
vocoder.produces = ("audio", "text")
