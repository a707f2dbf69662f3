"""What a stage worker tells the supervisor, over its control channel (`ControlChannel`): one
message at once (any thread), or a step's messages queued by the main thread and sent together, as
few pipe writes as keep each one atomic (`Reporter`). `clip` keeps a message's text small.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from omnid import protocol as P


def clip(text: str, limit: int = 2000) -> str:
    """Keep control messages small: one write into the pipe, read whole by the supervisor."""
    return text if len(text) <= limit else text[:limit] + " [...]"


class ControlChannel(Protocol):
    """The worker's end of its control channel: the supervisor's messages in, its events out.

    A local worker's is its multiprocessing pipe (`Connection`); a Ray-placed one's is a pair of
    queues inside its actor (`omnid.worker.ray_actor`). `send_bytes` takes a pickled message."""

    def send(self, obj: Any) -> None: ...

    def send_bytes(self, buf: bytes) -> None: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


class Reporter:
    """What a worker tells the supervisor, over its control channel: at once (`send`, any thread),
    or queued by the main thread and sent together (`post`, `flush`). `before_flush` runs before
    each flush that sends something (the main thread's)."""

    def __init__(self, conn: ControlChannel, before_flush: Callable[[], None]) -> None:
        self.conn = conn
        self._before_flush = before_flush
        self._send_lock = threading.Lock()
        self._posted: list[object] = []      # main-thread messages not sent yet (`post`, `flush`)
        self._flushed_at = 0.0

    def send(self, msg: object) -> None:
        """Send one message to the supervisor now (any thread)."""
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(P.EXIT_ORPHANED)

    def post(self, msg: object) -> None:
        """Queue a message of the main thread: what one engine step says goes in one `Batch`.

        Messages that come rarely go at once (no latency is added to a slow stream); when they
        come fast (a batch of token streams) they wait for the end of the step, or BATCH_DELAY_S.
        """
        self._posted.append(msg)
        if time.monotonic() - self._flushed_at >= BATCH_DELAY_S:
            self.flush()

    def flush(self) -> None:
        """Send the queued messages of the main thread, coalesced: a job's consecutive progress
        reports become the last one, its consecutive text segments one segment."""
        self._flushed_at = time.monotonic()
        if not self._posted:
            return
        self._before_flush()                # a step's live output segments, for ?stream=1 readers
        messages = _coalesce(self._posted)
        self._posted = []
        for data in _packs(messages):
            with self._send_lock:
                try:
                    self.conn.send_bytes(data)   # pickled once (`_packs` measured it), as send() would
                except (OSError, EOFError, BrokenPipeError):
                    os._exit(P.EXIT_ORPHANED)


BATCH_DELAY_S = 0.01
# A pipe write of up to PIPE_BUF (4096) bytes is atomic: the supervisor never finds half of one,
# even when this worker freezes mid-send. Batches stay under it.
_MAX_PACK = 4000


def _packs(messages: list[object]) -> list[bytes]:
    """The messages, pickled as few Batches (or single messages) as keep each pipe write atomic."""
    data = pickle.dumps(messages[0] if len(messages) == 1 else P.Batch(tuple(messages)),
                        protocol=pickle.HIGHEST_PROTOCOL)
    if len(messages) == 1 or len(data) <= _MAX_PACK:
        return [data]
    half = len(messages) // 2
    return _packs(messages[:half]) + _packs(messages[half:])


def _coalesce(messages: list[object]) -> list[object]:
    """Merge each job's consecutive Progress (keep the last) and consecutive Segments (join texts)."""
    out: list[object] = []
    last: dict[str, int] = {}           # job -> index in `out` of its latest message
    for msg in messages:
        job = getattr(msg, "job", None)
        at = last.get(job) if isinstance(job, str) else None
        prev = out[at] if at is not None else None
        if isinstance(msg, P.Progress) and isinstance(prev, P.Progress) and at is not None:
            out[at] = msg
            continue
        if isinstance(msg, P.Segment) and isinstance(prev, P.Segment) and at is not None:
            text = None if prev.text is None and msg.text is None else (prev.text or "") + (msg.text or "")
            out[at] = P.Segment(job=msg.job, index=prev.index, is_last=msg.is_last, text=text,
                                count=prev.count + msg.count, audio_s=prev.audio_s + msg.audio_s)
            continue
        if isinstance(job, str):
            last[job] = len(out)
        out.append(msg)
    return out
