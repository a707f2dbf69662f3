"""Server VAD for a realtime session: Silero VAD (v6, the ONNX file that the `silero-vad` package
ships, run by onnxruntime) says for each 32 ms of a session's input audio how likely it is speech;
a small state machine turns that into OpenAI's turns (speech started, speech stopped after
`silence_duration_ms` of silence).

Threads: the model runs in one of `VAD_THREADS` worker threads of this module's own pool
(`omnid-vad`), never on the supervisor's event loop; onnxruntime lets go of the GIL while it
computes (one intra-op thread a call: a session's 32 ms frame takes ~0.1 ms). The state machine
and the session's timeline run in the event-loop thread, in the session's own handler
(session.py awaits `Detector.feed` for each `input_audio_buffer.append`, so a session's frames are
judged in order). Nothing here imports torch: the package's `__init__` (which does) is never run;
only its data file is read, found with `importlib.util.find_spec`. numpy and onnxruntime are
imported in the worker thread, on the first session that uses server VAD.

Why a thread and not a stage of its own: a frame is 0.1 ms of model time, far less than a trip
through a worker's pipe and the job machinery; a thread keeps speech_started within one frame of
the audio that carries it. The measured cost is in tests/benchmarks/bench_vad.py and the README.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnid.supervisor.http.openai.realtime import events as E

VAD_RATE = 16000                        # Silero's rate: 512 samples (32 ms) a frame
FRAME = 512
CONTEXT = 64                            # the samples of the frame before, which the model reads too
IN_FRAME = FRAME * E.OPENAI_RATE // VAD_RATE   # 768 samples of the session's 24 kHz PCM16 a frame
FRAME_MS = FRAME * 1000 // VAD_RATE     # 32
VAD_THREADS = 2
HYSTERESIS = 0.15                       # speech goes on until the probability falls below threshold - this

_pool = ThreadPoolExecutor(max_workers=VAD_THREADS, thread_name_prefix="omnid-vad")
_lock = threading.Lock()
_model: Any = None


class VadUnavailable(RuntimeError):
    """The `vad` extra (onnxruntime, silero-vad) is not installed."""


def model_path() -> Path:
    """The packaged Silero VAD ONNX file (silero-vad's `data/silero_vad.onnx`), without importing
    the package (its `__init__` imports torch)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadUnavailable("server VAD needs the silero-vad package (pip install 'omnid[vad]')")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / "silero_vad.onnx"
        if path.is_file():
            return path
    raise VadUnavailable("the silero-vad package has no data/silero_vad.onnx")


def available() -> bool:
    """Server VAD can run here: onnxruntime and silero-vad's model file are installed."""
    try:
        model_path()
    except VadUnavailable:
        return False
    return importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("numpy") is not None


def _load() -> Any:
    """The ONNX session, loaded once (in a worker thread)."""
    global _model
    with _lock:
        if _model is None:
            try:
                import onnxruntime
            except ImportError:
                raise VadUnavailable("server VAD needs onnxruntime (pip install 'omnid[vad]')") from None
            opts = onnxruntime.SessionOptions()
            opts.inter_op_num_threads = 1
            opts.intra_op_num_threads = 1
            _model = onnxruntime.InferenceSession(str(model_path()), sess_options=opts,
                                                  providers=["CPUExecutionProvider"])
        return _model


def _probabilities(pcm: bytes, carry: bytes, state: Any, context: Any) -> tuple[list[float], bytes, Any, Any]:
    """Speech probabilities of each whole 32 ms frame in `carry + pcm` (PCM16 at 24 kHz, resampled to
    16 kHz by linear interpolation); what is left over; the model's state and context after it.
    Runs in a worker thread."""
    import numpy as np
    sess = _load()
    data = carry + pcm
    n = len(data) // (2 * IN_FRAME)
    if state is None:
        state = np.zeros((2, 1, 128), dtype=np.float32)
        context = np.zeros((1, CONTEXT), dtype=np.float32)
    probs: list[float] = []
    if n:
        x = np.frombuffer(data, dtype="<i2", count=n * IN_FRAME).astype(np.float32) / 32768.0
        at = np.arange(n * FRAME, dtype=np.float64) * (E.OPENAI_RATE / VAD_RATE)
        y = np.interp(at, np.arange(len(x)), x).astype(np.float32)
        sr = np.array(VAD_RATE, dtype=np.int64)
        for i in range(n):
            frame = y[i * FRAME:(i + 1) * FRAME].reshape(1, FRAME)
            out, state = sess.run(None, {"input": np.concatenate([context, frame], axis=1), "state": state, "sr": sr})
            context = frame[:, -CONTEXT:]
            probs.append(float(out[0][0]))
    return probs, data[n * 2 * IN_FRAME:], state, context


@dataclass
class VadEvent:
    """A turn's edge: `started` (at `ms`, the speech's first frame) or `stopped` (at `ms`, its end)."""

    kind: str                           # "started" | "stopped"
    ms: int                             # from the start of the session's input audio


@dataclass
class Detector:
    """One session's server VAD: its timeline (ms of input audio heard), the model's state, whether
    speech is under way. Owned by the session, fed in order from its handler."""

    threshold: float = 0.5
    silence_ms: int = 500
    heard_ms: int = 0                   # input audio judged so far (whole frames)
    speaking: bool = False
    speech_start_ms: int = 0
    silent_since: int | None = None     # the first silent frame of the pause under way
    _carry: bytes = b""
    _state: Any = None
    _context: Any = None
    frames: int = 0
    _busy: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def feed(self, pcm: bytes) -> list[VadEvent]:
        """PCM16 24 kHz mono appended by the client: the turn edges in it (the model in a worker thread)."""
        async with self._busy:
            loop = asyncio.get_running_loop()
            probs, self._carry, self._state, self._context = await loop.run_in_executor(
                _pool, _probabilities, pcm, self._carry, self._state, self._context)
            return self.judge(probs)

    def judge(self, probs: list[float]) -> list[VadEvent]:
        """The state machine over each frame's probability: speech starts on a frame at or over the
        threshold; it stops once frames under threshold - HYSTERESIS have lasted `silence_ms`."""
        out: list[VadEvent] = []
        for p in probs:
            at = self.heard_ms
            self.heard_ms += FRAME_MS
            self.frames += 1
            if not self.speaking:
                if p >= self.threshold:
                    self.speaking, self.speech_start_ms, self.silent_since = True, at, None
                    out.append(VadEvent("started", at))
                continue
            if p >= self.threshold - HYSTERESIS:
                self.silent_since = None
                continue
            if self.silent_since is None:
                self.silent_since = at
            if self.heard_ms - self.silent_since >= self.silence_ms:
                self.speaking = False
                out.append(VadEvent("stopped", self.silent_since))
                self.silent_since = None
        return out

    def reset(self) -> None:
        """The buffer was cleared or committed by hand: no speech under way (the model's state kept)."""
        self.speaking, self.silent_since = False, None


def warm() -> None:
    """Load the model now (in the calling thread): `omnid --check`-like callers and benchmarks."""
    _load()
