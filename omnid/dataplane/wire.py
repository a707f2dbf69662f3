"""The data plane's wire (see `omnid.dataplane`): the item a stage receives (`WorkItem`) and its
wire form (`RawItem`), the frames they travel in, and the bytes that say what a frame is."""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnid.dataplane import shm

ACK_ADMITTED = b"A"
ACK_DROPPED = b"D"
ACK_FULL = b"F"         # an offered window found no room: offer it again later
OFFER_TIMEOUT_S = 5.0   # an offer's answer comes at once; past this the receiver is stuck or gone
POLL_S = 0.1
BUSY_POLL_S = 0.0005    # while the caller has other work to step between polls
HEADER = struct.Struct(">Q")
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

    `rank` orders the job in every stage's queue (`omnid.fair_queue`: priority, fair-share tag,
    admission order), `priority` is what a vLLM stage passes its engine; `since` is when the
    job began to wait for this stage (wall clock; 0: when it reaches the queue), for the bound on waiting.
    `trace` carries the job's span context (`omnid.tracing`): each stage's span hangs under it.
    """

    job: str
    pipeline: str
    src: str | None
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    window: int | None = None
    last: bool = True
    routes: dict[str, int] = field(default_factory=dict)   # stage -> the replica that serves this job there
    rank: tuple[int, float, int] = (0, 0.0, 0)
    since: float = 0.0

    @property
    def priority(self) -> int:
        return self.rank[0]
    trace: dict[str, str] | None = None     # the job's trace context (W3C traceparent), when tracing is on


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


def recv_exact(sock: socket.socket, n: int) -> bytearray:
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
    sock.sendall(HEADER.pack(len(payload)))
    sock.sendall(payload)


def recv_frame(sock: socket.socket) -> bytearray:
    (size,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"data plane frame of {size} bytes is too large")
    return recv_exact(sock, size)


class Closing(Exception):
    """Raised by `admit` when the receiver is shutting down: the connection is closed without an
    answer, so the sender keeps the item and tries again (the next worker at that address takes it)."""
