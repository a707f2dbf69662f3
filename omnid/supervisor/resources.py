"""What the daemon watches so that it stays honest when the machine runs short: the state dir's
disk (space and inodes, with a ballast file), its own file descriptors, and its workers' memory
(an out-of-memory kill told apart from any other SIGKILL).

Runs in the supervisor process's event-loop thread. `DiskWatch.check()` is one `statvfs` (a few
microseconds; the submit handlers call it on every submit, the daemon's main loop once a tick).
The ballast is made with `posix_fallocate` (ext4, xfs and tmpfs allocate without writing; it
is made once at start and again once space is back) and given back with one `unlink`.
`oom_evidence` reads the cgroup's `memory.events` and, where root may, the kernel log
(`/dev/kmsg`, non-blocking, bounded): only when a worker died by SIGKILL.

- Disk: below `[daemon] min_free_mb` (or `min_free_inodes`) on the state dir's filesystem, or
  while a write of the job store is failing, the daemon is `disk_full`: `/v1/ready` says so (503),
  submits get 507 `insufficient_storage` with Retry-After, everything else works. Above the floor
  and with the store writing again, it serves again by itself.
- Ballast (CockroachDB's idea): `ballast_mb` set aside in `<state_dir>/ballast`. The store gives it
  back when one of its writes finds the disk full (`JobStore.on_full`) and tries the write again,
  so that `rm`, retention and a start on a full disk have room for sqlite's journal. The floor is
  measured as if the ballast were in place, so giving it back does not reopen the door to submits.
- File descriptors: `raise_nofile()` lifts the soft RLIMIT_NOFILE to the hard one at start;
  `ConnectionGuard` answers 503 `too_many_connections` (and closes) past what that leaves, before
  `accept()` itself runs out.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from pathlib import Path

import structlog
from aiohttp import web
from typing_extensions import TypedDict

log = structlog.get_logger("omnid.resources")

MB = 1 << 20
BALLAST_NAME = "ballast"
RETRY_AFTER_S = 10          # what a 507 suggests to wait: space comes back by rm, retention or an operator
FD_RESERVE = 128            # descriptors kept for the daemon's own use (workers, logs, sqlite) past the clients
KMSG_MAX_BYTES = 4 << 20    # how much of the kernel log is read at most to explain one SIGKILL


class DiskDoc(TypedDict):
    """the state dir's filesystem: `full` while it is short of space or inodes (then the daemon takes no
    new jobs)"""

    full: bool
    reason: str | None
    """what is short, in words (null: room enough)"""
    free_mb: int
    min_free_mb: int
    free_inodes: int | None
    """null: the filesystem counts no inodes"""
    min_free_inodes: int
    ballast_mb: int
    """the ballast file's size while it is in place (0 once given back)"""


@dataclass
class DiskState:
    """The state dir's filesystem as last looked at."""

    free_bytes: int
    free_inodes: int | None          # None: the filesystem counts no inodes (btrfs, some FUSE)
    ballast: bool                    # the ballast file is in place
    store_failing: str | None        # why the store's last write failed, while it does
    reason: str | None               # None: room enough; else what is short, in words

    @property
    def full(self) -> bool:
        return self.reason is not None

    def as_doc(self, watch: DiskWatch) -> DiskDoc:
        return {"full": self.full, "reason": self.reason, "free_mb": self.free_bytes // MB,
                "min_free_mb": watch.min_free_bytes // MB, "free_inodes": self.free_inodes,
                "min_free_inodes": watch.min_free_inodes, "ballast_mb": watch.ballast_bytes // MB if self.ballast else 0}


class DiskWatch:
    """The state dir's free space and inodes against their floors, and the ballast file."""

    def __init__(self, state_dir: Path, min_free_mb: int, min_free_inodes: int, ballast_mb: int,
                 store_error: Callable[[], str | None] = lambda: None) -> None:
        """`store_error`: why the job store's writes fail now (None while they work)."""
        self.state_dir = Path(state_dir)
        self.store_error = store_error
        self.min_free_bytes = min_free_mb * MB
        self.min_free_inodes = min_free_inodes
        self.ballast_bytes = ballast_mb * MB
        self.ballast_path = self.state_dir / BALLAST_NAME
        self.released = 0                         # times the ballast was given back
        self.last: DiskState | None = None

    def configure(self, min_free_mb: int, min_free_inodes: int, ballast_mb: int) -> None:
        """New floors (a reload)."""
        self.min_free_bytes = min_free_mb * MB
        self.min_free_inodes = min_free_inodes
        self.ballast_bytes = ballast_mb * MB

    # ---------------------------------------------------------------- the ballast

    def _ballast_size(self) -> int:
        try:
            return os.stat(self.ballast_path).st_blocks * 512
        except OSError:
            return 0

    def ensure_ballast(self) -> bool:
        """Make the ballast file if it is missing and it fits above the floor. Returns whether it is in place."""
        if self.ballast_bytes <= 0:
            return False
        if self._ballast_size() >= self.ballast_bytes:
            return True
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            return False
        if st.f_bavail * st.f_frsize < self.min_free_bytes + self.ballast_bytes:
            return False
        try:
            fd = os.open(self.ballast_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.ballast_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("cannot make the ballast file", path=str(self.ballast_path), error=e.strerror or str(e))
            self._unlink_ballast()
            return False
        log.info("ballast in place", path=str(self.ballast_path), mb=self.ballast_bytes // MB)
        return True

    def _unlink_ballast(self) -> bool:
        try:
            os.unlink(self.ballast_path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("cannot remove the ballast file", path=str(self.ballast_path), error=e.strerror or str(e))
            return False

    def release_ballast(self) -> bool:
        """The disk is full under a write that must happen: give the ballast back. Returns whether
        space was freed (then the write is worth trying again)."""
        if self._ballast_size() == 0:
            return False
        freed = self._unlink_ballast()
        if freed:
            self.released += 1
            log.warning("the disk is full: ballast given back so that the store can write",
                        path=str(self.ballast_path), mb=self.ballast_bytes // MB)
        return freed

    # ---------------------------------------------------------------- looking

    def check(self) -> DiskState:
        """The disk now (one statvfs). The ballast counts as free when it is missing: the floor holds room for it."""
        try:
            st = os.statvfs(self.state_dir)
        except OSError as e:
            state = DiskState(0, None, False, self.store_error(), f"cannot look at {self.state_dir}: {e.strerror}")
            self.last = state
            return state
        free = st.f_bavail * st.f_frsize
        inodes = st.f_favail if st.f_files else None
        ballast = self.ballast_bytes > 0 and self._ballast_size() > 0
        owed = 0 if ballast or self.ballast_bytes <= 0 else self.ballast_bytes
        reason: str | None = None
        if free - owed < self.min_free_bytes:
            reason = (f"{free // MB} MiB free on {self.state_dir}" + (f" ({owed // MB} MiB of it owed to the ballast)"
                                                                      if owed and free >= owed else "")
                      + f", under daemon.min_free_mb = {self.min_free_bytes // MB}")
        elif inodes is not None and inodes < self.min_free_inodes:
            reason = f"{inodes} inodes free on {self.state_dir}, under daemon.min_free_inodes = {self.min_free_inodes}"
        elif (failing := self.store_error()) is not None:
            reason = f"the job store cannot write: {failing}"
        state = DiskState(free, inodes, ballast, self.store_error(), reason)
        self.last = state
        return state

    def tick(self) -> DiskState:
        """Once a second (the daemon's main loop): the ballast back when there is room, the state,
        and its change logged."""
        before = self.last
        if self.ballast_bytes > 0 and not self._ballast_size():
            self.ensure_ballast()
        state = self.check()
        if before is not None and before.full != state.full:
            if state.full:
                log.warning("disk short: refusing new jobs (507) and not ready (disk_full)", reason=state.reason,
                            free_mb=state.free_bytes // MB)
            else:
                log.info("disk has room again: taking jobs", free_mb=state.free_bytes // MB)
        return state


# ------------------------------------------------------------------ file descriptors


def raise_nofile() -> tuple[int, int]:
    """The soft RLIMIT_NOFILE up to the hard one (a daemon with many clients needs them). Returns
    (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit", soft=soft, hard=hard, error=str(e))
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class ConnectionGuard:
    """Past `limit` open client connections, a request is answered 503 `too_many_connections`
    and its connection closed: the descriptors the daemon needs for itself stay free, and a
    client past the limit hears why instead of hanging in the accept backlog."""

    def __init__(self, connections: Callable[[], Sized | None], limit: int) -> None:
        self.connections = connections
        self.limit = limit
        self.refused = 0

    @classmethod
    def for_this_process(cls, connections: Callable[[], Sized | None]) -> ConnectionGuard:
        """The limit from RLIMIT_NOFILE, less what is open now and FD_RESERVE."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return cls(connections, max(16, soft - open_fds() - FD_RESERVE))

    def over(self) -> int | None:
        """How many connections are open, when that is past the limit; else None."""
        conns = self.connections()
        n = len(conns) if conns is not None else 0
        return n if n > self.limit else None

    def middleware(self, refuse: Callable[[int], web.StreamResponse]) -> Callable[..., Awaitable[web.StreamResponse]]:
        """An aiohttp middleware; `refuse(open_connections)` builds the 503."""
        guard = self

        @web.middleware
        async def connection_guard(request: web.Request,
                                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                   ) -> web.StreamResponse:
            n = guard.over()
            if n is None:
                return await handler(request)
            guard.refused += 1
            if guard.refused == 1 or guard.refused % 1000 == 0:
                log.warning("too many connections: refusing requests (503)", open=n, limit=guard.limit,
                            refused=guard.refused)
            resp = refuse(n)
            resp.force_close()
            return resp
        return connection_guard


# ------------------------------------------------------------------ memory


def cgroup_memory_events(pid: int | str = "self") -> Path | None:
    """The file of a process's memory cgroup that counts its OOM kills (`oom_kill N`): cgroup v2's
    `memory.events`, or v1's `memory.oom_control`. None where there is none."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and not controllers:
            found = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            found = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if found.exists():
            return found
    return None


def oom_kills(events: Path | None) -> int | None:
    """The `oom_kill` count of a cgroup's memory.events or memory.oom_control (None: not readable)."""
    if events is None:
        return None
    try:
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def kernel_says_oom(pid: int) -> bool | None:
    """Whether the kernel log tells of the OOM killer taking `pid` (None: the log is not readable)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    needle = f"Killed process {pid} ".encode()
    seen = 0
    try:
        while seen < KMSG_MAX_BYTES:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:      # a record was overwritten while we read: go on
                    continue
                break
            if not record:
                break
            seen += len(record)
            if needle in record:
                return True
    finally:
        os.close(fd)
    return False


@dataclass
class OomWatch:
    """The supervisor's cgroup's OOM kill count, looked at when a worker starts and when it dies."""

    events: Path | None
    at_start: int | None

    @classmethod
    def now(cls, pid: int | str = "self") -> OomWatch:
        events = cgroup_memory_events(pid)
        return cls(events, oom_kills(events))

    def evidence(self, pid: int) -> str | None:
        """Why a worker that died by SIGKILL likely ran out of memory, or None when nothing says so."""
        after = oom_kills(self.events)
        if after is not None and self.at_start is not None and after > self.at_start:
            return f"its cgroup's {self.events.name if self.events else 'memory.events'} counts " \
                   f"{after - self.at_start} OOM kill(s) since it started"
        if kernel_says_oom(pid):
            return "the kernel log says the OOM killer took it"
        return None

