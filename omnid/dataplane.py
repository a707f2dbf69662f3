"""The data plane: copy-based stage-to-stage hand-off over Unix stream sockets.

Each stage worker listens on `<data_dir>/<stage>.sock`. An upstream stage (or
the supervisor's feeder, for a pipeline's first stages) connects and sends one
`WorkItem` per frame; the receiver answers with one byte only once the item
has entered its bounded input queue (`ACK_ADMITTED`) or was dropped because
its job is already over (`ACK_DROPPED`). So a sender is blocked exactly while
the receiver's queue is at its high watermark: that is the backpressure.

Two ways to send. `Sender.send` (a job's whole outputs, `window = -1` edges, and
the jobs' own inputs) blocks while the receiver is full. `Sender.offer` (one
window of a streamed job, `window = N` edges) never waits: the receiver answers
at once, `ACK_FULL` when it has no room, and the sender offers it again later
while it sends other jobs' windows. So a receiver busy with one job's stream can
never block the windows that job is waiting for behind another job's.

Frames are an 8-byte big-endian length and a pickle (protocol 5): a copy of
the payload, never shared memory. A later shared-memory data plane only has
to change `encode`/`decode` for large tensors.

Threads: `Sender.send` runs in the caller's thread and blocks on the socket
(polling `abandon()` every `POLL_S`); `Listener` runs one accept thread and
one reader thread per connection, each blocking in `recv` and in `admit`.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("omnid.dataplane")

ACK_ADMITTED = b"A"
ACK_DROPPED = b"D"
ACK_FULL = b"F"         # an offered window found no room: offer it again later
OFFER_TIMEOUT_S = 5.0   # an offer's answer comes at once; past this the receiver is stuck or gone
POLL_S = 0.1
BUSY_POLL_S = 0.0005    # while the caller has other work to step between polls
_HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 34


@dataclass
class WorkItem:
    """One stage's input for one job, from one upstream (`src` None: the job's inputs).

    `window` is None for a whole hand-off; on a streaming edge it is the window's index
    (0, 1, ...) and `last` marks the job's last window. Windows are offered (`Sender.offer`).
    """

    job: str
    pipeline: str
    src: str | None
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    window: int | None = None
    last: bool = True


def encode(item: WorkItem) -> bytes:
    return pickle.dumps(item, protocol=5)


def decode(data: bytes) -> WorkItem:
    item = pickle.loads(data)
    if not isinstance(item, WorkItem):
        raise ValueError(f"data plane frame is a {type(item).__name__}, not a WorkItem")
    return item


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the data connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)))
    sock.sendall(payload)


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"data plane frame of {size} bytes is too large")
    return _recv_exact(sock, size)


class Sender:
    """Blocking sender with one cached connection per destination stage.

    Used from one thread at a time (the worker's main loop, or one feeder thread).
    """

    def __init__(self, socket_for: Callable[[str], Path]) -> None:
        self._socket_for = socket_for
        self._conns: dict[str, socket.socket] = {}
        self.blocked_s = 0.0

    def _connect(self, dst: str) -> socket.socket:
        sock = self._conns.get(dst)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self._socket_for(dst)))
            except OSError:
                sock.close()
                raise
            self._conns[dst] = sock
        return sock

    def _drop(self, dst: str) -> None:
        sock = self._conns.pop(dst, None)
        if sock is not None:
            sock.close()

    def send(self, dst: str, item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool:
        """Deliver `item` to stage `dst`, waiting while its queue is full.

        Retries across a restart of `dst` (its socket comes back). Returns True
        once admitted or dropped by the receiver, False if `abandon()` became
        true first (the job ended, or this process is shutting down). While it
        waits, `on_wait()` is called between polls, every few ms while `busy()`.
        """
        def wait_tick() -> float:
            if on_wait is not None:
                on_wait()
            return BUSY_POLL_S if busy is not None and busy() else POLL_S

        payload = encode(item)
        start = time.monotonic()
        try:
            while not abandon():
                try:
                    sock = self._connect(dst)
                    sock.settimeout(None)
                    send_frame(sock, payload)
                    sock.settimeout(BUSY_POLL_S if busy is not None and busy() else POLL_S)
                    while True:
                        try:
                            ack = sock.recv(1)
                        except TimeoutError:
                            if abandon():
                                # The receiver may still admit it; it drops dead jobs itself.
                                self._drop(dst)
                                return False
                            sock.settimeout(wait_tick())
                            continue
                        if not ack:
                            raise ConnectionError("receiver closed before acknowledging")
                        return True
                except (OSError, ConnectionError):
                    self._drop(dst)
                    time.sleep(wait_tick())
            return False
        finally:
            self.blocked_s += time.monotonic() - start

    def offer(self, dst: str, item: WorkItem) -> bool | None:
        """Offer one window to stage `dst` without waiting for room.

        True: admitted. False: dropped (its job is over there). None: no room now, or `dst`
        is not reachable (restarting): offer it again later.
        """
        try:
            sock = self._connect(dst)
            sock.settimeout(OFFER_TIMEOUT_S)
            send_frame(sock, encode(item))
            ack = sock.recv(1)
        except (OSError, ConnectionError):
            self._drop(dst)
            return None
        if not ack:
            self._drop(dst)
            return None
        return None if ack == ACK_FULL else ack == ACK_ADMITTED

    def close(self) -> None:
        for dst in list(self._conns):
            self._drop(dst)


class Listener:
    """Accepts data connections for one stage and hands each item to `admit`.

    `admit(item)` blocks until the item is queued (returns True) or dropped
    (returns False); only then is the sender acknowledged. For a window
    (`item.window` set) it answers at once and may return None: no room, offer again.
    """

    def __init__(self, path: Path, admit: Callable[[WorkItem], bool | None]) -> None:
        self.path = path
        self._admit = admit
        try:
            os.unlink(path)          # a stale socket of a dead predecessor
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="data-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    item = decode(recv_frame(conn))
                except (OSError, ConnectionError):
                    return
                except Exception as e:  # a malformed frame: drop this connection, keep serving
                    log.warning("bad data frame", error=str(e))
                    return
                admitted = self._admit(item)
                try:
                    conn.sendall(ACK_FULL if admitted is None else ACK_ADMITTED if admitted else ACK_DROPPED)
                except OSError:
                    return
