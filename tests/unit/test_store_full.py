"""The job store when its writes fail, in-process: sqlite is made full for real with
`PRAGMA max_page_count` (the database may not grow past the pages it has: SQLITE_FULL), as a full
disk makes it. Writes stay pending and are read through, `commit` refuses, nothing raises from a
flush, `on_full` lets a delete through, and everything reaches the database once there is room.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnid.store import JobStore, StoreWriteFailed, disk_full_error
from omnid.vocabulary import JobRecord, JobState, StageRun


def record(i: int, state: JobState = JobState.QUEUED) -> JobRecord:
    return JobRecord(id=f"job{i:04d}", pipeline="p", owner_uid=0, created_at=1.0 + i, timeout_s=60.0,
                     inputs={"text": "x" * 2000}, params={}, stages={"a": StageRun()}, state=state)


def fill(store: JobStore) -> None:
    """No page more for the database: the next write that needs one fails with SQLITE_FULL."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")


def room(store: JobStore) -> None:
    store.db.execute("PRAGMA max_page_count = 1073741823")


def test_writes_that_fail_are_kept_read_through_and_written_later(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    store.save(record(0, JobState.SUCCEEDED))
    assert store.flush() and store.write_error is None
    fill(store)
    for i in range(1, 40):                          # more than the last page holds
        store.save(record(i))
        store.append_event(f"job{i:04d}", 1, {"type": "state", "state": "queued"})
    assert store.flush() is False                   # never raises
    assert store.write_error is not None and "full" in store.write_error
    with pytest.raises(StoreWriteFailed) as err:
        store.commit()
    assert err.value.disk_full
    # what is pending is read through: the latest word on every job
    assert store.get("job0039") is not None and store.get("job0039").state is JobState.QUEUED  # type: ignore[union-attr]
    assert store.resolve("job0039") == "job0039"
    assert store.events("job0039") == [{"type": "state", "state": "queued"}]
    listed = store.list(limit=1000)
    assert [j.id for j in listed][:2] == ["job0039", "job0038"] and len(listed) == 40
    assert [j.id for j in store.list(state=JobState.SUCCEEDED)] == ["job0000"]
    # a job that never reached the disk can be forgotten (its pending writes go too)
    store.delete_many(["job0039"])
    assert store.get("job0039") is None
    room(store)
    assert store.flush() and store.write_error is None and not store.pending
    assert store.counts()["jobs"] == 39 and store.get("job0039") is None
    store.close()
    again = JobStore(tmp_path)                      # on disk, as the next start reads it
    assert len(again.list(limit=1000)) == 39
    again.close()


def test_deletes_need_no_room_and_a_failed_write_is_tried_again_once_on_full_frees_some(tmp_path: Path) -> None:
    freed: list[bool] = []
    store = JobStore(tmp_path)
    for i in range(30):
        store.save(record(i, JobState.SUCCEEDED))
        store.job_dir(record(i).id).mkdir()
        (store.job_dir(record(i).id) / "out.bin").write_bytes(os.urandom(1000))
    assert store.flush()
    fill(store)
    # rm on a full database: the folders first, then the rows, which free pages and need none
    assert store.delete_many([record(i).id for i in range(10)]) == 10
    assert not any(store.job_dir(record(i).id).exists() for i in range(10))
    assert store.counts()["jobs"] == 20

    def on_full() -> bool:                          # the daemon gives back its ballast here
        freed.append(True)
        room(store)
        return True

    fill(store)
    store.on_full = on_full
    for i in range(100, 140):
        store.save(record(i))
    assert store.flush() and freed == [True]        # it failed, space came back, it went through
    assert store.write_error is None and store.counts()["jobs"] == 60
    store.close()


def test_disk_full_errors_are_told_apart() -> None:
    assert disk_full_error(OSError(28, "No space left on device"))
    assert not disk_full_error(OSError(13, "Permission denied"))
