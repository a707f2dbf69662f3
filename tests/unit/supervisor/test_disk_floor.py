"""The free-space floor counts the ballast that is owed (omnid/supervisor/resources.py): with the
ballast given back (or never made), its size is still set aside, so giving it back does not let
submits eat the room it was freed for. In-process; `statvfs` tells the free space the test sets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnid.supervisor.resources import MB, DiskWatch


class Disk:
    """What statvfs says of the state dir: `free` bytes, plenty of inodes."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path: object) -> os.statvfs_result:
        blocks = self.free // 4096
        return os.statvfs_result((4096, 4096, 1 << 30, blocks, blocks, 1 << 20, 1 << 19, 1 << 19, 0, 255))


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    d = Disk(0)
    monkeypatch.setattr("omnid.supervisor.resources.os.statvfs", d)
    return d


def make_ballast(watch: DiskWatch) -> None:
    """A 1 MiB ballast file on disk (real blocks: its size is what st_blocks says)."""
    with open(watch.ballast_path, "wb") as f:
        f.write(b"\1" * MB)
        f.flush()
        os.fsync(f.fileno())
    assert watch.ballast_bytes == MB and watch._ballast_size() >= MB


def test_the_owed_ballast_is_held_below_the_floor(tmp_path: Path, disk: Disk) -> None:
    watch = DiskWatch(tmp_path, min_free_mb=100, min_free_inodes=10, ballast_mb=50)
    assert not watch.ballast_path.exists()           # never made (or given back): 50 MiB owed
    disk.free = 120 * MB                             # over the floor alone, under it with what is owed
    state = watch.check()
    assert not state.ballast and state.full, state
    assert state.reason is not None and "50 MiB of it owed to the ballast" in state.reason
    assert "under daemon.min_free_mb = 100" in state.reason
    disk.free = 151 * MB                             # the floor and the ballast both fit
    assert not watch.check().full


def test_a_ballast_in_place_is_owed_nothing(tmp_path: Path, disk: Disk) -> None:
    watch = DiskWatch(tmp_path, min_free_mb=100, min_free_inodes=10, ballast_mb=1)
    make_ballast(watch)
    disk.free = 100 * MB
    state = watch.check()
    assert state.ballast and not state.full, state
    disk.free = 100 * MB - 1
    assert watch.check().full


def test_giving_the_ballast_back_does_not_reopen_the_door(tmp_path: Path, disk: Disk) -> None:
    watch = DiskWatch(tmp_path, min_free_mb=100, min_free_inodes=10, ballast_mb=1)
    make_ballast(watch)
    disk.free = 99 * MB + MB // 2                    # full, with the ballast in place
    assert watch.check().full
    assert watch.release_ballast() and not watch.ballast_path.exists()
    disk.free += MB                                  # the freed megabyte shows as free space...
    state = watch.check()
    assert state.full and not state.ballast, state   # ...and is owed back: still under the floor
