"""The same-GPU CUDA IPC path of the data plane, on the CPU, up to where CUDA starts.

What is proven here: which path a tensor takes (same GPU -> lent by CUDA IPC; another GPU, a
receiver on the CPU, no CUDA driver, a Ray bridge -> staged), the wire form of a lent tensor
(a small record, no slot, no bytes of the tensor), the GPU request on real sockets, a receiver
that cannot open a lent tensor making the sender send it again staged, and that a host without
the CUDA driver loads none and stages everything.

Where CUDA itself would start (exporting and opening the memory handle, the device copy) a
stand-in driver (`FakeGpu`) lends CPU tensors by a key; `make gpu-check` runs the real driver
between two stage workers on a GPU.
"""

from __future__ import annotations

import pickle
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
from omnid.dataplane.cuda_ipc import IPC, STAGED, IpcFailed, Lent, choose
from omnid.dataplane.listener import Listener
from omnid.dataplane.sender import Sender
from omnid.dataplane.wire import WorkItem

pytestmark = pytest.mark.timeout(20)

MIB = 1 << 20
GPU_A = "a" * 32
GPU_B = "b" * 32


# ------------------------------------------------------------------------- the choice of path


@pytest.mark.parametrize("tensor_gpu, receiver, exportable, path", [
    (GPU_A, (GPU_A,), True, IPC),                  # the same GPU: lent
    (GPU_A, (GPU_B, GPU_A), True, IPC),            # a receiver on several GPUs, that one among them
    (GPU_A, (GPU_B,), True, STAGED),               # another GPU
    (GPU_A, (), True, STAGED),                     # a receiver on the CPU (or a Ray bridge)
    (None, (GPU_A,), True, STAGED),                # a CPU tensor, or no CUDA driver here
    (GPU_A, (GPU_A,), False, STAGED),              # memory the driver cannot export
])
def test_the_path_a_tensor_takes(tensor_gpu: str | None, receiver: tuple[str, ...], exportable: bool,
                                 path: str) -> None:
    assert choose(tensor_gpu, receiver, exportable) == path


# ------------------------------------------------------------------------- a stand-in for CUDA


class FakeGpu:
    """A driver that lends marked CPU tensors as if they were on GPU `gpu`: `lend` keeps the tensor
    under a random 64-byte handle, `receive` copies it (when this side "sees" that GPU)."""

    def __init__(self, gpu: str = GPU_A, sees: tuple[str, ...] = (GPU_A,), refuse: bool = False) -> None:
        self.gpu = gpu
        self.sees = sees
        self.refuse = refuse
        self.marked: set[int] = set()
        self.exported: dict[bytes, Any] = {}
        self.lent = self.received = 0
        self.lock = threading.Lock()

    def on_gpu(self, t: Any) -> Any:
        self.marked.add(id(t))
        return t

    def gpu_of(self, tensor: Any) -> str | None:
        return self.gpu if id(tensor) in self.marked else None

    def visible_gpus(self) -> tuple[str, ...]:
        return self.sees

    def lend(self, tensor: Any) -> tuple[Lent, Any] | None:
        handle = uuid.uuid4().bytes * 4
        with self.lock:
            self.exported[handle] = tensor
            self.lent += 1
        return Lent(gpu=self.gpu, handle=handle, offset=0, nbytes=tensor.numel() * tensor.element_size(),
                    dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape)), tensor

    def receive(self, lent: Lent) -> Any:
        if self.refuse or lent.gpu not in self.sees:
            raise IpcFailed(f"GPU {lent.gpu} is not visible here")
        with self.lock:
            self.received += 1
            return self.exported[lent.handle].clone()


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    fake = FakeGpu()
    monkeypatch.setattr(shm, "_on_device", lambda t: id(t) in fake.marked)
    cuda_ipc.use_driver(fake)
    try:
        yield fake
    finally:
        cuda_ipc.use_driver(None)


# ------------------------------------------------------------------------- the wire form


def test_a_lent_tensor_travels_as_a_small_record_without_a_slot(gpu: FakeGpu) -> None:
    t = gpu.on_gpu(torch.arange(4 * MIB, dtype=torch.float16).reshape(1024, -1))      # 8 MiB
    item = WorkItem(job="j", pipeline="p", src="up", inputs={"latents": t, "text": "hi"})
    enc = shm.encode(item, MIB, gpus=(GPU_A,))
    assert enc.large == [] and enc.size == 0           # no slot: nothing goes through the pool
    assert len(enc.payload) < 2048                     # no byte of the tensor in the pickle
    ((lent, held),) = enc.lent
    assert held is t                                   # the sender keeps it referenced
    assert (lent.gpu, lent.nbytes, lent.dtype, lent.shape) == (GPU_A, 8 * MIB, "float16", (1024, 4096))
    assert len(lent.handle) == 64
    assert pickle.loads(pickle.dumps(lent)) == lent    # plain data: it pickles as it is


def test_without_the_receivers_gpus_a_cuda_tensor_is_staged_and_says_so(gpu: FakeGpu) -> None:
    t = gpu.on_gpu(torch.ones(MIB, dtype=torch.uint8))
    staged = shm.encode({"t": t}, MIB)                 # the receiver's GPUs not asked yet
    assert staged.lent == [] and staged.cuda and [r.kind for r, _ in staged.large] == ["tensor"]
    other = shm.encode({"t": t}, MIB, gpus=(GPU_B,))   # it sees another GPU
    assert other.lent == [] and other.cuda and other.size == MIB
    cpu = shm.encode({"t": torch.ones(MIB, dtype=torch.uint8)}, MIB, gpus=(GPU_A,))
    assert cpu.lent == [] and not cpu.cuda             # a CPU tensor never asks for GPUs
    assert gpu.lent == 0


def test_small_cuda_tensors_are_not_lent(gpu: FakeGpu) -> None:
    t = gpu.on_gpu(torch.ones(16))
    enc = shm.encode({"t": t}, MIB, gpus=(GPU_A,))
    assert enc.lent == [] and enc.large == []


def test_a_lent_tensor_in_a_slot_item_is_rebuilt_beside_the_pool_values(gpu: FakeGpu) -> None:
    pool = shm.ShmPool("t", 8 * MIB)
    t = gpu.on_gpu(torch.arange(MIB, dtype=torch.int32))
    arr = torch.arange(MIB, dtype=torch.int16).numpy()
    enc = shm.encode({"t": t, "a": arr}, MIB, gpus=(GPU_A,))
    base = pool.reserve(enc.size)
    assert base is not None and enc.size == 2 * MIB    # the array alone takes the slot
    shm.copy_in(pool.mm, base, enc)
    out = shm.decode(enc.payload, pool, base)
    assert torch.equal(out["t"], t) and (out["a"] == arr).all()
    del out
    assert pool.usage() == (0, 0)


def test_a_receiver_that_cannot_open_it_raises_ipc_failed_and_frees_its_slot(gpu: FakeGpu) -> None:
    pool = shm.ShmPool("t", 8 * MIB)
    t = gpu.on_gpu(torch.ones(MIB, dtype=torch.uint8))
    enc = shm.encode({"a": bytes(2 * MIB), "t": t}, MIB, gpus=(GPU_A,))
    base = pool.reserve(enc.size)
    assert base is not None
    shm.copy_in(pool.mm, base, enc)
    gpu.sees = (GPU_B,)
    with pytest.raises(IpcFailed):
        shm.decode(enc.payload, pool, base)
    assert pool.usage() == (0, 0)


def test_a_host_without_a_cuda_driver_loads_none_and_stages() -> None:
    cuda_ipc.use_driver(None)
    try:
        if Path("/dev/nvidiactl").exists():
            pytest.skip("this host has an NVIDIA driver")
        assert cuda_ipc.driver() is None
        assert "libcuda" in (cuda_ipc.driver_error() or "")
        assert cuda_ipc.visible_gpus() == ()
    finally:
        cuda_ipc.use_driver(None)


def test_omnid_cuda_ipc_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNID_CUDA_IPC", "0")
    cuda_ipc.use_driver(None)
    try:
        assert cuda_ipc.driver() is None and "OMNID_CUDA_IPC=0" in (cuda_ipc.driver_error() or "")
    finally:
        cuda_ipc.use_driver(None)


# ------------------------------------------------------------------------- on real sockets


class Receiver(Listener):
    """A started listener that keeps what it admits and counts the frames of each kind."""

    def __init__(self, path: Path, pool: shm.ShmPool | None, gpus: tuple[str, ...] | None) -> None:
        self.got: list[WorkItem] = []
        self.kinds: list[bytes] = []
        super().__init__(path, self._keep, pool, gpus=(lambda: gpus) if gpus is not None else None)
        self.start()

    def _keep(self, item: WorkItem) -> bool:
        self.got.append(item)
        return True

    def _item(self, conn: Any, frame: bytearray, reserved: set[int]) -> WorkItem | None:
        self.kinds.append(bytes(frame[:1]))
        return super()._item(conn, frame, reserved)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ipc", dir="/tmp"))       # AF_UNIX paths: 107 bytes at most
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def send(sender: Sender, dst: str, inputs: dict[str, Any], job: str = "j") -> None:
    assert sender.send(dst, WorkItem(job=job, pipeline="p", src="up", inputs=inputs), abandon=lambda: False)


def test_same_gpu_goes_by_cuda_ipc_and_asks_for_the_gpus_once(gpu: FakeGpu, sock_dir: Path) -> None:
    rx = Receiver(sock_dir / "down.sock", None, gpus=(GPU_A,))       # no pool: IPC needs none
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        a = gpu.on_gpu(torch.arange(MIB, dtype=torch.float32))
        b = gpu.on_gpu(torch.full((512, 1024), 3, dtype=torch.int32))
        send(tx, "down", {"t": a}, "j1")
        send(tx, "down", {"t": b}, "j2")
        assert [torch.equal(i.inputs["t"], x) for i, x in zip(rx.got, (a, b))] == [True, True]
        assert rx.kinds == [wire.GPU_REQUEST, wire.IPC_ITEM, wire.IPC_ITEM]
        assert (gpu.lent, gpu.received) == (2, 2)
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("receiver_gpus", [(GPU_B,), (), None], ids=["other-gpu", "cpu-stage", "no-gpu-answer"])
def test_another_gpu_or_a_cpu_receiver_is_staged_through_the_pool(gpu: FakeGpu, sock_dir: Path,
                                                                  receiver_gpus: tuple[str, ...] | None) -> None:
    pool = shm.ShmPool("down", 8 * MIB)
    rx = Receiver(sock_dir / "down.sock", pool, gpus=receiver_gpus)
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        t = gpu.on_gpu(torch.arange(MIB, dtype=torch.int16))
        send(tx, "down", {"t": t})
        assert torch.equal(rx.got[0].inputs["t"], t)
        assert wire.IPC_ITEM not in rx.kinds and wire.SHM_ITEM in rx.kinds
        assert gpu.lent == 0
    finally:
        tx.close()
        rx.close()


def test_a_receiver_that_cannot_open_the_tensor_gets_it_again_staged(gpu: FakeGpu, sock_dir: Path) -> None:
    pool = shm.ShmPool("down", 8 * MIB)
    rx = Receiver(sock_dir / "down.sock", pool, gpus=(GPU_A,))
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        gpu.refuse = True                   # it says it sees the GPU, and cannot open the handle
        t = gpu.on_gpu(torch.arange(MIB, dtype=torch.int32))
        send(tx, "down", {"t": t}, "j1")
        assert len(rx.got) == 1 and torch.equal(rx.got[0].inputs["t"], t)
        assert rx.kinds[:2] == [wire.GPU_REQUEST, wire.IPC_ITEM] and wire.SHM_ITEM in rx.kinds[2:]
        send(tx, "down", {"t": t}, "j2")    # no second try on this connection: staged at once
        assert rx.kinds.count(wire.IPC_ITEM) == 1 and len(rx.got) == 2
        del rx.got[:]
        assert pool.usage() == (0, 0)
    finally:
        tx.close()
        rx.close()


def test_an_offered_window_goes_by_cuda_ipc_too(gpu: FakeGpu, sock_dir: Path) -> None:
    rx = Receiver(sock_dir / "down.sock", None, gpus=(GPU_A,))
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        t = gpu.on_gpu(torch.ones(MIB, dtype=torch.float16))
        assert tx.offer("down", WorkItem(job="j", pipeline="p", src="up", inputs={"t": t}, window=0)) is True
        assert rx.kinds == [wire.GPU_REQUEST, wire.IPC_ITEM] and torch.equal(rx.got[0].inputs["t"], t)
    finally:
        tx.close()
        rx.close()


def test_a_gpu_request_is_answered_with_the_receivers_gpus(sock_dir: Path) -> None:
    rx = Receiver(sock_dir / "down.sock", None, gpus=(GPU_B, GPU_A))
    tx = Sender(lambda s: sock_dir / f"{s}.sock", MIB)
    try:
        assert tx.gpus_of("down", tx._connect("down")) == (GPU_B, GPU_A)
    finally:
        tx.close()
        rx.close()
