"""The `[daemon]` table: read through its model (schema.py's `DaemonTable`: every key's type, bounds
and words), then turned into the `DaemonConfig` the daemon runs with (paths resolved from the config
file's folder, the socket's mode, the TCP listener's addresses, `[daemon.owners.WHO]`, `tracing`);
and the check that a listener beyond loopback has API keys to ask for.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from omnid import paths
from omnid.config.checker import Checker, resolve_path, typename
from omnid.config.schema import DaemonTable, read
from omnid.config_types import DaemonConfig, OwnerPolicy, TracingConfig
from omnid.keys import KeyFileError, key_path, read_keys


def _host_port(value: str) -> tuple[str, int]:
    """"127.0.0.1:9464" or "[::1]:9464" -> (host, port) (the model checked the form)."""
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


# The keys whose values the parser turns into something else (paths, a mode, addresses, tables).
_CONVERTED = ("socket", "state_dir", "lock_dir", "socket_mode", "metrics_listen", "listen", "allow_origins",
              "owners", "tracing")


def parse_daemon(c: Checker, raw: Any, base: Path) -> DaemonConfig:
    d = read(c, DaemonTable, {} if raw is None else raw, "daemon") or DaemonTable()
    defaults = paths.defaults()
    plain = d.model_dump(exclude=set(_CONVERTED))
    return DaemonConfig(
        socket=resolve_path(base, d.socket) if d.socket else defaults.socket,
        state_dir=resolve_path(base, d.state_dir) if d.state_dir else defaults.state_dir,
        lock_dir=resolve_path(base, d.lock_dir) if d.lock_dir else defaults.lock_dir,
        socket_mode=_socket_mode(c, raw.get("socket_mode", 0o660) if isinstance(raw, dict) else 0o660),
        metrics_listen=_host_port(d.metrics_listen) if d.metrics_listen else None,
        listen=_listen(c, d, raw.get("listen", []) if isinstance(raw, dict) else []),
        allow_origins=tuple(d.allow_origins),
        owners={who: OwnerPolicy(**o.model_dump()) for who, o in d.owners.items()},
        tracing=TracingConfig(**d.tracing.model_dump()) if d.tracing is not None else None,
        **plain,
    )


def _socket_mode(c: Checker, raw: Any) -> int:
    """`socket_mode`: an octal string ("0660") or an integer, from 0 to 0o777."""
    mode = 0o660
    if isinstance(raw, str):
        try:
            mode = int(raw, 8)
        except ValueError:
            c.add("daemon.socket_mode", f"must be an octal string like \"0660\", not {raw!r}")
    elif isinstance(raw, int) and not isinstance(raw, bool):
        mode = raw
    else:
        c.add("daemon.socket_mode", f"must be an integer or a string, not {typename(raw)}")
    if not 0 <= mode <= 0o777:
        c.add("daemon.socket_mode", "must be between 0000 and 0777")
        mode = 0o660
    return mode


def _listen(c: Checker, d: DaemonTable, raw: Any) -> tuple[tuple[str, int], ...]:
    """`listen`: the TCP listener's addresses (the model checked each), none twice."""
    listen: list[tuple[str, int]] = []
    for i, item in enumerate(raw if isinstance(raw, list) else []):
        if item not in d.listen:
            continue                    # refused by the model, said already
        hp = _host_port(item)
        if hp in listen:
            c.add(f"daemon.listen[{i}]", f"{item!r} is listed twice")
        else:
            listen.append(hp)
    return tuple(listen)


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False            # a name: it may resolve to anything


def check_listen_keys(c: Checker, daemon: DaemonConfig) -> None:
    """A TCP listener beyond loopback needs API keys first (anyone who reaches it could try)."""
    wide = [f"{h}:{p}" for h, p in daemon.listen if not is_loopback(h)]
    if not wide:
        return
    path = key_path(daemon.state_dir)
    try:
        n = len(read_keys(path))
    except KeyFileError as e:
        c.add("daemon.listen", f"{', '.join(wide)} is not a loopback address, and {e}")
        return
    if not n:
        c.add("daemon.listen", f"{', '.join(wide)} is not a loopback address and there are no API keys "
                               f"({path} has none): add one first (omnictl key add NAME), or listen on "
                               "127.0.0.1 or ::1 only")
