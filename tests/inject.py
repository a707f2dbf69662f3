"""Run a few system calls inside another live process, as its own code would (ptrace, x86-64 Linux).

The tests use it to close or replace descriptors inside a worker or the supervisor: a double close in
their own code, made on purpose. gdb's `call close(fd)` did this once, but gdb saves and restores the
whole FPU state around a call, and some kernels refuse that write ("Couldn't write extended state
status: Bad address", Linux 6.18 on an AMX host): the process was then left with a broken syscall
return and died. This touches only the general registers, which a syscall instruction needs.
"""

from __future__ import annotations

import ctypes
import os
import platform

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SINGLESTEP = 12, 13, 16, 17, 9
SYS_CLOSE, SYS_DUP2, SYS_OPENAT = 3, 33, 257
AT_FDCWD = -100
_FIELDS = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
           "fs_base gs_base ds es fs gs").split()


class _Regs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_ulonglong) for name in _FIELDS]


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def _ptrace(request: int, pid: int, addr: int = 0, data: object = None) -> None:
    if _libc.ptrace(request, pid, ctypes.c_void_p(addr), data) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request}, {pid}): {os.strerror(err)}")


def _stopped(pid: int) -> None:
    _, status = os.waitpid(pid, os.__dict__.get("__WALL", 0x40000000))
    if not os.WIFSTOPPED(status):
        raise OSError(f"process {pid} did not stop under ptrace (status {status:#x})")


def _syscall_instruction(pid: int) -> int:
    """The address of a `syscall` instruction (0f 05) in the process's libc text."""
    with open(f"/proc/{pid}/maps") as f:
        maps = [line.split() for line in f]
    for fields in maps:
        if len(fields) >= 6 and "x" in fields[1] and "libc" in os.path.basename(fields[5]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(start)
                at = mem.read(end - start).find(b"\x0f\x05")
            if at >= 0:
                return start + at
    raise OSError(f"no libc text with a syscall instruction in process {pid}")


def syscalls(pid: int, calls: list[tuple[int, ...]], strings: tuple[bytes, ...] = ()) -> list[int]:
    """Run `calls` (each a syscall number and its arguments) one after another in `pid`'s main
    thread, stopped for the time; an argument ("str", i) is the address of `strings[i]`, written
    (NUL-ended) below the thread's stack pointer. Returns each call's result (negative: -errno).
    The thread's registers are put back as they were, so a syscall it was blocked in restarts."""
    _ptrace(PTRACE_ATTACH, pid)
    try:
        _stopped(pid)
        saved = _Regs()
        _ptrace(PTRACE_GETREGS, pid, 0, ctypes.byref(saved))
        try:
            where = _syscall_instruction(pid)
            addresses = []
            at = saved.rsp - 4096                            # (well past the red zone)
            with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
                for s in strings:
                    at -= len(s) + 1
                    mem.seek(at)
                    mem.write(s + b"\0")
                    addresses.append(at)
            results = []
            for number, *args in calls:
                regs = _Regs.from_buffer_copy(saved)
                regs.rax, regs.orig_rax, regs.rip = number, 2**64 - 1, where
                regs.rsp = (at - 256) & ~0xF
                for name, value in zip(("rdi", "rsi", "rdx"), args):
                    if isinstance(value, tuple):
                        value = addresses[value[1]]
                    setattr(regs, name, value % 2**64)
                _ptrace(PTRACE_SETREGS, pid, 0, ctypes.byref(regs))
                _ptrace(PTRACE_SINGLESTEP, pid)
                _stopped(pid)
                _ptrace(PTRACE_GETREGS, pid, 0, ctypes.byref(regs))
                results.append(ctypes.c_longlong(regs.rax).value)
        finally:
            _ptrace(PTRACE_SETREGS, pid, 0, ctypes.byref(saved))
    finally:
        _ptrace(PTRACE_DETACH, pid)
    return results
