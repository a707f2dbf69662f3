"""Default file locations: system paths for root, XDG paths for everyone else; the modes of
what the daemon creates there; and where in a job's folder its live outputs stream.

Pure functions and constants, no I/O; used by the config loader in the supervisor and by
`omnid --check`, for the modes by the job store and the workers' output writer, and for the stream
files by that writer and the API that reads them (`?stream=1`, a speech's live audio).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Private by default: the state dir, its job database, the job folders and every output file are
# the daemon's user's alone (0700/0600, like PostgreSQL's data directory). The API is how a user
# reads their own jobs (it checks the caller's uid); a group bit here would hand every job to
# whoever shares the daemon's group, and that group is the one that may use the socket
# (systemd/omnid.socket). Modes are set at creation; the daemon's umask (UMASK, set at start and
# inherited by the stage workers) covers what other code creates there (manifest.json, sqlite's
# -wal and -shm files, engine caches).
UMASK = 0o077
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


# A job's live outputs: a pipeline's last stage appends each output's segments to its stream file in
# the job's folder while the job runs (worker/outputs.py writes them; the API reads them as they grow).
STREAM_DIR = ".stream"


def stream_file(job_dir: Path, name: str) -> Path:
    """Where a pipeline's last stage appends an output's segments while the job runs."""
    return job_dir / STREAM_DIR / (re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")[:100] or "output")


@dataclass(frozen=True)
class Defaults:
    config: Path
    socket: Path
    state_dir: Path
    lock_dir: Path


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / fallback


def defaults() -> Defaults:
    """Where omnid keeps its files for the current user (SPEC: Processes and files)."""
    if os.geteuid() == 0:
        return Defaults(config=Path("/etc/omnid/omnid.toml"), socket=Path("/run/omnid/omnid.sock"),
                        state_dir=Path("/var/lib/omnid"), lock_dir=Path("/run/lock/omnid"))
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}")
    return Defaults(config=_xdg("XDG_CONFIG_HOME", ".config") / "omnid" / "omnid.toml",
                    socket=runtime / "omnid" / "omnid.sock",
                    state_dir=_xdg("XDG_STATE_HOME", ".local/state") / "omnid",
                    lock_dir=runtime / "omnid" / "lock")
