"""GPU lock files: one `flock`ed file per device, `<lock_dir>/gpu<N>.lock`.

The supervisor takes the locks of every device its stages use before it
starts any worker and holds them for its whole life (across worker restarts),
so a second daemon, or any program that honours the files, cannot start on a
device in use. Rules that keep this safe:

- devices are always locked in ascending order, so two holders with
  overlapping device sets can never deadlock;
- a lock file is never unlinked (unlinking a held lock lets a third process
  lock a new inode at the same path);
- the holder writes its pid into the file, so a refused caller can say who
  holds the device; the kernel drops the lock when the holder dies.

Runs in the supervisor's main thread at start-up; `acquire(blocking=True)`
may block in `flock`, the default non-blocking mode never does.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path


class DeviceBusy(Exception):
    """A device's lock is held by another process."""

    def __init__(self, device: int, path: Path, holder: str) -> None:
        self.device = device
        self.path = path
        self.holder = holder
        super().__init__(f"GPU {device} is in use by {holder} (lock file {path})")


def lock_path(lock_dir: Path, device: int) -> Path:
    return Path(lock_dir) / f"gpu{device}.lock"


def read_holder(path: Path) -> str:
    """Who wrote the lock file last: 'pid N (what)' or 'an unknown process'."""
    try:
        text = path.read_text().split("\n")
    except OSError:
        return "an unknown process"
    pid = text[0].strip() if text else ""
    what = text[1].strip() if len(text) > 1 else ""
    if not pid.isdigit():
        return "an unknown process"
    return f"pid {pid}" + (f" ({what})" if what else "")


class DeviceLocks:
    """The set of device locks one process holds."""

    def __init__(self, lock_dir: Path, owner: str = "omnid") -> None:
        self.lock_dir = Path(lock_dir)
        self.owner = owner
        self._fds: dict[int, int] = {}

    @property
    def held(self) -> tuple[int, ...]:
        return tuple(sorted(self._fds))

    def acquire(self, devices: Iterable[int], *, blocking: bool = False) -> None:
        """Lock every device in `devices`, in ascending order.

        Non-blocking (the default): raises DeviceBusy naming the holder at the
        first device that is taken, after releasing what this call took.
        """
        wanted = sorted(set(devices) - set(self._fds))
        if not wanted:
            return
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        taken: list[int] = []
        try:
            for device in wanted:
                path = lock_path(self.lock_dir, device)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    os.close(fd)
                    raise DeviceBusy(device, path, read_holder(path)) from None
                except BaseException:
                    os.close(fd)
                    raise
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n{self.owner}\n".encode(), 0)
                self._fds[device] = fd
                taken.append(device)
        except BaseException:
            self.release(taken)
            raise

    def release(self, devices: Iterable[int] | None = None) -> None:
        """Unlock (never unlink) the given devices, or all of them."""
        for device in sorted(self._fds if devices is None else set(devices), reverse=True):
            fd = self._fds.pop(device, None)
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def __enter__(self) -> "DeviceLocks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class DeviceLeases:
    """Which users (stages) need which devices of one `DeviceLocks`: a device's lock file is held
    while any user needs it, and let go when the last one stops (a stage that sleeps gives its GPUs
    back to other programs; waking takes them again, or says who holds them now)."""

    def __init__(self, locks: DeviceLocks) -> None:
        self.locks = locks
        self._users: dict[str, frozenset[int]] = {}

    def hold(self, user: str, devices: Iterable[int]) -> None:
        """`user` needs `devices`: lock those not held yet (non-blocking; DeviceBusy names the holder)."""
        wanted = frozenset(devices)
        self.locks.acquire(wanted)
        self._users[user] = self._users.get(user, frozenset()) | wanted

    def drop(self, user: str) -> tuple[int, ...]:
        """`user` needs none of its devices any more; returns the devices unlocked."""
        mine = self._users.pop(user, frozenset())
        needed = frozenset().union(*self._users.values()) if self._users else frozenset()
        free = sorted(d for d in mine - needed if d in self.locks.held)
        self.locks.release(free)
        return tuple(free)
