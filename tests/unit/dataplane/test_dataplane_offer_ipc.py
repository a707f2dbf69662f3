"""An offered window (`Sender.offer`, a `window = N` edge) whose CUDA tensor the receiver cannot open
by CUDA IPC is offered again, staged through the receiver's pool, and admitted: the same fallback
as `send`'s (tests/unit/dataplane/test_cuda_ipc.py), on the path that never waits.

On the CPU, with real sockets and a real pool; where CUDA itself would start, a stand-in driver
lends marked CPU tensors by a key and, like a receiver that sees the GPU but cannot open the
handle, refuses to open them.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnid.dataplane import cuda_ipc, shm, wire
from omnid.dataplane.cuda_ipc import IpcFailed, Lent
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem

pytestmark = pytest.mark.timeout(20)

MIB = 1 << 20
GPU = "c" * 32


class RefusingGpu:
    """Lends marked CPU tensors as if on GPU `GPU`; `receive` fails while `refuse` (the handle cannot
    be opened on the receiver's side) and copies the tensor otherwise."""

    def __init__(self) -> None:
        self.refuse = True
        self.marked: set[int] = set()
        self.exported: dict[bytes, Any] = {}
        self.lent = self.received = self.refused = 0
        self.lock = threading.Lock()

    def on_gpu(self, t: Any) -> Any:
        self.marked.add(id(t))
        return t

    def gpu_of(self, tensor: Any) -> str | None:
        return GPU if id(tensor) in self.marked else None

    def visible_gpus(self) -> tuple[str, ...]:
        return (GPU,)

    def lend(self, tensor: Any) -> tuple[Lent, Any] | None:
        handle = uuid.uuid4().bytes * 4
        with self.lock:
            self.exported[handle] = tensor
            self.lent += 1
        return Lent(gpu=GPU, handle=handle, offset=0, nbytes=tensor.numel() * tensor.element_size(),
                    dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape)), tensor

    def receive(self, lent: Lent) -> Any:
        with self.lock:
            if self.refuse:
                self.refused += 1
                raise IpcFailed("cannot open the handle here")
            self.received += 1
            return self.exported[lent.handle].clone()


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[RefusingGpu]:
    fake = RefusingGpu()
    monkeypatch.setattr(shm, "_on_device", lambda t: id(t) in fake.marked)
    cuda_ipc.use_driver(fake)
    try:
        yield fake
    finally:
        cuda_ipc.use_driver(None)


class Receiver(Listener):
    """A started listener on a GPU (it says so when asked) with a pool; it admits every window and
    counts the frames of each kind."""

    def __init__(self, path: Path, pool: shm.ShmPool) -> None:
        self.got: list[WorkItem] = []
        self.kinds: list[bytes] = []
        super().__init__(path, self._keep, pool, gpus=lambda: (GPU,))
        self.start()

    def _keep(self, item: WorkItem) -> bool:
        self.got.append(item)
        return True

    def _item(self, conn: Any, frame: bytearray, reserved: set[int]) -> WorkItem | None:
        self.kinds.append(bytes(frame[:1]))
        return super()._item(conn, frame, reserved)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="offer", dir="/tmp"))       # AF_UNIX paths: 107 bytes at most
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def window(t: Any, job: str, index: int = 0) -> WorkItem:
    return WorkItem(job=job, pipeline="p", src="up", inputs={"t": t}, window=index)


def test_an_offered_window_the_receiver_cannot_open_is_offered_again_staged(gpu: RefusingGpu,
                                                                            sock_dir: Path) -> None:
    pool = shm.ShmPool("down", 8 * MIB)
    rx = Receiver(sock_dir / "down.sock", pool)
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        t = gpu.on_gpu(torch.arange(MIB, dtype=torch.int32))
        assert tx.offer("down", window(t, "j1")) is True          # admitted, not "dropped" nor "no room"
        assert len(rx.got) == 1 and torch.equal(rx.got[0].inputs["t"], t)
        assert rx.kinds[:2] == [wire.GPU_REQUEST, wire.IPC_ITEM] and wire.SHM_ITEM in rx.kinds[2:]
        assert (gpu.lent, gpu.refused) == (1, 1)
        # The connection now knows: the next window goes staged at once, no second try by CUDA IPC.
        u = gpu.on_gpu(torch.full((MIB,), 7, dtype=torch.int32))
        assert tx.offer("down", window(u, "j1", 1)) is True
        assert len(rx.got) == 2 and torch.equal(rx.got[1].inputs["t"], u)
        assert rx.kinds.count(wire.IPC_ITEM) == 1 and gpu.refused == 1
        del rx.got[:]
        assert pool.usage() == (0, 0)                              # every slot given back
    finally:
        tx.close()
        rx.close()


def test_an_offered_window_goes_by_cuda_ipc_when_the_receiver_can_open_it(gpu: RefusingGpu,
                                                                          sock_dir: Path) -> None:
    gpu.refuse = False
    pool = shm.ShmPool("down", 8 * MIB)
    rx = Receiver(sock_dir / "down.sock", pool)
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        t = gpu.on_gpu(torch.arange(MIB, dtype=torch.int32))
        assert tx.offer("down", window(t, "j1")) is True
        assert rx.kinds == [wire.GPU_REQUEST, wire.IPC_ITEM] and torch.equal(rx.got[0].inputs["t"], t)
        assert (gpu.lent, gpu.received, gpu.refused) == (1, 1, 0)
    finally:
        tx.close()
        rx.close()
