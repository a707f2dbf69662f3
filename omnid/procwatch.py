"""Is a child process dead? Only the kernel may say so.

A process's multiprocessing `sentinel` is a pipe that turns readable when the child's last copy of
its write end closes, and a descriptor that is closed and reused (a double close anywhere in the
process; multiprocessing's own finalizers at interpreter exit) makes any poll on it return at once.
Neither is an exit. Here a child is dead only when `waitid` reports its exit status; a wake
without one is logged and waited out.

- `exit_of(proc)`: a multiprocessing child's exit status now, or None while it runs. Only
  multiprocessing's own `Popen` reaps it (and keeps its `exitcode`); `exit_of_pid(pid)` looks
  with `waitid(WNOWAIT)`, which never reaps. A worker forked by the daemon's fork server is the
  server's child: its status comes only through its sentinel (the server writes it there).
- `ChildWatch`: a thread of its own that waits on pidfds (readable exactly when the process has
  exited) and rechecks with `exit_of` every `recheck_s`, for descriptors that are no longer ours;
  it calls `on_exit` once, with the first child found dead. `stop()` ends it without a call: the
  owner is stopping the children itself (a shutdown is not a death).
- `PidFd`: one child's pidfd, for an event loop's `add_reader` (the supervisor's worker handles).

Used by a stage worker's vLLM engine (its engine core processes) and by the supervisor (its stage
workers). Nothing here blocks but `ChildWatch`'s own thread, which blocks in `poll`.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import structlog

log = structlog.get_logger("omnid.procwatch")

_CLD_EXITED = getattr(os, "CLD_EXITED", 1)


@dataclass(frozen=True)
class Exit:
    """A child's end as the kernel reports it."""
    pid: int
    code: int | None        # multiprocessing's convention: >= 0 an exit status, < 0 the signal; None: reaped
                            # by someone else before we looked, so unknown

    def describe(self) -> str:
        if self.code is None:
            return "exit status unknown"
        if self.code < 0:
            return f"killed by signal {-self.code}"
        return f"exit status {self.code}"


def exit_of(proc: BaseProcess) -> Exit | None:
    """The child's exit, or None while it is alive (or not started). Reaps it only through
    multiprocessing, which keeps its exit code."""
    pid = proc.pid
    if pid is None:
        return None
    try:
        code = proc.exitcode
    except ValueError:                  # a closed Process object: ask the kernel by pid
        code = None
    if code is not None:
        return Exit(pid, code)          # multiprocessing reaped it already
    if getattr(proc, "_start_method", None) == "forkserver":
        # A fork server's child is the server's to reap: its status comes through the sentinel
        # (`exitcode` above) once the server has it. Until then it runs, or has just exited.
        return None
    return exit_of_pid(pid)


def exit_of_pid(pid: int) -> Exit | None:
    """A child of this process by pid: its exit, or None while it runs. Never reaps it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        # Reaped already (by a waitpid elsewhere), or not our child: then only its absence tells.
        return None if _exists(pid) else Exit(pid, None)
    if info is None:
        return None                     # running: no state change to report
    if info.si_code == _CLD_EXITED:
        return Exit(pid, info.si_status)
    return Exit(pid, -info.si_status)  # killed or dumped: the signal


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _open_pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None                     # gone already (the recheck sees it), or a kernel without pidfds


def _is_pidfd(fd: int) -> bool:
    """Is `fd` still the pidfd we opened? (A double close elsewhere can give its number to a file.)"""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    except OSError:
        return False


class PidFd:
    """One child's pidfd: readable exactly when the child has exited. `fd` is None where the
    kernel has no pidfds; the owner then relies on its own periodic check (`exit_of`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = _open_pidfd(pid)

    def still_ours(self) -> bool:
        return self.fd is not None and _is_pidfd(self.fd)

    def reopen(self) -> None:
        """After a wake that was no exit: a fresh pidfd if the number is no longer ours. (The old
        number is never closed then: it is someone else's file now.)"""
        if self.fd is not None and _is_pidfd(self.fd):
            return
        self.fd = _open_pidfd(self.pid)

    def close(self) -> None:
        if self.fd is not None and _is_pidfd(self.fd):
            os.close(self.fd)
        self.fd = None


class ChildWatch:
    """Waits, in a daemon thread, for any of `procs` to exit, and calls `on_exit(proc, exit)` once
    from that thread. A wake with no exit behind it is logged and waited out, never acted on."""

    def __init__(self, procs: Sequence[BaseProcess], on_exit: Callable[[BaseProcess, Exit], None],
                 name: str, recheck_s: float = 1.0) -> None:
        self.procs = list(procs)
        self.on_exit = on_exit
        self.name = name
        self.recheck_s = recheck_s
        self.false_wakes = 0            # wakes that were no exit (logged once each)
        self._stopped = threading.Event()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._fds = [PidFd(p.pid) for p in self.procs if p.pid is not None]
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ChildWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The children are being stopped on purpose: the watch ends without calling `on_exit`."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass

    def _dead(self) -> tuple[BaseProcess, Exit] | None:
        for proc in self.procs:
            ended = exit_of(proc)
            if ended is not None:
                return proc, ended
        return None

    def _run(self) -> None:
        poller = select.poll()
        registered: dict[int, PidFd] = {}

        def register() -> None:
            for fd in list(registered):
                poller.unregister(fd)
            registered.clear()
            for pidfd in self._fds:
                if pidfd.fd is not None:
                    poller.register(pidfd.fd, select.POLLIN)
                    registered[pidfd.fd] = pidfd

        poller.register(self._stop_r, select.POLLIN)
        register()
        try:
            while not self._stopped.is_set():
                ready = poller.poll(self.recheck_s * 1000)
                if self._stopped.is_set():
                    return
                dead = self._dead()
                if dead is not None:
                    self._stopped.set()
                    self.on_exit(*dead)
                    return
                woken = [fd for fd, _ in ready if fd in registered]
                if woken:
                    # No child has exited: a descriptor that is no longer ours woke us. Say so, take
                    # fresh pidfds where needed, and go on waiting.
                    self.false_wakes += 1
                    log.warning("a child-process watch woke with no child exited; waiting on", watch=self.name,
                                fds=woken, pids=[registered[fd].pid for fd in woken])
                    for fd in woken:
                        registered[fd].reopen()
                    register()
        finally:
            for pidfd in self._fds:
                pidfd.close()
            os.close(self._stop_r)
            os.close(self._stop_w)
