"""The small parts of the systemd protocol omnid speaks, without libsystemd.

- `notify("READY=1")`, `notify("WATCHDOG=1")`, `notify("STOPPING=1")` over
  `$NOTIFY_SOCKET` (Type=notify, WatchdogSec=);
- `listen_fds()`: sockets passed by socket activation (`$LISTEN_FDS`, `$LISTEN_PID`).

Runs in the supervisor's main thread; a notify is one non-blocking datagram.
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def notify(state: str) -> bool:
    """Send a state line to systemd; False when not run by systemd (or it failed)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when there is no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def listen_fds() -> list[socket.socket]:
    """The listening sockets systemd passed to this process (and forget the variables)."""
    pid = os.environ.get("LISTEN_PID")
    count = os.environ.get("LISTEN_FDS")
    if not count or pid != str(os.getpid()):      # as sd_listen_fds(): both must be set, and for us
        return []
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks
