"""omnid.logs in this process: formats, fields, journald prefixes, foreign records, warnings."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from omnid import logs

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line]


def test_auto_is_json_off_a_terminal_and_console_on_one(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as f:
        assert logs.resolve_format("auto", f) == ("json", False)
        assert logs.resolve_format("console", f) == ("console", False)
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            assert logs.resolve_format("auto", tty) == ("console", False)
            assert logs.resolve_format("json", tty) == ("json", False)
    finally:
        os.close(master)


def test_journald_is_recognised_by_the_streams_device_and_inode(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "log", "w") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert logs.resolve_format("auto", f) == ("json", True)
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")   # inherited, not ours
        assert logs.resolve_format("auto", f) == ("json", False)
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not logs.on_journald(f)


def test_utc_timestamp_has_milliseconds_and_z() -> None:
    assert logs.utc_timestamp(0.5) == "1970-01-01T00:00:00.500Z"
    assert TIMESTAMP.match(logs.utc_timestamp())


def test_json_lines_carry_every_field_for_structlog_stdlib_and_warnings() -> None:
    out = io.StringIO()
    assert logs.configure("info", "auto", process="stage:draw", stage="draw", stream=out) == "json"
    structlog.get_logger("omnid.test").info("hello", n=1)
    structlog.get_logger("omnid.test").debug("not at info")
    logging.getLogger("diffusers").warning("scheduler %s is deprecated", "X")
    logging.getLogger("transformers").info("library info is dropped below warning")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old", DeprecationWarning)
    try:
        raise ValueError("kaboom")
    except ValueError:
        structlog.get_logger("omnid.test").exception("failed")
    docs = [json.loads(line) for line in lines(out)]
    assert [d["event"] for d in docs][:2] == ["hello", "scheduler X is deprecated"]
    assert len(docs) == 4, docs
    for d in docs:
        assert TIMESTAMP.match(d["timestamp"]) and d["process"] == "stage:draw" and d["stage"] == "draw", d
    assert (docs[0]["level"], docs[0]["logger"], docs[0]["n"]) == ("info", "omnid.test", 1)
    assert (docs[1]["level"], docs[1]["logger"]) == ("warning", "diffusers")
    assert docs[2]["logger"] == "py.warnings" and "DeprecationWarning: old" in docs[2]["event"]
    assert docs[3]["level"] == "error" and "ValueError: kaboom" in docs[3]["exception"]


def test_the_formatter_is_the_stderr_handlers_for_another_handler_to_share() -> None:
    """`logs.formatter()`: what the daemon's log file formats its records with (stage_logs)."""
    out = io.StringIO()
    logs.configure("info", "json", process="supervisor", stream=out)
    (handler,) = logging.getLogger().handlers
    assert logs.formatter() is handler.formatter is not None
    record = logging.LogRecord("omnid.test", logging.INFO, __file__, 1, "shared", None, None)
    assert json.loads(logs.formatter().format(record))["event"] == "shared"    # type: ignore[union-attr]


def test_an_events_own_stage_is_kept() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stage="w", stream=out)
    structlog.get_logger("omnid.test").info("x", stage="other")
    assert json.loads(lines(out)[0])["stage"] == "other"


def test_journald_lines_start_with_a_syslog_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "journal"
    with open(path, "w") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.configure("debug", "auto", stream=f)     # type: ignore[arg-type]
        log = structlog.get_logger("omnid.test")
        log.debug("d")
        log.info("i")
        log.warning("w")
        log.error("e")
        logging.getLogger("vllm").error("v")
    got = path.read_text().splitlines()
    assert [line[:3] for line in got] == ["<7>", "<6>", "<4>", "<3>", "<3>"], got
    assert all(json.loads(line[3:])["event"] for line in got)


def test_console_is_readable_and_colourless_off_a_terminal() -> None:
    out = io.StringIO()
    assert logs.configure("info", "console", stream=out) == "console"
    structlog.get_logger("omnid.test").info("stage worker spawned", stage="lf", pid=12)
    logging.getLogger("diffusers").warning("careful")
    text = out.getvalue()
    assert "\x1b[" not in text
    assert re.search(r"Z \[info\s*\] stage worker spawned .*pid=12.*stage=lf", text), text
    assert "careful" in text and "[diffusers]" in text


def test_library_stream_handlers_are_adopted() -> None:
    out = io.StringIO()
    logs.configure("info", "json", stream=out)
    lib = logging.getLogger("fakelib_for_omnid_test")
    printer = logging.StreamHandler()                  # to sys.stderr, as diffusers' default handler
    keep = logging.FileHandler(os.devnull)
    lib.addHandler(printer)
    lib.addHandler(keep)
    lib.propagate = False
    try:
        assert "fakelib_for_omnid_test" in logs.adopt_library_loggers()
        assert lib.handlers == [keep] and lib.propagate
        lib.warning("through us")
        assert json.loads(lines(out)[-1])["logger"] == "fakelib_for_omnid_test"
    finally:
        lib.removeHandler(keep)
        keep.close()


def test_foreign_lines_are_wrapped_on_a_json_log_only(tmp_path) -> None:
    import io
    import json as _json

    from omnid import logs as L
    out = io.StringIO()
    L.configure("info", "json", stream=out)
    lines = L.foreign_lines(b'{"event": "x"}\nTraceback (most recent call last):\n<4>{"event": "y"}\n', "gen")
    first, second, third = lines.decode().splitlines()
    assert first == '{"event": "x"}' and third == '<4>{"event": "y"}'         # records pass unchanged
    doc = _json.loads(second)
    assert (doc["event"], doc["stage"], doc["level"], doc["line"]) == ("stderr", "gen", "error",
                                                                       "Traceback (most recent call last):")
    levels = [_json.loads(x)["level"] for x in L.foreign_lines(
        b"Failed to create oneDNN linear, fallback to torch linear. Exception: could not create a primitive\n"
        b"error: boom\nWARNING: an error was retried\nloaded\n", "gen").decode().splitlines()]
    assert levels == ["warning", "error", "warning", "info"]        # (a fallback, an error, a warning, news)
    L.configure("info", "console", stream=out)
    assert L.foreign_lines(b"raw\n", "gen") == b"raw\n"
    L.configure("info", "json", stream=out)
    import os
    st = os.fstat(2)
    os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    try:
        import sys
        L.configure("info", "json", stream=sys.stderr)
        assert L.foreign_lines(b"warning: low\n", "gen").startswith(b'<4>{"timestamp"')
    finally:
        del os.environ["JOURNAL_STREAM"]
        L.configure("info", "json", stream=out)


def test_what_a_fork_server_s_imports_print_reaches_a_json_log_as_records() -> None:
    """vLLM prints "Triton is installed, but ..." at import, in the fork server whose fds are the
    daemon's stderr: on a JSON log it comes out a record; on a console log, unchanged."""
    before = logs.wrapping_foreign()
    read, write = os.pipe()
    saved = os.dup(2)
    os.dup2(write, 2)
    try:
        for wrap in (True, False):
            logs.wrap_foreign(wrap, False)
            with logs.printed_as_records("fork-server:vllm"):
                os.write(1, b"Triton is installed, but doesn't include CPU backend. Disabling Triton.\n")
                os.write(2, b"libfoo: warning: a C library\n")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
        logs.wrap_foreign(*before)
    out = os.read(read, 1 << 16).decode().splitlines()
    os.close(read)
    records = [json.loads(line) for line in out[:2]]
    assert [r["line"] for r in records] == ["Triton is installed, but doesn't include CPU backend. Disabling Triton.",
                                            "libfoo: warning: a C library"]
    assert all(r["event"] == "stderr" and r["process"] == "fork-server:vllm" and "stage" not in r for r in records)
    assert records[1]["level"] == "warning"
    assert out[2:] == ["libfoo: warning: a C library"]      # (console: fd 2 as it was; fd 1 is the test's)
