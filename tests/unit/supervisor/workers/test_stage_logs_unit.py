"""omnid.supervisor.workers.stage_logs in this process: rotation, what is stored, the pipe reader, `since`,
and reading back (tail, since, follow across a rotation)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from omnid.supervisor.workers import stage_logs as sl

NOW = 1_764_474_442.0          # 2025-11-30T03:47:22Z


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_lines_are_stamped_stripped_and_private(tmp_path: Path) -> None:
    f = sl.LogFile(sl.stage_log_path(tmp_path, "s"), 1 << 20, 3)
    f.write([b"<4>{\"event\": \"x\"}", b"\x1b[31mred\x1b[0m plain", b"<not a prefix>"], NOW)
    path = tmp_path / "logs" / "stages" / "s.log"
    assert read_lines(path) == ["2025-11-30T03:47:22.000Z {\"event\": \"x\"}", "2025-11-30T03:47:22.000Z red plain",
                                "2025-11-30T03:47:22.000Z <not a prefix>"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700


def test_rotation_keeps_keep_files_each_under_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "x.log"
    f = sl.LogFile(path, 300, 2)
    for i in range(40):
        f.write([f"line {i:03d} ".encode() + b"y" * 20], NOW)
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["x.log", "x.log.1", "x.log.2"]
    for p in path.parent.iterdir():
        assert 0 < p.stat().st_size <= 300
    everything = read_lines(path.with_name("x.log.2")) + read_lines(path.with_name("x.log.1")) + read_lines(path)
    numbers = [int(line.split()[2]) for line in everything]
    assert numbers == list(range(numbers[0], 40))
    # one batch of many lines is split across files too
    f.write([b"z" * 50] * 20, NOW)
    for p in path.parent.iterdir():
        assert p.stat().st_size <= 300


def test_keep_zero_truncates(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "x.log"
    f = sl.LogFile(path, 100, 0)
    for _ in range(10):
        f.write([b"a" * 40], NOW)
    assert [p.name for p in path.parent.iterdir()] == ["x.log"] and path.stat().st_size <= 100


def test_log_file_is_shared_per_path(tmp_path: Path) -> None:
    a = sl.log_file(tmp_path / "logs" / "a.log", 100, 1)
    b = sl.log_file(tmp_path / "logs" / "a.log", 200, 2)
    assert a is b and (b.max_bytes, b.keep) == (200, 2)


def test_pipe_reader_stores_and_forwards_whole_lines(tmp_path: Path) -> None:
    read_end, write_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
    fwd_w = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)   # the daemon's stderr
    f = sl.LogFile(tmp_path / "logs" / "s.log", 1 << 20, 1)

    async def main() -> None:
        reader = sl.PipeReader(read_end, f, forward_fd=fwd_w)
        reader.start(asyncio.get_running_loop())
        os.write(write_end.fileno(), b"one\ntw")
        await asyncio.sleep(0.05)
        assert (tmp_path / "stderr").read_bytes() == b"one\n"          # half a line is held back
        os.write(write_end.fileno(), b"o\n" + b"L" * (sl.MAX_LINE + 10))
        await asyncio.sleep(0.05)
        write_end.close()                                # EOF: the last piece is stored too
        for _ in range(100):
            if reader.closed:
                break
            await asyncio.sleep(0.01)
        assert reader.closed

    asyncio.run(main())
    os.close(fwd_w)
    assert (tmp_path / "stderr").read_bytes() == b"one\ntwo\n" + b"L" * sl.MAX_LINE + b"\n" + b"L" * 10 + b"\n"
    stored = [line.split(" ", 1)[1] for line in read_lines(tmp_path / "logs" / "s.log")]
    assert stored == ["one", "two", "L" * sl.MAX_LINE, "L" * 10]


def test_pipe_reader_drain_after_exit(tmp_path: Path) -> None:
    read_end, write_end = multiprocessing.get_context("spawn").Pipe(duplex=False)
    f = sl.LogFile(tmp_path / "logs" / "s.log", 1 << 20, 1)
    reader = sl.PipeReader(read_end, f, forward_fd=None)
    os.write(write_end.fileno(), b"last words\nno newline")
    reader.drain()                                       # the writer is still open: what is there now
    reader.close()
    assert [line.split(" ", 1)[1] for line in read_lines(tmp_path / "logs" / "s.log")] == ["last words", "no newline"]
    write_end.close()


@pytest.mark.parametrize("text, expected", [
    ("10m", NOW - 600), ("1h", NOW - 3600), ("1h30m", NOW - 5400), ("90s", NOW - 90), ("2d", NOW - 172800),
    ("500ms", NOW - 0.5), ("1764474000", 1764474000.0), ("1764474000.5", 1764474000.5),
    ("2025-11-30T03:47:22Z", NOW), ("2025-11-30T03:47:22.250+00:00", NOW + 0.25),
    ("2025-11-30T04:47:22+01:00", NOW),
])
def test_parse_since(text: str, expected: float) -> None:
    assert sl.parse_since(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "yesterday", "10 parsecs", "nan", "inf", "10m garbage"])
def test_parse_since_refuses(text: str) -> None:
    with pytest.raises(sl.BadSince):
        sl.parse_since(text, NOW)


def _filled(tmp_path: Path, n: int = 30) -> Path:
    path = tmp_path / "logs" / "s.log"
    f = sl.LogFile(path, 200, 3)
    for i in range(n):
        f.write([f"n{i:03d}".encode()], NOW + i)
    return path


def test_reader_reads_rotated_files_oldest_first(tmp_path: Path) -> None:
    path = _filled(tmp_path)
    r = sl.LogReader(path, 3)
    r.open()
    got = []
    while lines := r.read(limit=40):
        got += lines
    numbers = [int(line.split()[1][1:]) for line in got]
    assert numbers == list(range(numbers[0], 30)) and numbers[0] > 0      # the oldest rotated away
    r.close()


def test_reader_tail_and_since(tmp_path: Path) -> None:
    path = _filled(tmp_path)
    r = sl.LogReader(path, 3)
    r.open()
    assert [line.split()[1] for line in r.tail(3)] == [b"n027", b"n028", b"n029"]
    r.close()
    r = sl.LogReader(path, 3, since=NOW + 26)
    r.open()
    assert [line.split()[1] for line in r.read()] == [b"n026", b"n027", b"n028", b"n029"]
    r.close()


def test_reader_follows_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "s.log"
    f = sl.LogFile(path, 100, 2)
    r = sl.LogReader(path, 2)
    r.open()                                            # nothing there yet
    assert r.read() == [] and not r.changed()
    got: list[bytes] = []
    for i in range(12):                                 # ~35 bytes a line: rotates every 2 lines
        f.write([f"m{i:02d}".encode()], NOW)
        assert r.changed()
        r.follow_rotation()
        got += r.read()
    assert [line.split()[1] for line in got] == [f"m{i:02d}".encode() for i in range(12)]
    assert not r.changed()
    r.close()


def test_daemon_log_handler_writes_formatted_records(tmp_path: Path) -> None:
    root = logging.getLogger()
    handler = sl.install_daemon_log(tmp_path, 1 << 20, 1)
    try:
        logging.getLogger("omnid.test").error("into the file %d", 42)
    finally:
        sl.remove_daemon_log(handler)
    assert handler not in root.handlers
    text = (tmp_path / "logs" / "omnid.log").read_text()
    assert "into the file 42" in text and text.startswith(time.strftime("%Y-", time.gmtime()))
