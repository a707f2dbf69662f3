"""Files in a job's folder: private (omnid.paths' modes, whatever the umask) and written atomically.

Used where a job's outputs are written: a sink stage's worker (worker/outputs.py, which encodes the
values) and, for a Ray-placed sink whose node encoded them, the supervisor (`write_planned`). Blocks
on disk writes; the standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from omnid.paths import PRIVATE_DIR, PRIVATE_FILE
from omnid.protocol import Output

# One file of a sink's outputs, encoded but not written: (output name, file name, bytes, content type, kind).
PlannedFile = tuple[str, str, bytes, str, str]


def private(path: str, flags: int) -> int:
    """`open()`'s opener: a file it creates is 0600 (PRIVATE_FILE), never more whatever the umask."""
    return os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)


def private_dirs(folder: Path) -> None:
    """`folder` and whichever of its parents are missing, each 0700 (PRIVATE_DIR); `mkdir(parents=True)`
    would give the parents the umask's mode."""
    try:
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    except FileNotFoundError:
        private_dirs(folder.parent)
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)


def write_atomic(path: Path, data: bytes) -> int:
    """Write atomically: readers see the whole file or none. Not fsynced (4 ms a file on this
    kind of disk, more than a small job's whole run): like the job database (WAL,
    synchronous=NORMAL), a power cut may lose the last moments; a crash of omnid loses nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb", opener=private) as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def write_planned(job: str, job_dir: Path, planned: list[PlannedFile]) -> list[Output]:
    """Write planned files into the job's folder; one `Output` event per file."""
    private_dirs(job_dir)
    events: list[Output] = []
    for out_name, file, data, ctype, kind in planned:
        if "/" in file or file.startswith(".") or file in ("", ".."):
            raise ValueError(f"not a file name: {file!r}")
        size = write_atomic(job_dir / file, data)
        events.append(Output(job=job, name=out_name, file=file, kind=kind, content_type=ctype, size=size))
    return events
