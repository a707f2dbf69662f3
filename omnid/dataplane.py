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

Frames are an 8-byte big-endian length and a payload. Small items are a plain
pickle (protocol 5). Large values (tensors, arrays, bytes from `shm_min_bytes`)
cross through the receiver's shared-memory pool (`omnid.shm`): the sender asks
for the pool once (`P`, answered with its memfd over SCM_RIGHTS), asks for room
(`R`: an offset, or FULL, which is backpressure like a full queue), copies the
values in, and sends the pickle that names them (`S`). The receiver builds them
on the pool's memory without copying.

A CUDA tensor for a receiver that sees its GPU goes by neither: the sender asks once per
connection which GPUs the receiver sees (`G`, answered with their UUIDs), lends such tensors
through CUDA IPC (`omnid.cuda_ipc`) and sends the pickle that names them (`I`, or `S` beside
pool values); the receiver copies each one on that GPU before it answers. A receiver that cannot
open one answers `NO_IPC` instead of an acknowledgement, and the sender sends the item again by
the staged path.

Threads: `Sender.send` runs in the caller's thread and blocks on the socket
(polling `abandon()` every `POLL_S`); `Listener` runs one accept thread and
one reader thread per connection, each blocking in `recv` and in `admit`.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from omnid import cuda_ipc, shm

log = structlog.get_logger("omnid.dataplane")

ACK_ADMITTED = b"A"
ACK_DROPPED = b"D"
ACK_FULL = b"F"         # an offered window found no room: offer it again later
OFFER_TIMEOUT_S = 5.0   # an offer's answer comes at once; past this the receiver is stuck or gone
POLL_S = 0.1
BUSY_POLL_S = 0.0005    # while the caller has other work to step between polls
_HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 34
OFFSET = struct.Struct(">Q")    # a pool offset or size in a frame (the Ray bridge reads it too)
# Payloads that are not a plain pickle (which starts with b"\x80") start with one of these:
POOL_REQUEST = b"P"     # -> b"P" + pool size, with the pool's memfd; or NO_POOL
RESERVE = b"R"          # + size -> b"O" + offset; ACK_FULL (no room now); NO_POOL (never room)
SHM_ITEM = b"S"         # + slot offset + pickle whose large values sit in that slot
RESERVED = b"O"
NO_POOL = b"N"
GPU_REQUEST = b"G"      # -> a frame: b"G" + the JSON list of the GPUs (UUIDs) the receiver sees
IPC_ITEM = b"I"         # + pickle whose large values are all CUDA tensors lent by CUDA IPC
NO_IPC = b"X"           # instead of an ack: a lent tensor could not be opened; send it staged


@dataclass
class WorkItem:
    """One stage's input for one job, from one upstream (`src` None: the job's inputs).

    `pipeline` is the key of the definition the job runs on: the pipeline's name, or
    `name~N` once a config reload changed it (jobs in flight keep their definition).

    `window` is None for a whole hand-off; on a streaming edge it is the window's index
    (0, 1, ...) and `last` marks the job's last window. Windows are offered (`Sender.offer`).

    `routes` pins the job to one replica of each stage (the supervisor chose them by load); every
    hand-off, window and resend of the job goes to that replica (0 when a stage has one).
    """

    job: str
    pipeline: str
    src: str | None
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    window: int | None = None
    last: bool = True
    routes: dict[str, int] = field(default_factory=dict)   # stage -> the replica that serves this job there


@dataclass
class RawItem:
    """A `WorkItem` in its wire form, passed on without being rebuilt (the Ray bridge: the supervisor
    never imports torch). `payload` is a pickle; with `buf`, one made by `shm.encode`, whose large
    values sit in `buf` (a uint8 array or any buffer of `size` bytes) at their offsets, as in a slot."""

    payload: bytes
    buf: Any = None
    size: int = 0
    job: str = ""               # for logs only (the bridge does not unpickle the item)
    release: Callable[[], None] | None = None   # frees the shared-memory slot `buf` sits on

    def encoded(self) -> shm.Encoded | None:
        if self.buf is None:
            return None
        return shm.Encoded(self.payload, [(shm.blob(self.size), self.buf)], self.size)


class NeedsPlain(Exception):
    """A `RawItem` with large values cannot go to a receiver without a pool (or with a smaller one):
    its sender must send it again as a plain pickle."""


def encode(item: WorkItem) -> bytes:
    return pickle.dumps(item, protocol=5)


def decode(data: bytes | bytearray) -> WorkItem:
    item = pickle.loads(data)
    if not isinstance(item, WorkItem):
        raise ValueError(f"data plane frame is a {type(item).__name__}, not a WorkItem")
    return item


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        if not k:
            raise ConnectionError("peer closed the data connection")
        got += k
    return buf


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)))
    sock.sendall(payload)


def recv_frame(sock: socket.socket) -> bytearray:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"data plane frame of {size} bytes is too large")
    return _recv_exact(sock, size)


class Sender:
    """Blocking sender with one cached connection per destination stage.

    Used from one thread at a time (the worker's main loop, or one feeder thread).
    `shm_min_bytes`: values from this size go through the receiver's shared-memory pool.
    """

    def __init__(self, socket_for: Callable[[str], Path], shm_min_bytes: int = shm.DEFAULT_MIN_BYTES) -> None:
        self._socket_for = socket_for
        self._conns: dict[str, socket.socket] = {}
        self._pools: dict[str, mmap.mmap | None] = {}    # dst -> its pool, mapped here (None: it has none)
        self._gpus: dict[str, tuple[str, ...]] = {}      # dst -> the GPUs it sees (its CUDA IPC peers)
        self.shm_min_bytes = shm_min_bytes
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
        self._gpus.pop(dst, None)
        sock = self._conns.pop(dst, None)
        if sock is not None:
            sock.close()
        pool = self._pools.pop(dst, None)     # a new connection may reach a new incarnation's pool
        if pool is not None:
            try:
                pool.close()
            except BufferError:                # a copy into it was cut short: unmapped when collected
                pass

    def prune(self) -> None:
        """Drop the connections whose receiver went away (a worker that died), and with them the
        dead receiver's pool mapping: its memory is freed now, not at the next hand-off to it."""
        if not self._conns:
            return
        socks = {sock: dst for dst, sock in self._conns.items()}
        readable, _, _ = select.select(list(socks), [], [], 0)
        for sock in readable:               # a receiver never speaks first: readable means closed
            try:
                gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                self._drop(socks[sock])

    def _pool(self, dst: str, sock: socket.socket) -> mmap.mmap | None:
        """The destination's pool, mapped on first use on this connection."""
        if dst not in self._pools:
            send_frame(sock, POOL_REQUEST)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 + OFFSET.size, 1)
            if not msg:
                raise ConnectionError("receiver closed before answering")
            if msg[:1] == POOL_REQUEST and fds:
                try:
                    (size,) = OFFSET.unpack(msg[1:1 + OFFSET.size])
                    self._pools[dst] = mmap.mmap(fds[0], size)
                finally:
                    for fd in fds:
                        os.close(fd)
            else:
                for fd in fds:
                    os.close(fd)
                self._pools[dst] = None
        return self._pools[dst]

    def gpus_of(self, dst: str, sock: socket.socket) -> tuple[str, ...]:
        """The GPUs the destination sees (UUIDs), asked once per connection."""
        if dst not in self._gpus:
            send_frame(sock, GPU_REQUEST)
            answer = recv_frame(sock)
            gpus = json.loads(bytes(answer[1:])) if answer[:1] == GPU_REQUEST else []
            self._gpus[dst] = tuple(str(g) for g in gpus)
        return self._gpus[dst]

    def _frame(self, dst: str, sock: socket.socket, encodings: _Encodings | None,
               plain: Callable[[], bytes]) -> bytes | None:
        """The frame that carries `item`: its CUDA tensors lent when the destination sees their GPU,
        its other large values through the pool when the destination has room (None: no room
        now), else a plain pickle."""
        if encodings is None:
            return plain()
        encoded = encodings.staged
        if encoded.cuda:
            encoded = encodings.lending(self.gpus_of(dst, sock))
        if encoded.lent:
            log.debug("lent by CUDA IPC", dst=dst, tensors=len(encoded.lent),
                      bytes=sum(lent.nbytes for lent, _ in encoded.lent))
        if not encoded.large:
            return IPC_ITEM + encoded.payload if encoded.lent else plain()
        pool = self._pool(dst, sock)
        if pool is not None:
            sock.sendall(_HEADER.pack(1 + OFFSET.size) + RESERVE + OFFSET.pack(encoded.size))
            answer = _recv_exact(sock, 1)
            if answer == RESERVED:
                (base,) = OFFSET.unpack(_recv_exact(sock, OFFSET.size))
                shm.copy_in(pool, base, encoded)
                return SHM_ITEM + OFFSET.pack(base) + encoded.payload
            if answer == ACK_FULL:
                return None
        return plain()                      # no pool there, or the values are larger than it

    def send(self, to: str | Callable[[], str], item: WorkItem, abandon: Callable[[], bool],
             on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool:
        """Deliver `item` to the worker at address `to`, waiting while its queue is full.

        `to` may be a callable, asked again at every attempt: the job may be rerouted to another
        replica while it waits (the one it had was given up).

        Retries across a restart of the worker (its socket comes back), and across its
        shutdown (a worker that stops, to sleep, closes without acknowledging). Returns True
        once admitted or dropped by the receiver, False if `abandon()` became
        true first (the job ended, or this process is shutting down). While it
        waits, `on_wait()` is called between polls, every few ms while `busy()`.
        """
        def wait_tick() -> float:
            if on_wait is not None:
                on_wait()
            return BUSY_POLL_S if busy is not None and busy() else POLL_S

        plain: list[bytes] = []

        def pickled() -> bytes:
            if not plain:
                plain.append(encode(item))
            return plain[0]

        return self._send(to, _Encodings(item, self.shm_min_bytes), pickled, abandon, on_wait, busy)

    def send_raw(self, to: str | Callable[[], str], raw: RawItem, abandon: Callable[[], bool],
                 on_wait: Callable[[], None] | None = None, busy: Callable[[], bool] | None = None) -> bool:
        """`send` for an item in its wire form; raises NeedsPlain when the receiver has no pool for
        its large values."""
        return self._send(to, _Encodings.of(raw.encoded()), lambda: _plain(raw), abandon, on_wait, busy)

    def offer_raw(self, dst: str, raw: RawItem) -> bool | None:
        """`offer` for an item in its wire form (NeedsPlain: as for `send_raw`)."""
        return self._offer(dst, _Encodings.of(raw.encoded()), lambda: _plain(raw))

    def _send(self, to: str | Callable[[], str], encoded: _Encodings | None, pickled: Callable[[], bytes],
              abandon: Callable[[], bool], on_wait: Callable[[], None] | None,
              busy: Callable[[], bool] | None) -> bool:
        def wait_tick() -> float:
            if on_wait is not None:
                on_wait()
            return BUSY_POLL_S if busy is not None and busy() else POLL_S

        start = time.monotonic()
        dst = ""
        try:
            while not abandon():
                dst = to() if callable(to) else to
                try:
                    sock = self._connect(dst)
                    sock.settimeout(None)
                    frame = self._frame(dst, sock, encoded, pickled)
                    if frame is None:          # the pool is full: wait, like at a full queue
                        time.sleep(wait_tick())
                        continue
                    send_frame(sock, frame)
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
                        break
                    if ack == NO_IPC:           # it could not open our lent tensors: stage them
                        self._gpus[dst] = ()
                        continue
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
        return self._offer(dst, _Encodings(item, self.shm_min_bytes), lambda: encode(item))

    def _offer(self, dst: str, encoded: _Encodings | None, pickled: Callable[[], bytes]) -> bool | None:
        try:
            sock = self._connect(dst)
            sock.settimeout(OFFER_TIMEOUT_S)
            frame = self._frame(dst, sock, encoded, pickled)
            if frame is None:
                return None                 # the pool is full
            send_frame(sock, frame)
            ack = sock.recv(1)
            if ack == NO_IPC:               # it could not open our lent tensors: offer them staged
                self._gpus[dst] = ()
                frame = self._frame(dst, sock, encoded, pickled)
                if frame is None:
                    return None
                send_frame(sock, frame)
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


class _Encodings:
    """One item's wire forms: staged (no GPU known), and lending to each set of receiver GPUs
    asked for (made once each: lending exports its CUDA tensors and holds them)."""

    def __init__(self, item: Any, min_bytes: int, staged: shm.Encoded | None = None) -> None:
        self._item = item
        self._min_bytes = min_bytes
        self.staged = staged if staged is not None else shm.encode(item, min_bytes)
        self._lending: dict[tuple[str, ...], shm.Encoded] = {}

    @classmethod
    def of(cls, encoded: shm.Encoded | None) -> _Encodings | None:
        """An item already in its wire form (a `RawItem`: no CUDA tensor is left in it)."""
        return None if encoded is None else cls(None, 0, encoded)

    def lending(self, gpus: tuple[str, ...]) -> shm.Encoded:
        if not gpus:
            return self.staged
        if gpus not in self._lending:
            self._lending[gpus] = shm.encode(self._item, self._min_bytes, gpus)
        return self._lending[gpus]


def _plain(raw: RawItem) -> bytes:
    if raw.buf is not None:
        raise NeedsPlain("the receiver has no shared-memory pool for this item's large values")
    return raw.payload


class Closing(Exception):
    """Raised by `admit` when the receiver is shutting down: the connection is closed without an
    answer, so the sender keeps the item and tries again (the next worker at that address takes it)."""


class Listener:
    """Accepts data connections for one stage and hands each item to `admit`.

    `admit(item)` blocks until the item is queued (returns True) or dropped
    (returns False); only then is the sender acknowledged. For a window
    (`item.window` set) it answers at once and may return None: no room, offer again.
    """

    def __init__(self, path: Path, admit: Callable[[Any], bool | None], pool: shm.ShmPool | None = None,
                 device: str | None = None, gpus: Callable[[], tuple[str, ...]] | None = None) -> None:
        self.path = path
        self._admit = admit
        self.pool = pool                # large values from senders land here (None: all by socket)
        self._device = device           # where tensors that left a GPU go ("cuda"), or None
        self._gpus = gpus               # the GPUs we see, for senders' CUDA IPC (None: none, all staged)
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

    def close(self) -> None:
        """Take no new connection (a worker that shuts down); the path stays for its successor."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reserved: set[int] = set()      # slots this sender asked for and has not filled yet
        try:
            with conn:
                while True:
                    try:
                        frame = recv_frame(conn)
                        item = self._item(conn, frame, reserved)
                    except (OSError, ConnectionError):
                        return
                    except Exception as e:  # a malformed frame: drop this connection, keep serving
                        log.warning("bad data frame", error=str(e))
                        return
                    if item is None:
                        continue            # a pool request or a reservation, answered
                    try:
                        admitted = self._admit(item)
                    except Closing:
                        return              # no answer: the sender keeps it and retries elsewhere/later
                    except Exception as e:  # the receiver could not take it: say dropped, keep serving
                        log.exception("admitting a data item failed", job=item.job, error=str(e))
                        admitted = False
                    del item                # a dropped item's values free their slot now
                    try:
                        conn.sendall(ACK_FULL if admitted is None else ACK_ADMITTED if admitted else ACK_DROPPED)
                    except OSError:
                        return
        finally:
            if self.pool is not None:
                for offset in reserved:     # the sender went away between asking and sending
                    self.pool.release(offset)

    def _item(self, conn: socket.socket, frame: bytearray, reserved: set[int]) -> WorkItem | None:
        """The item a frame carries, or None after answering a pool request or a reservation."""
        kind = bytes(frame[:1])
        if kind == GPU_REQUEST:
            send_frame(conn, GPU_REQUEST + json.dumps(list(self._gpus()) if self._gpus else []).encode())
            return None
        if kind == IPC_ITEM:
            return self._lent_item(conn, memoryview(frame)[1:], None, 0)
        if kind == POOL_REQUEST:
            if self.pool is None:
                conn.sendall(NO_POOL)
            else:
                socket.send_fds(conn, [POOL_REQUEST + OFFSET.pack(self.pool.capacity)], [self.pool.fd])
            return None
        if kind == RESERVE:
            (size,) = OFFSET.unpack(frame[1:1 + OFFSET.size])
            if self.pool is None or size > self.pool.capacity:
                conn.sendall(NO_POOL)
                return None
            offset = self.pool.reserve(size)
            if offset is None:
                conn.sendall(ACK_FULL)
                return None
            reserved.add(offset)
            conn.sendall(RESERVED + OFFSET.pack(offset))
            return None
        if kind == SHM_ITEM:
            (base,) = OFFSET.unpack(frame[1:1 + OFFSET.size])
            if self.pool is None or base not in reserved:
                raise ValueError(f"a shared-memory item in a slot ({base}) this connection did not reserve")
            reserved.discard(base)
            return self._lent_item(conn, memoryview(frame)[1 + OFFSET.size:], self.pool, base)
        return decode(frame)

    def _lent_item(self, conn: socket.socket, payload: memoryview, pool: shm.ShmPool | None,
                   base: int) -> WorkItem | None:
        """An item whose values sit in a slot or are lent by CUDA IPC; None (answered NO_IPC) when
        a lent tensor cannot be opened here: the sender sends it again, staged."""
        try:
            obj = shm.decode(payload, pool, base, self._device)
        except cuda_ipc.IpcFailed as e:
            log.warning("a tensor lent by CUDA IPC could not be opened: asking for it staged", error=str(e))
            conn.sendall(NO_IPC)
            return None
        if not isinstance(obj, WorkItem):
            raise ValueError(f"data plane frame is a {type(obj).__name__}, not a WorkItem")
        return obj
