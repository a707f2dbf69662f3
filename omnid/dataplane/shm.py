"""Shared memory for large values between stages: one pool per receiving stage, and the codec.

A receiving stage worker owns a pool: an anonymous `memfd` (never a name in /dev/shm, so nothing can
be left behind: the kernel frees it when the last process mapping it exits, `kill -9` included)
that it maps and hands to each sender over the data socket (SCM_RIGHTS). A sender asks the
receiver for room (a *slot*), copies each large value (a CPU or CUDA torch tensor, a numpy array,
bytes) straight into it, and sends a small pickle that names the values by their place in the slot.
The receiver builds its values on the slot's memory without copying (bytes are copied out: a
`bytes` object cannot borrow memory) and frees the slot when the last of them is garbage collected.
A slot reserved by a sender that dies before it sends its item is freed when its connection closes.

The pool's size is the stage's byte budget: when it is full, senders wait (backpressure), as they
do when the input queue is full. A value larger than the whole pool goes through the socket.

A CUDA tensor bound for a stage that sees the same GPU takes neither the pool nor the socket: it
is lent through CUDA IPC (`omnid.dataplane.cuda_ipc`) and copied once, on that GPU, by the receiver.

Threads: `ShmPool` is used by the data plane's connection threads (reserve, claim) and by whatever
thread drops the last reference to a received value (release): one lock guards it; nothing here
blocks except that lock. torch and numpy are imported only when such a value shows up.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from omnid.dataplane import cuda_ipc

ALIGN = 64                      # every value starts on a cache line
DEFAULT_MIN_BYTES = 1 << 20     # values from this size cross through shared memory


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmPool:
    """A receiving stage's shared memory and its allocator (first fit, coalescing free list)."""

    def __init__(self, name: str, capacity: int) -> None:
        self.capacity = capacity
        self.fd = os.memfd_create(f"omnid-{name}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.mm = mmap.mmap(self.fd, capacity)
        self._lock = threading.Lock()
        # Values collected anywhere (even by the cyclic GC inside `reserve`, under the lock) only
        # queue their slot here; the next call under the lock frees it. (deque.append is atomic.)
        self._released: deque[int] = deque()
        self._free: list[tuple[int, int]] = [(0, capacity)]      # (offset, size), sorted, coalesced
        self._slots: dict[int, tuple[int, int]] = {}             # offset -> (size, values still alive)

    def collected(self, offset: int) -> None:
        """A value built on the slot was garbage collected (a finalizer: never blocks)."""
        self._released.append(offset)

    def _drain_released(self) -> None:
        while self._released:
            self._release_locked(self._released.popleft())

    def reserve(self, size: int) -> int | None:
        """Room for `size` bytes: its offset, or None when the pool has no such room now."""
        size = _align(max(size, 1))
        with self._lock:
            self._drain_released()
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._slots[off] = (size, 0)
                    return off
        return None

    def claim(self, offset: int, values: int) -> None:
        """The slot's item arrived: it is freed once `values` values built on it are released."""
        with self._lock:
            size, _ = self._slots[offset]
            self._slots[offset] = (size, values)
        if values == 0:
            self.release(offset)

    def release(self, offset: int) -> None:
        """One value of the slot is gone (or the slot was never used): free it with its last value."""
        with self._lock:
            self._drain_released()
            self._release_locked(offset)

    def _release_locked(self, offset: int) -> None:
        entry = self._slots.get(offset)
        if entry is None:
            return
        size, alive = entry
        if alive > 1:
            self._slots[offset] = (size, alive - 1)
            return
        del self._slots[offset]
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self._free = merged

    def slot_size(self, offset: int) -> int:
        """The bytes reserved at `offset` (aligned)."""
        with self._lock:
            return self._slots[offset][0]

    def usage(self) -> tuple[int, int]:
        """(bytes in slots, slots taken)."""
        with self._lock:
            self._drain_released()
            return sum(size for size, _ in self._slots.values()), len(self._slots)


# ------------------------------------------------------------------------------------ the codec


@dataclass(frozen=True)
class Large:
    """Where a large value sits in a slot, and how to rebuild it."""

    kind: str                   # "tensor", "array", "bytes"
    offset: int                 # from the slot's start
    nbytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = "cpu"


def _large_kind(obj: Any, min_bytes: int) -> str | None:
    if isinstance(obj, (bytes, bytearray)):
        return "bytes" if len(obj) >= min_bytes else None
    module = type(obj).__module__.split(".")[0]
    if module == "torch" and type(obj).__name__ in ("Tensor", "Parameter") and not obj.is_sparse:
        return "tensor" if obj.numel() * obj.element_size() >= min_bytes and obj.dim() > 0 else None
    if module == "numpy" and type(obj).__name__ == "ndarray" and obj.dtype.hasobject is False:
        return "array" if obj.nbytes >= min_bytes and obj.ndim > 0 else None
    return None


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, min_bytes: int, gpus: tuple[str, ...]) -> None:
        super().__init__(file, protocol=5)
        self.min_bytes = min_bytes
        self.gpus = gpus                # the GPUs the receiver sees: their tensors are lent
        self.large: list[tuple[Large, Any]] = []
        self.lent: list[tuple[cuda_ipc.Lent, Any]] = []
        self.cuda = False               # a CUDA tensor went staged (the receiver's GPUs unknown)
        self.size = 0

    def persistent_id(self, obj: Any) -> Large | cuda_ipc.Lent | None:
        kind = _large_kind(obj, self.min_bytes)
        if kind is None:
            return None
        if kind == "tensor" and _on_device(obj):
            lent = self._lend(obj)
            if lent is not None:
                return lent
            self.cuda = True
        if kind == "bytes":
            ref = Large("bytes", self.size, len(obj))
        elif kind == "tensor":
            ref = Large("tensor", self.size, obj.numel() * obj.element_size(), str(obj.dtype).removeprefix("torch."),
                         tuple(obj.shape), obj.device.type)
        else:
            ref = Large("array", self.size, obj.nbytes, obj.dtype.str, tuple(obj.shape))
        self.large.append((ref, obj))
        self.size += _align(ref.nbytes)
        return ref

    def _lend(self, tensor: Any) -> cuda_ipc.Lent | None:
        """The tensor lent through CUDA IPC, when the receiver sees its GPU (else None: staged)."""
        driver = cuda_ipc.driver() if self.gpus else None
        if driver is None:
            return None
        if cuda_ipc.choose(driver.gpu_of(tensor), self.gpus) != cuda_ipc.IPC:
            return None
        lent = driver.lend(tensor)
        if lent is None:
            return None
        self.lent.append(lent)              # held until the receiver answered (it copied it)
        return lent[0]


def _on_device(tensor: Any) -> bool:
    """A tensor on a GPU: lent to a receiver on that GPU, else staged through host memory."""
    return bool(tensor.device.type != "cpu")


def blob(nbytes: int) -> Large:
    """One raw block of `nbytes` at a slot's start: a whole slot's contents copied in as they are."""
    return Large("bytes", 0, nbytes)


class Encoded:
    """An item pickled with its large values left out, to be copied into a slot of `size` bytes.

    `lent`: the CUDA tensors it lends (through CUDA IPC, not the slot), each kept referenced here
    until the receiver has copied it. `cuda`: some CUDA tensor of it is staged only because the
    receiver's GPUs were not known (encode it again with them)."""

    def __init__(self, payload: bytes, large: list[tuple[Large, Any]], size: int,
                 lent: list[tuple[cuda_ipc.Lent, Any]] | None = None, cuda: bool = False) -> None:
        self.payload = payload
        self.large = large
        self.size = size
        self.lent = lent or []
        self.cuda = cuda


def encode(obj: Any, min_bytes: int, gpus: tuple[str, ...] = ()) -> Encoded:
    """`obj` pickled with its large values left out. `gpus`: the GPUs the receiver sees (UUIDs);
    a CUDA tensor on one of them is lent through CUDA IPC, any other one goes through the slot."""
    buf = io.BytesIO()
    p = _Pickler(buf, min_bytes, gpus)
    p.dump(obj)
    return Encoded(buf.getvalue(), p.large, p.size, p.lent, p.cuda)


def copy_in(mm: mmap.mmap, base: int, encoded: Encoded) -> None:
    """Copy each large value into the slot at `base` of a pool mapped as `mm` (the sender's side)."""
    _copy_values(mm, base, encoded)


def pack(encoded: Encoded) -> Any:
    """The large values laid out as `copy_in` lays them in a slot, in one new uint8 numpy array of
    `encoded.size` bytes (a Ray-placed stage's outputs travel as this one array)."""
    import numpy
    buf: Any = numpy.empty(encoded.size, dtype=numpy.uint8)
    _copy_values(buf, 0, encoded)
    return buf


def _copy_values(mm: Any, base: int, encoded: Encoded) -> None:
    for ref, value in encoded.large:
        at = base + ref.offset
        if ref.kind == "bytes":
            if isinstance(mm, mmap.mmap):
                mm[at:at + ref.nbytes] = value
            else:
                import numpy
                mm[at:at + ref.nbytes] = numpy.frombuffer(value, dtype=numpy.uint8)
        elif ref.kind == "tensor":
            import torch
            dst = torch.frombuffer(mm, dtype=torch.uint8, count=ref.nbytes, offset=at)
            dst.copy_(value.detach().contiguous().reshape(-1).view(torch.uint8))   # a CUDA tensor: to host
        else:
            import numpy
            dst_a = numpy.frombuffer(mm, dtype=numpy.uint8, count=ref.nbytes, offset=at)
            dst_a[:] = numpy.ascontiguousarray(value).reshape(-1).view(numpy.uint8)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, pool: ShmPool | None, base: int, device: str | None) -> None:
        super().__init__(file)
        self.pool = pool
        self.base = base
        self.device = device
        self.built = 0              # values that hold the slot

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, cuda_ipc.Lent):
            driver = cuda_ipc.driver()
            if driver is None:
                raise cuda_ipc.IpcFailed(f"a tensor lent by CUDA IPC, and no CUDA driver here "
                                         f"({cuda_ipc.driver_error()})")
            return driver.receive(pid)          # our own copy: nothing of the sender's is kept
        if not isinstance(pid, Large):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if self.pool is None:
            raise pickle.UnpicklingError("a value in a shared-memory slot, in an item that has none")
        at = self.base + pid.offset
        if pid.kind == "bytes":
            return bytes(self.pool.mm[at:at + pid.nbytes])
        import numpy
        raw = numpy.frombuffer(self.pool.mm, dtype=numpy.uint8, count=pid.nbytes, offset=at)
        # The slot is freed when `raw` goes: every view built below keeps it alive.
        weakref.finalize(raw, self.pool.collected, self.base)
        self.built += 1
        if pid.kind == "array":
            return raw.view(numpy.dtype(pid.dtype)).reshape(pid.shape)
        import torch
        tensor = torch.from_numpy(raw).view(getattr(torch, pid.dtype)).reshape(pid.shape)
        if pid.device != "cpu" and self.device is not None and torch.cuda.is_available():
            return tensor.to(self.device)       # staged through the slot; the CPU view is dropped
        return tensor


def decode(payload: bytes | bytearray | memoryview, pool: ShmPool | None, base: int,
           device: str | None = None) -> Any:
    """Rebuild an item whose large values sit in the slot at `base` (the receiver's side), and
    whose lent CUDA tensors are copied here (`pool` None: an item with lent tensors alone).

    `device`: where a tensor that left a GPU goes (the receiving stage's "cuda", or None to keep it
    on the CPU when this stage has no GPU). Raises `cuda_ipc.IpcFailed` when a lent tensor cannot
    be opened here (the sender then sends the item again, staged).
    """
    u = _Unpickler(io.BytesIO(payload), pool, base, device)
    try:
        obj = u.load()
    except BaseException:
        if pool is not None:
            pool.claim(base, u.built)       # whatever was built frees the slot when it goes
        raise
    if pool is not None:
        pool.claim(base, u.built)
    return obj
