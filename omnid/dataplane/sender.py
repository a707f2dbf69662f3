"""The data plane's sending end (see `omnid.dataplane`): `Sender`, one cached connection per
destination, used by a worker's hand-offs and the supervisor's feeders."""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from omnid.dataplane import shm
from omnid.dataplane.wire import (
    ACK_ADMITTED,
    ACK_FULL,
    BUSY_POLL_S,
    GPU_REQUEST,
    HEADER,
    IPC_ITEM,
    NO_IPC,
    OFFER_TIMEOUT_S,
    OFFSET,
    POLL_S,
    POOL_REQUEST,
    RESERVE,
    RESERVED,
    SHM_ITEM,
    NeedsPlain,
    RawItem,
    WorkItem,
    encode,
    recv_exact,
    recv_frame,
    send_frame,
)

log = structlog.get_logger("omnid.dataplane")


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
            sock.sendall(HEADER.pack(1 + OFFSET.size) + RESERVE + OFFSET.pack(encoded.size))
            answer = recv_exact(sock, 1)
            if answer == RESERVED:
                (base,) = OFFSET.unpack(recv_exact(sock, OFFSET.size))
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
