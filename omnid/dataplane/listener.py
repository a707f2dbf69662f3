"""The data plane's receiving end (see `omnid.dataplane`): `Listener`, one stage's socket, an
accept thread and a reader thread per connection, each item handed to `admit`."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from omnid.dataplane import cuda_ipc, shm
from omnid.dataplane.wire import (
    ACK_ADMITTED,
    ACK_DROPPED,
    ACK_FULL,
    GPU_REQUEST,
    IPC_ITEM,
    NO_IPC,
    NO_POOL,
    OFFSET,
    POOL_REQUEST,
    RESERVE,
    RESERVED,
    SHM_ITEM,
    Closing,
    WorkItem,
    decode,
    recv_frame,
    send_frame,
)

log = structlog.get_logger("omnid.dataplane")


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
