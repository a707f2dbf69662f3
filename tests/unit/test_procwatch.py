"""omnid.procwatch: a child is dead only when the kernel reports its exit.

Real child processes (spawned, as omnid spawns its workers and vLLM its cores); a descriptor closed
and reused under the watch, as a double close elsewhere in the process would do.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess

from omnid.procwatch import ChildWatch, Exit, exit_of, exit_of_pid

_SPAWN = multiprocessing.get_context("spawn")


def _exit_with(code: int) -> None:
    os._exit(code)


def child(target: object = time.sleep, args: tuple[object, ...] = (60,)) -> BaseProcess:
    proc = _SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def until(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():      # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_exit_of_says_alive_then_the_status_and_never_reaps() -> None:
    proc = child(_exit_with, (3,))
    assert until(lambda: exit_of_pid(proc.pid) is not None, 20)
    assert exit_of_pid(proc.pid) == Exit(proc.pid, 3)
    assert os.path.exists(f"/proc/{proc.pid}")      # still a zombie: not reaped by the look
    assert exit_of(proc) == Exit(proc.pid, 3)
    proc.join(5)
    assert proc.exitcode == 3                       # multiprocessing reaps it and keeps the status
    assert exit_of(proc) == Exit(proc.pid, 3)

    alive = child()
    try:
        assert exit_of(alive) is None
        os.kill(alive.pid, signal.SIGKILL)
        assert until(lambda: exit_of(alive) is not None, 10)
        assert exit_of(alive) == Exit(alive.pid, -signal.SIGKILL)
        assert exit_of(alive).describe() == "killed by signal 9"
    finally:
        alive.kill()
        alive.join(5)


def test_a_watch_woken_by_a_reused_descriptor_waits_on_and_still_sees_the_real_death() -> None:
    proc = child()
    calls: list[tuple[int | None, Exit]] = []
    called = threading.Event()
    watch = ChildWatch([proc], lambda p, e: (calls.append((p.pid, e)), called.set()), name="t", recheck_s=0.2)
    watch.start()
    pipes: list[int] = []
    try:
        # Someone else's double close takes the watch's pidfd, and the number comes back as a pipe
        # that is readable for good: the poll wakes on it again and again.
        (pidfd,) = [f.fd for f in watch._fds]
        assert pidfd is not None
        os.close(pidfd)
        r, w = os.pipe()
        pipes += [r, w]
        assert pidfd in (r, w)
        os.write(w, b"x")
        if pidfd == w:
            os.close(r)
            pipes.remove(r)      # a write end whose reader is gone: POLLERR, a wake too
        assert until(lambda: watch.false_wakes >= 1, 5), "the reused descriptor never woke the watch"
        time.sleep(0.6)
        assert not called.is_set(), calls       # no death was made up from the wake
        assert proc.is_alive()
        assert os.fstat(pidfd)                  # the number is the pipe's: the watch did not close it
        os.kill(proc.pid, signal.SIGKILL)       # a real death is still seen, at once
        assert called.wait(5)
        assert calls == [(proc.pid, Exit(proc.pid, -signal.SIGKILL))]
    finally:
        watch.stop()
        for fd in pipes:
            os.close(fd)
        proc.kill()
        proc.join(5)


def test_a_stopped_watch_says_nothing_of_a_child_stopped_on_purpose() -> None:
    proc = child()
    called = threading.Event()
    watch = ChildWatch([proc], lambda p, e: called.set(), name="t", recheck_s=0.2).start()
    watch.stop()
    proc.terminate()
    proc.join(5)
    time.sleep(0.5)
    assert not called.is_set()


def test_the_first_of_several_children_to_die_is_named() -> None:
    procs = [child(), child(_exit_with, (7,))]
    got: list[tuple[int | None, Exit]] = []
    done = threading.Event()
    ChildWatch(procs, lambda p, e: (got.append((p.pid, e)), done.set()), name="t").start()
    try:
        assert done.wait(20)
        assert got == [(procs[1].pid, Exit(procs[1].pid, 7))]
        assert procs[0].is_alive()
    finally:
        for p in procs:
            p.kill()
            p.join(5)
