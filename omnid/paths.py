"""Default file locations: system paths for root, XDG paths for everyone else.

Pure functions, no I/O; used by the config loader in the supervisor and by `omnid --check`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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
