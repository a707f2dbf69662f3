"""Per-stage log capture and the daemon's own log file: `<state_dir>/logs/`, bounded and rotating.

Layout (dirs 0700, files 0600, like the rest of the state dir, see `omnid.paths`):

    <state_dir>/logs/omnid.log             the supervisor's own records
    <state_dir>/logs/stages/<stage>.log    everything a stage worker wrote to its stdout and stderr
    ... each with up to `daemon.log_file_keep` rotated files beside it: .1 (newest) .2 .3

(Stage files have a folder of their own so that a stage named `omnid` is never the daemon.)

Every stored line is `<receive time> <line>`: the time is UTC ISO 8601 with milliseconds and `Z`
(`2026-11-30T03:47:22.123Z`, 24 characters, `omnid.logs.utc_timestamp`), taken when the
supervisor read the line, so lines that are not structured logs (a `print`, a C library's
warning, a traceback) are timestamped too; fixed-width ISO times sort as strings, which is how
`?since=` filters. What is stored is the line as written, less a journald priority prefix `<N>`
and terminal colour codes; what is forwarded to the daemon's stderr is the line unchanged, so
journald (or whoever reads the daemon's stderr) still gets one stream with every record; on a
JSON log, a line that is no JSON record is forwarded wrapped in one (`omnid.logs.foreign_lines`:
`{"event": "stderr", "stage", "line"}`), so that stream stays JSON lines.

How the lines get here (fd passing): before spawning a worker, `StageHandle._spawn` makes an OS
pipe (`multiprocessing` `Pipe(duplex=False)`: an `os.pipe()` pair wrapped in `Connection`s) and
hands the write end to `Process(args=...)`. `multiprocessing` pickles a `Connection` with
`reduction.DupFd`, which the spawn start method turns into an fd passed to the new interpreter
(`spawnv_passfds`): the same mechanism as the control pipe, no path in the file system to create,
secure or clean up, and the fd exists before any of the worker's code runs. `worker_main` dup2s
it onto fds 1 and 2 first thing; the supervisor closes its copy of the write end, so the read end
sees EOF once the worker and everything it started (which inherit fds 1 and 2) are gone.

Processes and threads:
- `PipeReader`: supervisor, event-loop thread. `loop.add_reader` on the (non-blocking) read end;
  each wake-up reads at most `READ_CHUNK` bytes, so one chatty worker cannot starve the loop.
  It blocks only on writing: the log file (local disk) and the daemon's stderr (which blocks
  when a journald pipe is full, as every other record of the daemon does).
- `LogFile`: whichever thread writes (the event loop for stage lines, any thread that logs for
  the daemon's file), under its own lock; blocks on the local disk only.
- `DaemonLogHandler`: a `logging.Handler` on the supervisor's root logger, in the logging thread.
- `LogReader`: the API's reads (`GET /v1/logs`, `GET /v1/stages/{name}/logs`); its reading methods
  do file I/O and are run in the default executor; `changed()` is one fstat and one stat, cheap
  enough for the event loop.

Bounds: a file is rotated before a line would take it past `max_bytes` (only a single line
longer than that makes a file bigger: one line, at most `MAX_LINE` and its timestamp); at most
`keep + 1` files per log. A line longer than `MAX_LINE` bytes is cut into pieces of that size. A
reader holds at most one batch (`READ_BATCH`) of lines, or `tail` lines.
"""

from __future__ import annotations

import asyncio
import calendar
import collections
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

from omnid import paths
from omnid.logs import foreign_lines, utc_timestamp

DAEMON_LOG = "omnid.log"
STAGES_DIR = "stages"
READ_CHUNK = 64 * 1024           # bytes taken from a worker's pipe per event-loop wake-up
MAX_LINE = 64 * 1024             # a longer line (no newline in sight) is stored in pieces of this size
PIPE_SIZE = 1 << 20              # the pipe's kernel buffer (F_SETPIPE_SZ): room for a burst while we write
READ_BATCH = 256 * 1024          # bytes of lines a reader hands to the API at a time
MAX_TAIL = 100_000               # `?tail=` at most
CAUSE_CHARS = 300                # an exception line kept as a load failure's root cause, at most
TS_LEN = len("2026-11-30T03:47:22.123Z")
_PRIORITY = re.compile(rb"^<[0-7]>")
_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.I)
# What `since` may be, as one pattern: the OpenAPI document gives it and `parse_since` checks it first,
# so the document and the server agree (ECMA-262 and Python alike read it the same way).
_UNIT = "(?:[mM][sS]|[sSmMhHdDwW])"
_ISO = ("[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])(?:T(?:[01][0-9]|2[0-3]):[0-5][0-9]"
        "(?::[0-5][0-9](?:[.][0-9]{1,6})?)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?)?")
SINCE_PATTERN = (f"^(?: *(?:(?:[0-9]+(?:[.][0-9]+)? *{_UNIT} *)+|[0-9]+(?:[.][0-9]+)?|{_ISO}) *)?$")
_SINCE = re.compile(SINCE_PATTERN)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def log_dir(state_dir: Path) -> Path:
    return state_dir / "logs"


def daemon_log_path(state_dir: Path) -> Path:
    return log_dir(state_dir) / DAEMON_LOG


def stage_log_path(state_dir: Path, stage: str, replica: int = 0) -> Path:
    """A stage worker's log file: `draw.log`, and `draw#1.log` for its replica 1."""
    name = stage if replica == 0 else f"{stage}#{replica}"
    return log_dir(state_dir) / STAGES_DIR / f"{name}.log"


def stored(line: bytes) -> bytes:
    """A line as the file keeps it (without its newline): no journald prefix, no colour codes."""
    line = _PRIORITY.sub(b"", line, count=1)
    return _ANSI.sub(b"", line) if b"\x1b" in line else line


# ------------------------------------------------------------------ writing


class LogFile:
    """One log, appended to and rotated at `max_bytes`, `keep` rotated files kept. Thread-safe."""

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self.failed: str | None = None      # why writing stopped working (the disk is full ...)

    def _open(self) -> int:
        # logs/ (and logs/stages/): the state dir exists already (the job store made it)
        for d in ((self.path.parent.parent,) if self.path.parent.name == STAGES_DIR else ()) + (self.path.parent,):
            d.mkdir(mode=paths.PRIVATE_DIR, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, paths.PRIVATE_FILE)
        os.fchmod(fd, paths.PRIVATE_FILE)
        self._size = os.fstat(fd).st_size
        return fd

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.keep <= 0:
            os.truncate(self.path, 0)
            return
        for i in range(self.keep - 1, 0, -1):
            try:
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            except FileNotFoundError:
                pass
        os.replace(self.path, f"{self.path}.1")

    def write(self, lines: Iterable[bytes], received: float | None = None) -> None:
        """Append `lines` (without their newlines), each prefixed with `received` (default: now)."""
        prefix = utc_timestamp(received).encode() + b" "
        pieces = [prefix + stored(line) + b"\n" for line in lines]
        if not pieces:
            return
        with self._lock:
            try:
                if self._fd is None:
                    self._fd = self._open()
                batch: list[bytes] = []
                for piece in pieces:           # rotate between lines: a file stays under max_bytes
                    if self._size and self._size + len(piece) > self.max_bytes:
                        self._write(b"".join(batch))
                        batch = []
                        self._rotate()
                        self._fd = self._open()
                    batch.append(piece)
                    self._size += len(piece)
                self._write(b"".join(batch))
                self.failed = None
            except OSError as e:
                # Lines are lost, the stage goes on (they still reach the daemon's stderr).
                self.failed = f"{self.path}: {e.strerror or e}"
                if self._fd is not None:
                    try:
                        os.close(self._fd)
                    except OSError:
                        pass
                self._fd = None

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self._fd is not None:
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_files: dict[Path, LogFile] = {}


def log_file(path: Path, max_bytes: int, keep: int) -> LogFile:
    """The one `LogFile` of this process for `path` (a restarted worker, or a stage replaced by a
    reload, writes on where the last one stopped); its limits are updated to the ones given."""
    f = _files.get(path)
    if f is None:
        f = _files[path] = LogFile(path, max_bytes, keep)
    f.max_bytes, f.keep = max_bytes, keep
    return f


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            time.sleep(0.001)           # (only if someone made our stderr non-blocking)
            continue
        except OSError:
            return                      # stderr is gone: the file still has the lines
        view = view[n:]


_EXCEPTION_LINE = re.compile(rb"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?:: .*)?$")
_CHAINED = (b"The above exception was the direct cause of the following exception:",
            b"During handling of the above exception, another exception occurred:")


class ExceptionLines:
    """The last traceback a process printed, as its chain of exception lines ("ValueError: ..."),
    first (the root cause) to last: what a load failure names when the exception the worker saw
    only points at it ("Engine core initialization failed. See root cause above": vLLM's core
    process printed the real one). Fed each line a worker writes, in order."""

    def __init__(self) -> None:
        self.chain: list[str] = []
        self._chained = False           # the next traceback continues the chain

    def read(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            body = line.rstrip(b"\r")
            if body.startswith(b"Traceback (most recent call last):"):
                if not self._chained:
                    self.chain = []
                self._chained = False
            elif body in _CHAINED:
                self._chained = True
            elif _EXCEPTION_LINE.match(body):
                self.chain.append(body.decode("utf-8", "replace")[:CAUSE_CHARS])
                del self.chain[:-8]

    def root_cause(self) -> str | None:
        """The first exception line of the last chain printed, or None."""
        return self.chain[0] if self.chain else None


class PipeReader:
    """The supervisor's end of one worker incarnation's stdout/stderr pipe (event-loop thread).

    Splits what arrives into lines, appends them to the stage's `LogFile` and forwards them,
    unchanged and whole (never half a line between two of the daemon's records), to `forward_fd`
    (the daemon's stderr). Stops at EOF, or at `close()` (after `drain()`).
    """

    def __init__(self, conn: Connection, file: LogFile, forward_fd: int | None = 2, stage: str = "") -> None:
        self.causes = ExceptionLines()
        self.conn = conn
        self.stage = stage
        self.fd = conn.fileno()
        self.file = file
        self.forward_fd = forward_fd
        self._partial = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        os.set_blocking(self.fd, False)
        try:
            import fcntl
            fcntl.fcntl(self.fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
        except (OSError, ImportError):
            pass                        # (over /proc/sys/fs/pipe-max-size: the default 64 KiB then)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.fd, self._on_readable)

    def _on_readable(self) -> None:
        self._read_once()

    def _read_once(self) -> bool:
        """Read one chunk and pass its whole lines on; False at EOF (then closed) or when empty."""
        if self.closed:
            return False
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""                  # (EIO, EBADF: nothing more will come)
        if not data:
            self._flush_partial()
            self.close()
            return False
        self._take(data)
        return True

    def _take(self, data: bytes) -> None:
        buf = self._partial + data
        cut = buf.rfind(b"\n")
        if cut < 0:
            whole, self._partial = b"", buf
        else:
            whole, self._partial = buf[:cut + 1], buf[cut + 1:]
        while len(self._partial) >= MAX_LINE:            # a line that never ends: store it in pieces
            whole += self._partial[:MAX_LINE] + b"\n"
            self._partial = self._partial[MAX_LINE:]
        if whole:
            self._emit(whole)

    def _emit(self, whole: bytes) -> None:
        """`whole`: complete lines, each ending in a newline."""
        lines = whole[:-1].split(b"\n")
        self.file.write(lines)
        self.causes.read(lines)
        if self.forward_fd is not None:
            write_all(self.forward_fd, foreign_lines(whole, self.stage))    # (a JSON log stays JSON lines)

    def _flush_partial(self) -> None:
        if self._partial:
            part, self._partial = self._partial, b""
            self._emit(part + b"\n")

    def drain(self, limit: int = 64) -> None:
        """Take what is in the pipe now (the worker has exited; at most `limit` chunks)."""
        for _ in range(limit):
            if not self._read_once():
                break

    def close(self) -> None:
        """Stop reading; a last unfinished line is stored as it is."""
        if self.closed:
            return
        self._flush_partial()
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self.fd)
            except (ValueError, OSError):
                pass
        self.conn.close()


# ------------------------------------------------------------------ the daemon's own records


class DaemonLogHandler(logging.Handler):
    """The supervisor's records, formatted like its stderr's, also into `<state_dir>/logs/omnid.log`."""

    def __init__(self, file: LogFile, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self.file = file
        if formatter is not None:
            self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self.file.write(text.encode("utf-8", "replace").split(b"\n"), record.created)
        except Exception:
            self.handleError(record)


def install_daemon_log(state_dir: Path, max_bytes: int, keep: int) -> DaemonLogHandler:
    """Add the daemon log file's handler to the root logger (next to the stderr one, with its
    formatter); `remove_daemon_log` takes it off again. Supervisor main thread, after the state dir
    is taken (so no other daemon writes there)."""
    from omnid import logs
    handler = DaemonLogHandler(log_file(daemon_log_path(state_dir), max_bytes, keep), logs.formatter())
    logging.getLogger().addHandler(handler)
    return handler


def remove_daemon_log(handler: DaemonLogHandler | None) -> None:
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.file.close()


# ------------------------------------------------------------------ reading


class BadSince(ValueError):
    """`since` is neither a duration, an ISO 8601 time nor a Unix time; the message says so."""


def parse_since(text: str, now: float | None = None) -> float:
    """`since` as seconds since the epoch: a duration ago (`90s`, `10m`, `1h30m`, `2d`), an ISO 8601
    time (`2026-11-30T03:47:22Z`; local time without an offset) or a Unix time (`1764474442.5`)."""
    now = time.time() if now is None else now
    if not _SINCE.match(text):
        raise BadSince(f"since must be a duration ago (10m, 1h, 2d), an ISO 8601 time (2026-11-30T03:47:22Z) "
                       f"or a Unix time, not {text!r}")
    value = text.strip()
    if not value:
        raise BadSince("since is empty")
    parts = _DURATION.findall(value)
    if parts and _DURATION.sub("", value).strip() == "":
        return now - sum(float(n) * _UNITS[u.lower()] for n, u in parts)
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        if number != number or number in (float("inf"), float("-inf")):
            raise BadSince(f"since must be a finite time, not {text!r}")
        return number
    try:
        moment = datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise BadSince(f"since must be a duration ago (10m, 1h, 2d), an ISO 8601 time or a Unix time, "
                       f"not {text!r}") from None
    if moment.tzinfo is None:
        return time.mktime(moment.timetuple()) + moment.microsecond / 1e6
    return calendar.timegm(moment.astimezone(timezone.utc).timetuple()) + moment.microsecond / 1e6


class LogReader:
    """Reads one log: its rotated files, oldest first, then the current one; optionally follows it.

    `open()` opens every file at once, so a rotation while reading renames nothing under us. Only
    whole lines are handed out. Reading methods do file I/O (run them in an executor); `changed()`
    is cheap. Not thread-safe: one caller at a time.
    """

    def __init__(self, path: Path, keep: int, since: float | None = None) -> None:
        self.path = path
        self.keep = keep
        self.cutoff = utc_timestamp(since).encode() if since is not None else None
        self._files: list[IO[bytes]] = []               # still to read, oldest first; the last one may grow
        self._partial = b""

    def open(self) -> None:
        names = [Path(f"{self.path}.{i}") for i in range(self.keep, 0, -1)] + [self.path]
        for name in names:
            try:
                self._files.append(open(name, "rb"))
            except FileNotFoundError:
                continue

    @staticmethod
    def _same(f: IO[bytes], path: Path) -> bool:
        try:
            a, b = os.fstat(f.fileno()), os.stat(path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _keep_line(self, line: bytes) -> bool:
        return self.cutoff is None or line[:TS_LEN] >= self.cutoff

    def read(self, limit: int = READ_BATCH) -> list[bytes]:
        """The next whole lines (with their newlines), about `limit` bytes; [] when all is read."""
        out: list[bytes] = []
        size = 0
        while self._files and size < limit:
            f = self._files[0]
            data = f.read(min(limit - size, READ_BATCH))
            if not data:
                if len(self._files) == 1:
                    break                    # the current file: it may grow (follow)
                self._files.pop(0).close()
                if self._partial:            # a rotated file that ended mid-line (a full disk ...)
                    out.append(self._partial + b"\n")
                    self._partial = b""
                continue
            buf = self._partial + data
            cut = buf.rfind(b"\n")
            if cut < 0:
                self._partial = buf
                continue
            self._partial = buf[cut + 1:]
            for line in buf[:cut + 1].splitlines(keepends=True):
                if self._keep_line(line):
                    out.append(line)
                    size += len(line)
        return out

    def tail(self, n: int) -> list[bytes]:
        """The last `n` lines of what is there now (read through, at most `n` lines held)."""
        last: collections.deque[bytes] = collections.deque(maxlen=n)
        while True:
            lines = self.read()
            if not lines:
                return list(last)
            last.extend(lines)

    def changed(self) -> bool:
        """Whether there may be more to read: the current file grew, or was rotated (or created)."""
        if not self._files:
            return self.path.exists()
        f = self._files[-1]
        try:
            if os.fstat(f.fileno()).st_size > f.tell():
                return True
        except OSError:
            return False
        return not self._same(f, self.path) and self.path.exists()

    def follow_rotation(self) -> None:
        """After `changed()`: when `path` is a new file (rotated, or created at last), read on there
        once the old one is read to its end (`read` moves on when the old one has nothing left)."""
        if self._files and self._same(self._files[-1], self.path):
            return
        try:
            new = open(self.path, "rb")
        except FileNotFoundError:
            return
        self._files.append(new)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()
