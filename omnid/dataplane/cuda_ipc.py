"""Same-GPU hand-off of CUDA tensors between stage workers: CUDA IPC, one device-to-device copy.

When a stage hands a CUDA tensor to a stage that sees the same GPU, the data plane sends no bytes
of it: the sender *lends* the tensor (a 64-byte `cuIpcGetMemHandle` handle of the allocation it
sits in, and its offset there), and the receiver opens the handle, copies the bytes into a tensor
of its own on that GPU (one device-to-device copy), waits for the copy and closes the handle, all
before it answers the sender. The sender keeps the tensor referenced until that answer (it holds
the item until its acknowledgement, and the item's outputs until the job is forgotten), so its
caching allocator cannot hand the memory out while the receiver reads it.

Why nothing is left held, even by `kill -9`:
- the receiver keeps no mapping of the sender's memory past the call that copied it (open, copy,
  synchronize, close); what it keeps is an ordinary allocation of its own;
- the sender's memory is an ordinary allocation of its own, freed by its allocator when its last
  reference goes;
- there is no file, no shared-memory name and no cross-process reference count (torch's own CUDA
  IPC keeps one in a file under /dev/shm, which a `kill -9` would leave behind): when either
  process dies, the driver destroys its context, which unmaps its IPC mappings and frees its
  allocations. A receiver killed mid-copy frees its half-made tensor that way; a sender killed
  mid-copy may make that copy read freed memory, for a job that fails (or is retried) anyway,
  since its upstream died.

The path a tensor takes (`choose`): CUDA IPC when the receiver sees the GPU the tensor is on
(GPUs are compared by UUID, which every process sees alike whatever its CUDA_VISIBLE_DEVICES),
else the staged path through the receiver's shared-memory pool (`omnid.dataplane.shm`): a different GPU, a
receiver on the CPU, a Ray-placed stage (its bridge reports no GPUs), a host without the CUDA
driver, or memory the driver cannot export (expandable segments) all go staged.

The CUDA driver API (`libcuda.so.1`, which comes with the NVIDIA driver, not with a toolkit) is
called through ctypes, so no CUDA library is needed at build time and nothing here imports torch
until a CUDA tensor shows up.

Process and threads: both sides run in stage workers. The sender's side (`lend`) runs in the
thread that sends (the worker's main thread) and blocks on a device synchronize (the tensor's
producer must have finished); the receiver's side (`receive`) runs in a data-connection thread
and blocks on its copy. One lock serializes opening handles (a process may open a given handle
only once at a time).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

IPC = "ipc"
STAGED = "staged"
_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


@dataclass(frozen=True)
class Lent:
    """A CUDA tensor lent through CUDA IPC, as it travels: where it is and how to rebuild it."""

    gpu: str                        # the GPU's UUID
    handle: bytes                   # cuIpcGetMemHandle of the allocation the tensor sits in
    offset: int                     # the tensor's first byte, from the allocation's start
    nbytes: int
    dtype: str                      # torch dtype name, "float16"
    shape: tuple[int, ...]


def choose(tensor_gpu: str | None, receiver_gpus: Sequence[str], exportable: bool = True) -> str:
    """How a tensor on `tensor_gpu` (None: on the CPU) reaches a receiver that sees
    `receiver_gpus`: IPC when it sees that very GPU and the driver can export the memory."""
    if tensor_gpu is not None and exportable and tensor_gpu in receiver_gpus:
        return IPC
    return STAGED


class IpcFailed(Exception):
    """The receiver could not open a lent tensor (a GPU it does not see, a driver refusal): the
    sender is told so and sends the item again by the staged path."""


class Driver(Protocol):
    """What the codec needs from CUDA. `CudaDriver` is the real one; tests give their own."""

    def gpu_of(self, tensor: Any) -> str | None:
        """The UUID of the GPU a tensor is on (None: not a CUDA tensor)."""
        ...

    def visible_gpus(self) -> tuple[str, ...]:
        """The UUIDs of the GPUs this process sees, in CUDA's device order."""
        ...

    def lend(self, tensor: Any) -> tuple[Lent, Any] | None:
        """Export a CUDA tensor once its producer finished: how it travels, and what the sender
        must keep referenced until the receiver has copied it (None: it cannot be exported)."""
        ...

    def receive(self, lent: Lent) -> Any:
        """A tensor of this process's own holding a copy of the lent one, on the same GPU."""
        ...


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]


class CudaDriver:
    """CUDA IPC through the driver API (libcuda.so.1, by ctypes), on the devices torch uses
    (their primary contexts, made current around each call)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        # _v2 (CUDA 11.4+) gives MIG instances their own UUIDs, as nvidia-smi lists them
        self._get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
        self._check(lib.cuInit(0), "cuInit")
        self._ctx: dict[int, ctypes.c_void_p] = {}
        self._uuids: tuple[str, ...] | None = None
        self._open_lock = threading.Lock()

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{what} failed: CUDA error {rc}")

    def _device(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        return dev

    def visible_gpus(self) -> tuple[str, ...]:
        if self._uuids is None:
            count = ctypes.c_int()
            self._check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
            uuids = []
            for i in range(count.value):
                uuid = _CUuuid()
                self._check(self._get_uuid(ctypes.byref(uuid), self._device(i)), "cuDeviceGetUuid")
                uuids.append(bytes(uuid.bytes).hex())
            self._uuids = tuple(uuids)
        return self._uuids

    def _push(self, ordinal: int) -> None:
        ctx = self._ctx.get(ordinal)
        if ctx is None:
            ctx = ctypes.c_void_p()
            self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._device(ordinal)),
                        "cuDevicePrimaryCtxRetain")
            self._ctx[ordinal] = ctx
        self._check(self._lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")

    def _pop(self) -> None:
        self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def gpu_of(self, tensor: Any) -> str | None:
        if tensor.device.type != "cuda":
            return None
        return self.visible_gpus()[tensor.device.index or 0]

    def lend(self, tensor: Any) -> tuple[Lent, Any] | None:
        import torch
        tensor = tensor.detach().contiguous()
        index = tensor.device.index or 0
        torch.cuda.synchronize(index)           # its producer's kernels have written it
        ptr = tensor.data_ptr()
        base, size, handle = ctypes.c_uint64(), ctypes.c_size_t(), _IpcHandle()
        self._push(index)
        try:
            if self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)):
                return None
            if self._lib.cuIpcGetMemHandle(ctypes.byref(handle), base):   # e.g. expandable segments
                return None
        finally:
            self._pop()
        return Lent(gpu=self.visible_gpus()[index], handle=bytes(handle.reserved), offset=ptr - base.value,
                    nbytes=tensor.numel() * tensor.element_size(), dtype=str(tensor.dtype).removeprefix("torch."),
                    shape=tuple(tensor.shape)), tensor

    def receive(self, lent: Lent) -> Any:
        import torch
        gpus = self.visible_gpus()
        if lent.gpu not in gpus:
            raise IpcFailed(f"GPU {lent.gpu} is not visible to this stage")
        index = gpus.index(lent.gpu)
        out = torch.empty(lent.nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        stream = torch.cuda.current_stream(index)
        if len(lent.handle) != _HANDLE_BYTES:
            raise IpcFailed(f"a CUDA IPC handle is {_HANDLE_BYTES} bytes, not {len(lent.handle)}")
        handle = _IpcHandle()
        ctypes.memmove(ctypes.byref(handle), lent.handle, _HANDLE_BYTES)
        with self._open_lock:
            self._push(index)
            try:
                dptr = ctypes.c_uint64()
                rc = self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(dptr), handle, _LAZY_ENABLE_PEER_ACCESS)
                if rc:
                    raise IpcFailed(f"cuIpcOpenMemHandle failed: CUDA error {rc}")
                try:
                    rc = self._lib.cuMemcpyDtoDAsync_v2(ctypes.c_uint64(out.data_ptr()),
                                                        ctypes.c_uint64(dptr.value + lent.offset),
                                                        ctypes.c_size_t(lent.nbytes), ctypes.c_void_p(stream.cuda_stream))
                    if rc:
                        raise IpcFailed(f"cuMemcpyDtoDAsync failed: CUDA error {rc}")
                    stream.synchronize()        # copied: the sender's memory is no longer read
                finally:
                    self._lib.cuIpcCloseMemHandle(dptr)
            finally:
                self._pop()
        return out.view(getattr(torch, lent.dtype)).reshape(lent.shape)


_driver: Driver | None = None
_driver_error: str | None = None
_driver_lock = threading.Lock()


def driver() -> Driver | None:
    """This process's CUDA driver, loaded on first use; None where there is none (a CPU host)."""
    global _driver, _driver_error
    with _driver_lock:
        if _driver is None and _driver_error is None:
            if os.environ.get("OMNID_CUDA_IPC", "1") == "0":
                _driver_error = "turned off (OMNID_CUDA_IPC=0)"
                return None
            try:
                _driver = CudaDriver(ctypes.CDLL("libcuda.so.1"))
                _bind(_driver)
            except (OSError, AttributeError) as e:
                _driver_error = str(e)
        return _driver


def driver_error() -> str | None:
    """Why `driver()` is None (no libcuda.so.1, cuInit failed, turned off), once it was asked."""
    return _driver_error


def use_driver(d: Driver | None) -> None:
    """Install a driver (tests give a stand-in; None forgets it, and the next `driver()` loads anew)."""
    global _driver, _driver_error
    with _driver_lock:
        _driver, _driver_error = d, None


def _bind(d: CudaDriver) -> None:
    """Check that every entry point is there (an old driver lacks the _v2 ones): fail at load."""
    for name in ("cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid", "cuDevicePrimaryCtxRetain",
                 "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuMemGetAddressRange_v2", "cuIpcGetMemHandle",
                 "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle", "cuMemcpyDtoDAsync_v2"):
        getattr(d._lib, name)
    d._lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
    d._lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this process sees (UUIDs), or none without a CUDA driver. What a receiving stage
    tells its senders (the data plane's GPU request, `wire.GPU_REQUEST`)."""
    d = driver()
    if d is None:
        return ()
    try:
        return d.visible_gpus()
    except OSError:
        return ()
