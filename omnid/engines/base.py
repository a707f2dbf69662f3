"""The engine interface and the per-request context, as seen from inside a stage worker.

Runs in a stage worker's main thread only (engines are not thread-safe). An
engine is driven like vLLM's core busy loop: `add` a request, call `step`
until the request completes through its context (`finish`, `fail` or
`stopped`), `abort` on cancellation. A step-based interface lets engines that
batch (vLLM, `max_inflight > 1`) and engines that run one call to the end
(diffusers, a plain python function) share one worker loop. Which parameters a
job may pass an engine, and their rules, live in `omnid.params`.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Protocol

from omnid import protocol as P
from omnid.engines.capabilities import Capabilities
from omnid.vocabulary import ErrorCode


class Cancelled(Exception):
    """Raised inside an engine's callbacks to stop a cancelled request at once."""


class Outcome(StrEnum):
    """How a request ended in its stage (`RequestContext.outcome`), set once."""

    FINISHED = "finished"       # `finish`: its outputs are there
    FAILED = "failed"           # `fail`: `error` says why
    STOPPED = "stopped"         # `stopped`: aborted, the job ended meanwhile


@dataclass
class RequestContext:
    """One job's work inside one stage; also the `ctx` a python stage receives.

    A python stage function may call `ctx.cancelled()` (stop when true) and
    `ctx.progress(done, total)`; `ctx.job` and `ctx.stage` name the work, and `ctx.model` is the
    stage's `model` directory (resolved from the config file), if it names one.
    """

    job: str
    stage: str
    inputs: dict[str, Any]
    params: dict[str, Any]
    # The worker's hook for what the request reports as it runs: its progress, its segments' events.
    _emit: Callable[[P.Progress | P.Segment], None] = field(repr=False, default=lambda event: None)
    _is_cancelled: Callable[[], bool] = field(repr=False, default=lambda: False)
    _is_held: Callable[[], bool] = field(repr=False, default=lambda: False)
    # The worker's hook for each segment (streaming edges, live outputs); it returns an error that
    # fails the request, or None. (It must not hold the context: that would be a reference cycle
    # keeping the job's inputs, and their shared-memory slots, until the cyclic GC runs.)
    _on_segment: Callable[[dict[str, Any], bool], str | None] = field(repr=False, default=lambda outputs, is_last: None)
    started: float = field(default_factory=time.monotonic)
    # set exactly once, by finish / fail / stopped
    outcome: Outcome | None = None
    outputs: dict[str, Any] | None = None
    error: str | None = None
    error_code: ErrorCode | None = None     # the failure's code when not the stage's (a rejected input)
    segments: int = 0
    ended: float | None = None          # when the engine completed it (hand-off time not included)
    usage: dict[str, int] | None = None     # what an engine counts: {"prompt_tokens": N, "completion_tokens": M}
    # Why a text engine ended the answer, in vLLM's (and OpenAI's) words: "stop" (an end token, a stop
    # string) or "length" (max_tokens reached, or the context window full).
    finish_reason: str | None = None
    # The optional outputs asked of this request (a vllm stage's token_ids, hidden_states): an edge of
    # its pipeline maps them, or the stage's `outputs` names them. An engine computes no other.
    wants: frozenset[str] = frozenset()
    priority: int = 0               # the job's (lower runs earlier): a vllm stage passes it to its engine
    trace_headers: dict[str, str] | None = None     # the stage span of the job (`[daemon] tracing`): an engine
                                                    # with tracing of its own (vLLM) hangs its spans under it
    model: str | None = None        # the stage's `model` directory (python stages: the function's to load)
    # A stream's listener runs out of audio at this wall-clock time (time.time()), from the audio its
    # pipeline has sent (the supervisor's `Deadline`); None until its first audio. A sessions stage
    # steps the sessions that run dry first before the others.
    deadline: float | None = None
    # A streamed WAV output's bytes per second, by output name, from its first chunk's header.
    _wav: dict[str, int] = field(default_factory=dict, repr=False)

    def attach(self, *, emit: Callable[[P.Progress | P.Segment], None], is_cancelled: Callable[[], bool],
               is_held: Callable[[], bool], on_segment: Callable[[dict[str, Any], bool], str | None]) -> None:
        """The worker's hooks (omnid/worker: the job's, set before its engine sees it): where its
        progress and segment events go, whether its job was cancelled, whether its streamed output
        waits for room downstream, and what each segment feeds. Without them a context reports
        nowhere and is never cancelled nor held (a test's, a script's)."""
        self._emit, self._is_cancelled, self._is_held, self._on_segment = emit, is_cancelled, is_held, on_segment

    def cancelled(self) -> bool:
        return self._is_cancelled()

    def held(self) -> bool:
        """Its streamed output waits for room downstream: an engine that can pause (a generator)
        should not advance it yet."""
        return self._is_held()

    def progress(self, done: int, total: int) -> None:
        self._emit(P.Progress(job=self.job, done=int(done), total=int(total)))

    def segment(self, outputs: dict[str, Any], is_last: bool = False) -> None:
        """Stream one piece of output (token text, a preview, an audio chunk).

        It feeds the job's streaming edges (`window = N`) and, in a pipeline's last stage, the
        outputs clients read while the job runs; its text shows in the job's events.
        """
        if self.done:                       # it failed (or stopped) already: nothing more goes out
            return
        error = self._on_segment(outputs, is_last)
        if error is not None:
            self.fail(error)
        text = outputs.get("text") if isinstance(outputs.get("text"), str) else None
        if text is not None and len(text) > 2000:      # the event shows it; the output keeps it whole
            text = text[:2000] + " [...]"
        audio = audio_seconds(outputs, self._wav)
        self._emit(P.Segment(job=self.job, index=self.segments, is_last=is_last, text=text, audio_s=float(audio or 0.0),
                             finish_reason=self.finish_reason if is_last else None))
        self.segments += 1

    def finish(self, outputs: Mapping[str, Any]) -> None:
        if self.outcome is None:
            if not isinstance(outputs, dict):
                self.fail(f"stage returned {type(outputs).__name__}, not a dict of named outputs")
                return
            self.outcome, self.outputs = Outcome.FINISHED, outputs
            self.ended = time.monotonic()

    def fail(self, error: str, code: ErrorCode | None = None) -> None:
        """The request failed: `error` says why; `code` (an `ErrorCode`) when it is not the stage's
        failure, e.g. `input_rejected` for an input the engine refused."""
        if self.outcome is None:
            self.outcome, self.error, self.error_code = Outcome.FAILED, error, code

    def stopped(self) -> None:
        if self.outcome is None:
            self.outcome = Outcome.STOPPED

    @property
    def done(self) -> bool:
        return self.outcome is not None


class WindowSource(Protocol):
    """Where an `InputStream` reads its windows: one job's streaming edge, filled by the worker
    (`omnid.worker.windows.EdgeStream`)."""

    next_index: int             # the index of the next window expected

    def take(self, key: str) -> tuple[bool, Any]:
        """The next value for `key`: (True, value), or (False, None) after the last window; blocks
        until one arrives, raises `Cancelled` when the job is cancelled meanwhile."""

    def ready(self, key: str) -> bool:
        """`take(key)` would not block."""


class InputStream:
    """What a stage's function gets for an input fed by a streaming edge: an iterator of window values."""

    def __init__(self, stream: WindowSource, key: str) -> None:
        self._stream = stream
        self.key = key

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        ok, value = self._stream.take(self.key)
        if not ok:
            raise StopIteration
        return value

    def ready(self) -> bool:
        """The next `next()` would not block (a window is here, the stream ended, or the job was cancelled)."""
        return self._stream.ready(self.key)

    def __repr__(self) -> str:
        return f"<InputStream {self.key!r}: window {self._stream.next_index} next>"


class Engine(abc.ABC):
    """A loaded model that turns requests into outputs."""

    capabilities: ClassVar[Capabilities]        # what it can do, declared in capabilities.py

    @abc.abstractmethod
    def add(self, ctx: RequestContext) -> None:
        """Admit one request. May complete it at once (through ctx)."""

    @abc.abstractmethod
    def step(self) -> None:
        """Advance the in-flight requests; complete them through their contexts."""

    @abc.abstractmethod
    def abort(self, job: str) -> None:
        """Stop a request early; it completes with `ctx.stopped()`. Idempotent."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while some admitted request has not completed."""

    def ready(self) -> bool:
        """A `step` now would make progress; False while every request waits for streamed input."""
        return self.has_work()

    def wake(self) -> None:
        """Called from any thread when the worker has something new (a job, a window, a cancel):
        a `step` blocked waiting on an engine that computes on its own returns at once, with or
        without outputs. Others: nothing (their step computes, and is not waiting)."""

    def outputs_waiting(self) -> bool:
        """An engine that computes on its own while the worker does other work (vLLM's core in a
        process): its next step's outputs are there to take. Others: False (a step computes them)."""
        return False

    def on_step_ended(self, hook: Callable[[], None]) -> None:
        """The worker's hook for an engine that takes several steps of its own in one `step` (vLLM's
        core in a process, which steps on while the worker's loop runs): it calls `hook` between two,
        so that what each reported stays its own events (a token is one segment event). Others:
        nothing (a `step` is one step)."""

    def on_input_waiting(self, waiting: Callable[[], bool]) -> None:
        """The worker's probe, which a step may call (in the main thread): True while a job waits in
        the worker's input queue that its busy loop would take right after this step (a diffusers
        stage's step loop gives a long forward up for it). Others: nothing."""

    def set_adapters(self, adapters: Mapping[str, Path]) -> None:
        """The stage's LoRA adapters in force changed (added or removed at run time): serve these
        from now on. Jobs already running keep the adapter they started with. Others: nothing."""

    def info(self) -> dict[str, Any]:
        """Facts for `GET /v1/stages` (model, dtype, ...)."""
        return {}

    def live_info(self) -> dict[str, Any]:
        """The entries of `info` that change while the stage serves (a python stage's live sessions):
        each heartbeat carries them, and they replace those `Ready` gave. Called from the worker's
        heartbeat thread, so it only reads (a length, a copy)."""
        return {}

    def close(self) -> None:
        """Release the model (the worker exits right after)."""


def audio_seconds(outputs: Mapping[str, Any], wav: dict[str, int]) -> float:
    """Seconds of audio in one segment's bytes values: a streamed WAV's chunks (the first one starts
    with its RIFF header, which says the rate; `wav` remembers it by output name for the next)."""
    total = 0.0
    for name, value in outputs.items():
        if not isinstance(value, (bytes, bytearray)):
            continue
        data = bytes(value)
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE" and len(data) >= 44 and data[12:16] == b"fmt ":
            channels = int.from_bytes(data[22:24], "little")
            rate = int.from_bytes(data[24:28], "little")
            width = int.from_bytes(data[34:36], "little") // 8
            if channels and rate and width:
                wav[name] = channels * rate * width
            data = data[44:]
        per_s = wav.get(name)
        if per_s:
            total += len(data) / per_s
    return total
