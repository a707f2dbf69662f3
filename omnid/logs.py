"""Logging set-up, shared by the supervisor and the stage workers: one stream, one format.

Called once per process, at start, in its main thread (the supervisor's `cli.main`, a worker's
`worker_main`), before any engine is imported. Afterwards records are written by whichever
thread logs them, through the root logger's one handler (a lock around one write() of a whole
line to stderr: it blocks only on stderr itself, e.g. a full journald pipe).

Every record goes the same way: structlog's own events and the standard library's records
(vLLM, diffusers, transformers, torch, `warnings` through `logging.captureWarnings`) meet in a
`structlog.stdlib.ProcessorFormatter` on the root logger, which adds the same fields to all of
them: `timestamp` (UTC, ISO 8601 with milliseconds and `Z`), `level`, `logger` (the stdlib
logger's name), `process` ("supervisor" or "stage:NAME") and, in a worker, `stage`.

Formats (`daemon.log_format`):
- `auto` (default): `json` when stderr is not a terminal or is journald's stream, else `console`;
- `console`: structlog's `ConsoleRenderer`, in colour only on a terminal;
- `json`: one JSON object per line.

On journald's stream (`JOURNAL_STREAM` names stderr's device and inode, as systemd sets it for
a service) every line starts with a syslog priority prefix `<N>` (`<7>` debug ... `<3>` error).
journald reads that prefix (`SyslogLevelPrefix=yes`, the default), strips it and stores the
line with that PRIORITY, so `journalctl -p warning` works and the message left is pure JSON. A
`priority` field inside the JSON would be invisible to journald (it does not parse messages), so
the prefix is the one that counts; it is written only there, so a log file stays pure JSON lines.

Levels: structlog events are filtered at `daemon.log_level`; other libraries' records at that
level or `warning`, whichever is higher (their info and debug records are noise here, and a
debug record costs time in an engine's hot loop even when dropped by a handler).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("auto", "console", "json")
# syslog priorities of journald's `<N>` prefix (sd-daemon.h: SD_DEBUG ... SD_CRIT)
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}

EventDict = MutableMapping[str, Any]
_FIRST = ("timestamp", "level", "event")


def on_journald(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stderr) is journald's: `JOURNAL_STREAM` is "DEV:INODE" of that very fd.

    systemd sets the variable for a service's stdout/stderr; children inherit it even when their
    stderr goes elsewhere, hence the comparison (as systemd.exec(5) recommends).
    """
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat((stream or sys.stderr).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


def resolve_format(fmt: str, stream: TextIO | None = None) -> tuple[str, bool]:
    """(`console` or `json`, whether to write journald priority prefixes) for `fmt` on `stream`."""
    stream = stream or sys.stderr
    journald = on_journald(stream)
    if fmt not in ("console", "json"):
        try:
            tty = stream.isatty()
        except (ValueError, AttributeError):
            tty = False
        fmt = "console" if tty and not journald else "json"
    return fmt, journald


def utc_timestamp(created: float | None = None) -> str:
    """`2026-11-30T03:47:22.123Z` for `created` (seconds since the epoch; now when None)."""
    t = time.time() if created is None else created
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _add_timestamp(_: Any, __: str, ev: EventDict) -> EventDict:
    """`timestamp`: when a stdlib record was created (its own clock), or now for structlog's."""
    record = ev.get("_record")
    ev["timestamp"] = utc_timestamp(record.created if isinstance(record, logging.LogRecord) else None)
    return ev


def _add_context(process: str, stage: str | None) -> Callable[[Any, str, EventDict], EventDict]:
    """`process` and, in a worker, `stage` (an event's own `stage=` value is kept)."""
    def add(_: Any, __: str, ev: EventDict) -> EventDict:
        ev.setdefault("process", process)
        if stage is not None:
            ev.setdefault("stage", stage)
        return ev
    return add


class _Render:
    """The last processor: render the event (JSON or console); on journald, prefix `<N>`."""

    def __init__(self, fmt: str, journald: bool, colors: bool) -> None:
        self.journald = journald
        self.steps: list[Callable[[Any, str, EventDict], Any]]
        if fmt == "json":
            self.steps = [structlog.processors.format_exc_info,
                          structlog.processors.JSONRenderer(ensure_ascii=False)]
        else:
            self.steps = [structlog.dev.ConsoleRenderer(colors=colors)]

    def __call__(self, logger: Any, method: str, ev: EventDict) -> str:
        level = str(ev.get("level", method))
        # the fields people read first, first (JSON objects keep their order)
        out: Any = {k: ev[k] for k in _FIRST if k in ev}
        out.update(ev)
        for step in self.steps:
            out = step(logger, method, out)
        text = str(out)
        return f"<{_PRIORITY.get(level, 6)}>{text}" if self.journald else text


class _LoggerFactory(structlog.stdlib.LoggerFactory):
    """structlog's loggers are stdlib loggers; each is let through at `log_level` (the filtering
    bound logger has already dropped what is below it), whatever the root logger's level."""

    def __init__(self, level: int) -> None:
        super().__init__(ignore_frame_names=["omnid.logs"])    # get_logger(): the caller's module
        self.level = level

    def __call__(self, *args: Any) -> logging.Logger:
        logger = super().__call__(*args)
        if logger.level == logging.NOTSET or logger.level > self.level:
            logger.setLevel(self.level)
        return logger


_handler: logging.Handler | None = None
_wrap_foreign: tuple[bool, bool] = (False, False)     # (wrap lines that are no JSON, with journald's prefix)
_settings: tuple[str, str, str] = ("info", "auto", "omnid")   # what `configure` was given (the format it chose)
_ERRORISH = re.compile(rb"(?i)\b(error|traceback|exception|fatal)\b")
_WARNISH = re.compile(rb"(?i)\bwarn(ing)?\b")
# A library that says it falls back has handled what it names: vLLM's engine core (a process of its
# own, with no handler: Python prints its warnings bare) on a CPU without the ISA oneDNN wants says
# "Failed to create oneDNN linear, fallback to torch linear. Exception: ...", a warning_once.
_FALLBACK = re.compile(rb"(?i)\bfall(ing)?[ -]?back\b")


def settings() -> tuple[str, str, str]:
    """This process's (level, format, process) as `configure` set them: what a helper process it
    starts (the span exporter) configures its own log with, on the same stream."""
    return _settings


def json_log() -> bool:
    """Whether this process's log is JSON lines (`configure` chose `json`)."""
    return _wrap_foreign[0]


def wrap_foreign(json_lines: bool, journald: bool) -> None:
    """Wrap lines as `configure` would for a `json` log, in a process that has no log of its own (a
    fork server: what its imports print goes to the daemon's stderr)."""
    global _wrap_foreign
    _wrap_foreign = (json_lines, journald)


def wrapping_foreign() -> tuple[bool, bool]:
    """(whether lines that are no JSON get wrapped, with journald's prefix): for a helper process."""
    return _wrap_foreign


@contextlib.contextmanager
def printed_as_records(process: str) -> Iterator[None]:
    """On a JSON log (`json_log()`), what runs inside prints to fds 1 and 2 goes to fd 2 afterwards as
    records (`foreign_lines`, `process` named): for a process whose fds are the daemon's stderr (a fork
    server, whose imports print). On a console log, nothing changes."""
    if not json_log():
        yield
        return
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            caught.seek(0)
            data = caught.read()
            if data:
                os.write(2, foreign_lines(data if data.endswith(b"\n") else data + b"\n", "", process=process))


def foreign_lines(whole: bytes, stage: str, process: str | None = None) -> bytes:
    """A stage worker's output lines (each ending in a newline) as the daemon's stderr gets them.

    On a `json` log, a line that is not a JSON object already (a tqdm bar, a C library's warning,
    a `print`, a traceback's lines) is wrapped as one: `{"timestamp", "level", "event": "stderr",
    "process", "stage", "line"}`, so that the stream stays JSON lines for the tools that read it.
    `level`: warning for a line that says warning or that it falls back (what it names was handled),
    error for one that speaks of an error, traceback or exception, else info. A carriage-return
    progress bar keeps its last state. On a console log (a terminal), lines pass unchanged."""
    wrap, journald = _wrap_foreign
    if not wrap:
        return whole
    out = []
    for line in whole[:-1].split(b"\n"):
        body = line[3:] if line[:1] == b"<" and line[2:3] == b">" else line     # (a journald prefix)
        if body[:1] == b"{" and body.rstrip()[-1:] == b"}":
            out.append(line)
            continue
        text = line.rsplit(b"\r", 1)[-1] if b"\r" in line.rstrip(b"\r") else line.rstrip(b"\r")
        level = ("warning" if _WARNISH.search(text) or _FALLBACK.search(text) else
                 "error" if _ERRORISH.search(text) else "info")
        doc = {"timestamp": utc_timestamp(), "level": level, "event": "stderr", "process": process or f"stage:{stage}",
               **({"stage": stage} if stage else {}), "line": text.decode("utf-8", "replace")}
        record = json.dumps(doc, ensure_ascii=False)
        out.append((f"<{_PRIORITY[level]}>" if journald else "").encode() + record.encode())
    return b"\n".join(out) + b"\n"


def formatter() -> logging.Formatter | None:
    """The formatter of the stderr handler `configure` installed (None before it ran): another
    handler of this process's records (the daemon's log file) formats them alike."""
    return _handler.formatter if _handler is not None else None


def configure(level: str = "info", fmt: str = "auto", process: str = "supervisor",
              stage: str | None = None, stream: TextIO | None = None) -> str:
    """Set up this process's logging (see the module docstring); returns the format chosen.

    `stage`: a worker's stage name, added to every record as `stage`. `stream`: stderr unless
    a test says otherwise.
    """
    global _handler, _wrap_foreign, _settings
    stream = stream or sys.stderr
    lvl = _LEVELS.get(level, logging.INFO)
    chosen, journald = resolve_format(fmt, stream)
    _settings = (level, chosen, process)
    _wrap_foreign = (chosen == "json", journald)
    colors = chosen == "console" and not journald and _isatty(stream)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _add_timestamp,
        _add_context(process, stage),
    ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _Render(chosen, journald, colors)],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):      # basicConfig's, a library's, or ours from an earlier call
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))
    logging.getLogger("omnid").setLevel(lvl)
    _handler = handler
    logging.captureWarnings(True)        # `warnings.warn` -> logger "py.warnings", level warning
    # vLLM: no handler of its own (it would print to stdout past us); its level stays its own.
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    vllm_level = _LEVELS.get(os.environ.get("VLLM_LOGGING_LEVEL", "").lower())
    if vllm_level is not None:
        logging.getLogger("vllm").setLevel(vllm_level)
    structlog.reset_defaults()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_LoggerFactory(lvl),
        cache_logger_on_first_use=True,
    )
    adopt_library_loggers()
    return chosen


def adopt_library_loggers() -> list[str]:
    """Route libraries that print past the root logger back through it; returns their names.

    diffusers, transformers and torch give their top logger a `StreamHandler` of its own (to
    stderr or stdout) and stop it from propagating. Such handlers are removed and propagation
    turned back on; each logger keeps its level. Other handlers (files, sockets) are left alone.
    Called by `configure` and again once a worker's engine is loaded (the libraries set their
    loggers up when imported).
    """
    std = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    adopted: list[str] = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger):
            continue                     # a PlaceHolder: no handlers
        printers = [h for h in logger.handlers if type(h) is logging.StreamHandler
                    and (id(h.stream) in std or _fd(h.stream) in (1, 2))]
        for h in printers:
            logger.removeHandler(h)
        if printers:
            logger.propagate = True
            adopted.append(name)
    return adopted


def _fd(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
