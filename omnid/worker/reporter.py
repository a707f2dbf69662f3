"""What a stage worker tells the supervisor, over its control channel (`ControlChannel`): one
message at once (any thread), or a step's messages queued by the main thread and sent together, as
few pipe writes as keep each one atomic (`Reporter`). `clip` keeps a message's text small.

Runs in a stage worker's process: `send` in any of its threads, `post` and `flush` in its main
thread (the busy loop). A send blocks only while the pipe is full (the supervisor is frozen).

How long a message waits: an idle channel (the supervisor has read everything sent so far) sends
at once; a busy one (the supervisor has not read the last write yet) coalesces a step's text
segments with the next step's, so a supervisor that is behind gets fewer, larger messages rather
than a growing backlog of small ones. Whether the supervisor has
read is the kernel's count of unread bytes on the channel's socket (SIOCOUTQ); a channel without
one (a Ray actor's queues) is taken as idle. Held messages wait one engine step at most, and only
where the engine's steps are short (`Capabilities.short_steps`: vLLM's decode steps), and never
longer than BATCH_DELAY_S.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import struct
import termios
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
        self._step_starts: list[int] = []    # where in `_posted` an engine's next step began (`end_step`)
        self._flushed_at = 0.0
        self._held_since: float | None = None   # `_posted` kept back by a busy channel since then,
        self._held_count = 0                    # when it held this many messages
        self._unread = _unread_probe(conn)

    def send(self, msg: object) -> None:
        """Send one message to the supervisor now (any thread)."""
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(P.EXIT_ORPHANED)

    def post(self, msg: object) -> None:
        """Queue a message of the main thread: what one engine step says goes in one `Batch`.

        Messages that come rarely go at once (no latency is added to a slow stream: the channel is
        idle and nothing went for BATCH_DELAY_S); when they come fast (a batch of token streams)
        they wait for the end of the step (`flush`).
        """
        self._posted.append(msg)
        if time.monotonic() - self._flushed_at >= BATCH_DELAY_S and not self._busy():
            self.flush()

    def end_step(self) -> None:
        """An engine that takes several steps of its own in one `step` ended one: what it posted so
        far is never coalesced with what the next one posts (a token is one segment event)."""
        if self._posted and (not self._step_starts or self._step_starts[-1] != len(self._posted)):
            self._step_starts.append(len(self._posted))

    def flush(self, more_soon: bool = False) -> None:
        """Send the queued messages of the main thread, coalesced: a job's consecutive progress
        reports become the last one, its consecutive text segments one segment.

        `more_soon`: the caller flushes again after the next engine step (a short one). While the
        supervisor has not read the last write (a busy channel), segments and progress reports then
        wait for that flush, one step at most, and go in one write with the next step's (each step's
        segments stay their own segments: a token is one event, as the job's events promise); a
        job's first segment (its first token) and every other message go now."""
        now = time.monotonic()
        if not self._posted:
            self._flushed_at = now
            return
        if more_soon and self._can_hold(now):
            if self._held_since is None:
                self._held_since, self._held_count = now, len(self._posted)
            return
        self._flushed_at = now
        held = self._held_count if self._held_since is not None else 0
        self._held_since = None
        self._before_flush()                # a step's live output segments, for ?stream=1 readers
        cuts = sorted({0, held, *self._step_starts, len(self._posted)})
        messages = [m for a, b in zip(cuts, cuts[1:]) for m in _coalesce(self._posted[a:b])]
        self._posted, self._step_starts = [], []
        for data in _packs(messages):
            with self._send_lock:
                try:
                    self.conn.send_bytes(data)   # pickled once (`_packs` measured it), as send() would
                except (OSError, EOFError, BrokenPipeError):
                    os._exit(P.EXIT_ORPHANED)

    def _busy(self) -> bool:
        """The supervisor has not read all that was sent yet (False where that cannot be told)."""
        if self._unread is None:
            return False
        try:
            return self._unread() > 0
        except OSError:
            return False

    def _can_hold(self, now: float) -> bool:
        if self._held_since is not None and (len(self._posted) > self._held_count
                                             or now - self._held_since >= BATCH_DELAY_S):
            return False    # held over one step already (the next one said more): never two steps late
        if not all(isinstance(m, P.Progress) or (isinstance(m, P.Segment) and m.index > 0) for m in self._posted):
            return False
        return self._busy()


BATCH_DELAY_S = 0.01
# A pipe write of up to PIPE_BUF (4096) bytes is atomic: the supervisor never finds half of one,
# even when this worker freezes mid-send. Batches stay under it.
_MAX_PACK = 4000


def _unread_probe(conn: ControlChannel) -> Callable[[], int] | None:
    """A function giving the bytes written on `conn` that its reader has not read yet: SIOCOUTQ on
    the socket under a local worker's duplex pipe. None for a channel without a socket."""
    try:
        fd = conn.fileno()   # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None
    if not isinstance(fd, int):
        return None
    buf = bytes(4)

    def unread() -> int:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, buf))[0])

    try:
        unread()
    except OSError:
        return None
    return unread


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
                                count=prev.count + msg.count, audio_s=prev.audio_s + msg.audio_s,
                                finish_reason=msg.finish_reason)
            continue
        if isinstance(job, str):
            last[job] = len(out)
        out.append(msg)
    return out
