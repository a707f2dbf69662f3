"""The `[daemon]` table: sockets, directories, timeouts, logs, retention, the TCP listener
(`listen`, `allow_origins`), `[daemon.owners.WHO]`, `tracing`; and the check that a listener beyond
loopback has API keys to ask for.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnid import paths
from omnid.config.checker import _Checker, _resolve, _typename
from omnid.config_types import DaemonConfig, OwnerPolicy, TracingConfig
from omnid.keys import KeyFileError, key_path, read_keys


def _host_port(c: _Checker, value: str | None, path: str) -> tuple[str, int] | None:
    """"127.0.0.1:9464" or "[::1]:9464" -> (host, port)."""
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        c.add(path, f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:9464\"), not {value!r}")
        return None
    return host, int(port)


def _parse_daemon(c: _Checker, raw: Any, base: Path) -> DaemonConfig:
    d = c.table(raw, "daemon")
    c.unknown(d, DaemonConfig.__dataclass_fields__, "daemon")
    defaults = paths.defaults()
    socket = c.get(d, "socket", "daemon", str)
    state_dir = c.get(d, "state_dir", "daemon", str)
    lock_dir = c.get(d, "lock_dir", "daemon", str)
    mode_raw = c.get(d, "socket_mode", "daemon", (int, str), 0o660)
    socket_mode = 0o660
    if isinstance(mode_raw, str):
        try:
            socket_mode = int(mode_raw, 8)
        except ValueError:
            c.add("daemon.socket_mode", f"must be an octal string like \"0660\", not {mode_raw!r}")
    elif isinstance(mode_raw, int):
        socket_mode = mode_raw
    if not 0 <= socket_mode <= 0o777:
        c.add("daemon.socket_mode", "must be between 0000 and 0777")
    level = c.get(d, "log_level", "daemon", str, "info")
    if level not in ("debug", "info", "warning", "error"):
        c.add("daemon.log_level", "must be one of debug, info, warning, error")
    fmt = c.get(d, "log_format", "daemon", str, "auto")
    if fmt not in ("auto", "console", "json"):
        c.add("daemon.log_format", "must be \"console\" or \"json\", or \"auto\" (json unless stderr is a terminal)")
    return DaemonConfig(
        socket=_resolve(base, socket) if socket else defaults.socket,
        state_dir=_resolve(base, state_dir) if state_dir else defaults.state_dir,
        lock_dir=_resolve(base, lock_dir) if lock_dir else defaults.lock_dir,
        max_queued_jobs=c.positive(d, "max_queued_jobs", "daemon", 256, integer=True),
        default_timeout_s=float(c.positive(d, "default_timeout_s", "daemon", 600.0)),
        socket_mode=socket_mode,
        socket_group=c.get(d, "socket_group", "daemon", str),
        max_request_bytes=c.positive(d, "max_request_bytes", "daemon", 64 << 20, integer=True),
        heartbeat_interval_s=float(c.positive(d, "heartbeat_interval_s", "daemon", 1.0)),
        heartbeat_timeout_s=float(c.positive(d, "heartbeat_timeout_s", "daemon", 30.0)),
        startup_timeout_s=float(c.positive(d, "startup_timeout_s", "daemon", 900.0)),
        cancel_grace_s=float(c.positive(d, "cancel_grace_s", "daemon", 5.0)),
        stop_grace_s=float(c.positive(d, "stop_grace_s", "daemon", 10.0)),
        drain_timeout_s=float(c.positive(d, "drain_timeout_s", "daemon", 60.0, allow_zero=True)),
        admin_group=c.get(d, "admin_group", "daemon", str),
        restart_backoff_s=float(c.positive(d, "restart_backoff_s", "daemon", 1.0)),
        restart_backoff_max_s=float(c.positive(d, "restart_backoff_max_s", "daemon", 30.0)),
        max_restarts=c.positive(d, "max_restarts", "daemon", 5, integer=True, allow_zero=True),
        restart_window_s=float(c.positive(d, "restart_window_s", "daemon", 300.0)),
        log_level=level or "info",
        log_format=fmt or "auto",
        shm_min_bytes=c.positive(d, "shm_min_bytes", "daemon", 1 << 20, integer=True),
        keep_jobs_days=float(c.positive(d, "keep_jobs_days", "daemon", 30.0, allow_zero=True)),
        keep_jobs=c.positive(d, "keep_jobs", "daemon", 10000, integer=True, allow_zero=True),
        retention_interval_s=float(c.positive(d, "retention_interval_s", "daemon", 60.0)),
        client_idle_timeout_s=float(c.positive(d, "client_idle_timeout_s", "daemon", 30.0)),
        metrics_listen=_host_port(c, c.get(d, "metrics_listen", "daemon", str), "daemon.metrics_listen"),
        log_file_max_bytes=c.positive(d, "log_file_max_bytes", "daemon", 10 << 20, integer=True),
        log_file_keep=c.positive(d, "log_file_keep", "daemon", 3, integer=True, allow_zero=True),
        ray_address=c.get(d, "ray_address", "daemon", str),
        preload_workers=bool(c.get(d, "preload_workers", "daemon", bool, True)),
        **_parse_tcp(c, d),
        fair_share=bool(c.get(d, "fair_share", "daemon", bool, True)),
        max_wait_s=float(c.positive(d, "max_wait_s", "daemon", 300.0, allow_zero=True)),
        owners=_parse_owners(c, d),
        min_free_mb=c.positive(d, "min_free_mb", "daemon", 512, integer=True, allow_zero=True),
        min_free_inodes=c.positive(d, "min_free_inodes", "daemon", 1024, integer=True, allow_zero=True),
        ballast_mb=c.positive(d, "ballast_mb", "daemon", 32, integer=True, allow_zero=True),
        tracing=_parse_tracing(c, d.get("tracing")),
        max_realtime_sessions=c.positive(d, "max_realtime_sessions", "daemon", 64, integer=True),
        max_realtime_sessions_per_key=c.positive(d, "max_realtime_sessions_per_key", "daemon", 8, integer=True),
        realtime_idle_timeout_s=float(c.positive(d, "realtime_idle_timeout_s", "daemon", 600.0)),
        realtime_transcription=c.get(d, "realtime_transcription", "daemon", str),
    )


def _parse_tracing(c: _Checker, raw: Any) -> TracingConfig | None:
    """`[daemon] tracing = { otlp_endpoint, sample, service_name }` (absent: tracing off)."""
    if raw is None:
        return None
    path = "daemon.tracing"
    t = c.table(raw, path)
    c.unknown(t, TracingConfig.__dataclass_fields__, path)
    default = TracingConfig()
    endpoint = c.get(t, "otlp_endpoint", path, str, default.otlp_endpoint)
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", endpoint):
        c.add(f"{path}.otlp_endpoint", f"must be an http(s) URL like \"http://127.0.0.1:4318\" (an OTLP/HTTP "
                                       f"receiver: an OpenTelemetry Collector, Jaeger), not {endpoint!r}")
        endpoint = default.otlp_endpoint
    sample = c.get(t, "sample", path, (int, float), 1.0)
    if not 0.0 <= sample <= 1.0:
        c.add(f"{path}.sample", f"must be between 0 and 1 (the share of traces kept), not {sample}")
        sample = 1.0
    name = c.get(t, "service_name", path, str, default.service_name)
    if not name.strip():
        c.add(f"{path}.service_name", "must not be empty")
        name = default.service_name
    return TracingConfig(otlp_endpoint=endpoint, sample=float(sample), service_name=name)


def _parse_tcp(c: _Checker, d: Mapping[str, Any]) -> dict[str, Any]:
    """`listen`, `allow_origins`, `metrics_without_key`: the TCP listener's keys of `[daemon]`."""
    raw = c.get(d, "listen", "daemon", list, [])
    listen: list[tuple[str, int]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            c.add(f"daemon.listen[{i}]", f"must be \"HOST:PORT\" (e.g. \"127.0.0.1:8080\"), not {_typename(item)}")
            continue
        hp = _host_port(c, item, f"daemon.listen[{i}]")
        if hp is not None and hp in listen:
            c.add(f"daemon.listen[{i}]", f"{item!r} is listed twice")
        elif hp is not None:
            listen.append(hp)
    origins = c.get(d, "allow_origins", "daemon", list, [])
    for i, origin in enumerate(origins):
        if not isinstance(origin, str) or not (origin == "*" or re.match(r"^https?://[^/\s]+$", origin)):
            c.add(f"daemon.allow_origins[{i}]", f"must be an origin like \"https://chat.example.com\" (scheme "
                                                f"and host, no path) or \"*\", not {origin!r}")
    return {"listen": tuple(listen), "allow_origins": tuple(o for o in origins if isinstance(o, str)),
            "metrics_without_key": bool(c.get(d, "metrics_without_key", "daemon", bool, False))}


def _parse_owners(c: _Checker, d: Mapping[str, Any]) -> dict[str, OwnerPolicy]:
    """`[daemon.owners.WHO]`: "default", a uid ("1000") or "key:NAME", each with weight, max_priority, max_queued."""
    raw = c.get(d, "owners", "daemon", dict, {})
    owners: dict[str, OwnerPolicy] = {}
    for who, entry in (raw or {}).items():
        path = f"daemon.owners.{who}"
        if not (who == "default" or who.isdigit() or (who.startswith("key:") and len(who) > 4)):
            c.add(path, "must be \"default\", a uid (\"1000\") or \"key:NAME\"")
            continue
        if not isinstance(entry, dict):
            c.add(path, f"must be a table, not {_typename(entry)}")
            continue
        c.unknown(entry, ("weight", "max_priority", "max_queued"), path)
        weight = c.positive(entry, "weight", path, None)
        top = c.get(entry, "max_priority", path, int, None)
        if isinstance(top, bool) or (top is not None and abs(top) > 1_000_000):
            c.add(f"{path}.max_priority", "must be an integer from -1000000 to 1000000")
            top = None
        owners[who] = OwnerPolicy(weight=None if weight is None else float(weight), max_priority=top,
                                  max_queued=c.positive(entry, "max_queued", path, None, integer=True))
    return owners


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only (127.0.0.0/8, ::1, "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False            # a name: it may resolve to anything


def _check_listen_keys(c: _Checker, daemon: DaemonConfig) -> None:
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
