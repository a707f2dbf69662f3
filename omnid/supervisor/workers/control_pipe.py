"""The supervisor's end of one stage worker's control pipe, on the event loop.

Runs in the supervisor process's event-loop thread (the main thread); every method must be
called from it. Nothing here blocks: the pipe is read when `loop.add_reader` says it is
readable, and written only while `select` says it has room, so a frozen worker whose pipe
fills up never blocks the loop; what does not fit waits in a queue, sent by a
`loop.add_writer` callback when room comes back.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection


class ControlPipe:
    """A `multiprocessing` Connection watched by the running event loop.

    Each message read is handed to `on_message`, in order. At EOF (the worker closed its end
    or died) the pipe detaches itself: it stops watching, drops what it had queued, closes.
    """

    def __init__(self, conn: Connection, on_message: Callable[[object], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn: Connection | None = conn
        self._fd = conn.fileno()
        self._on_message = on_message
        self._outq: deque[object] = deque()     # control messages waiting for room in the pipe
        self._loop.add_reader(self._fd, self.drain)

    @property
    def closed(self) -> bool:
        return self._conn is None

    @property
    def queued(self) -> int:
        """Messages sent but still waiting for room in the pipe."""
        return len(self._outq)

    # ------------------------------------------------------------------ reading

    def drain(self) -> None:
        """Hand every message readable now to `on_message`; detach at EOF."""
        try:
            # (select, not Connection.poll: that builds and closes a selector per call, once per
            # message of every token stream; a Connection reads exact lengths, keeping no buffer)
            while self._conn is not None and select.select([self._fd], [], [], 0)[0]:
                msg = self._conn.recv()
                self._on_message(msg)
        except (EOFError, OSError):
            self.close()

    # ------------------------------------------------------------------ writing

    def send(self, msg: object) -> bool:
        """Queue a control message and send what fits now; never blocks. False once closed."""
        if self._conn is None:
            return False
        self._outq.append(msg)
        self._flush()
        return True

    def _flush(self) -> None:
        conn = self._conn
        if conn is None:
            self._outq.clear()
            return
        try:
            # Writable means PIPE_BUF bytes are free: one small message goes in whole, at once.
            while self._outq and select.select([], [self._fd], [], 0)[1]:
                conn.send(self._outq.popleft())
        except (OSError, ValueError):
            self._outq.clear()
            return
        if self._outq:
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        if self._conn is not None:
            self._loop.remove_writer(self._fd)
        self._flush()

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop watching the pipe, drop queued messages, close it (idempotent)."""
        self._outq.clear()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
        except (ValueError, OSError):
            pass
        conn.close()
