"""A small synchronous client for the omnid socket API (HTTP/1.1 + JSON over a Unix socket).

Where it runs: in the caller's process and thread -- the ``omnictl`` CLI's main thread, or any
local program that imports ``omnictl``. It starts no threads and keeps no connection open between
calls: every call dials the socket afresh, so one ``Client`` may be shared between threads.

What it blocks on: connecting to the socket and reading each response, bounded by the client's
``timeout`` (30 s by default). The exception is :meth:`Client.events`, which, once the response
has started, blocks without limit until the daemon sends the next event or ends the stream.

Only the standard library (and ``omnid.vocabulary``, which is standard-library only itself) is
imported here, so ``import omnictl`` stays fast and never pulls in
torch, vLLM or diffusers. Nothing here prints; results are returned and failures raised as
:class:`ClientError` subclasses.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import mimetypes
import os
import re
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from omnictl.transport import (  # noqa: F401 (re-exported)
    JSON,
    ApiError,
    ClientError,
    ConnectionLost,
    DaemonUnreachable,
    EventsIdleTimeout,
    ProtocolError,
    Transport,
    UnixHTTPConnection,
)
from omnid.vocabulary import TERMINAL_JOB_STATES, JobState

__all__ = [
    "ApiError",
    "Client",
    "ClientError",
    "ConnectionLost",
    "DaemonUnreachable",
    "DEFAULT_TIMEOUT_S",
    "EventsIdleTimeout",
    "JOB_STATES",
    "ProtocolError",
    "TERMINAL_STATES",
    "default_socket_path",
    "file_input",
    "parse_prometheus",
]

DEFAULT_TIMEOUT_S: float = 30.0
ROOT_SOCKET_PATH = "/run/omnid/omnid.sock"
# Plain strings (not the enums), as the JSON the daemon sends carries them.
JOB_STATES: tuple[str, ...] = tuple(str(state) for state in JobState)
TERMINAL_STATES: frozenset[str] = frozenset(str(state) for state in TERMINAL_JOB_STATES)

# Output bodies are copied to disk in pieces of this size, so a large audio file never sits in memory.
_COPY_CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """Return the socket to dial: ``explicit`` > ``$OMNID_SOCKET`` > the per-user default.

    The default is ``/run/omnid/omnid.sock`` for root, else ``$XDG_RUNTIME_DIR/omnid/omnid.sock``,
    falling back to ``/run/user/<uid>/omnid/omnid.sock`` when ``XDG_RUNTIME_DIR`` is unset.
    Empty strings count as unset, the way shells treat ``OMNID_SOCKET=``.
    """
    if explicit:
        return os.fspath(explicit)
    from_env = os.environ.get("OMNID_SOCKET")
    if from_env:
        return from_env
    uid = os.getuid()
    if uid == 0:
        return ROOT_SOCKET_PATH
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return os.path.join(runtime_dir, "omnid", "omnid.sock")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)


def parse_prometheus(text: str) -> dict[str, list[JSON]]:
    """Prometheus text exposition as ``{name: [{"labels": {...}, "value": number}]}``, in its order.

    Comments (``# HELP``, ``# TYPE``) and lines that are not samples are skipped. A value that is
    not a finite number (``+Inf``, ``NaN``) stays the string it was, so the result is plain JSON.
    """
    out: dict[str, list[JSON]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels_text, raw = match.groups()
        labels = {key: _unescape(value) for key, value in _LABEL.findall(labels_text or "")}
        try:
            number = float(raw)
        except ValueError:
            continue
        value: Any = number if math.isfinite(number) else raw
        out.setdefault(name, []).append({"labels": labels, "value": value})
    return out


def file_input(path: str | os.PathLike[str]) -> JSON:
    """Read a local file into the API's file input shape ``{"b64": ..., "filename": ...}``."""
    data = Path(path).read_bytes()
    return {"b64": base64.b64encode(data).decode("ascii"), "filename": os.path.basename(os.fspath(path))}


def _safe_filename(output: Mapping[str, Any]) -> str:
    """Pick a local file name for an output: its ``file`` basename, else its name plus an extension."""
    candidate = os.path.basename(str(output.get("file") or ""))
    if candidate in ("", ".", ".."):
        name = os.path.basename(str(output.get("name") or "output")) or "output"
        extension = mimetypes.guess_extension(str(output.get("content_type") or "").split(";")[0].strip()) or ""
        candidate = name + ("" if name.endswith(extension) else extension)
    return candidate


class Client(Transport):
    """Talks to one omnid daemon over its Unix socket. Every method returns the API's JSON, parsed.

    ``socket_path`` follows :func:`default_socket_path`; ``timeout`` bounds connecting and each
    read (``None``: wait forever). Methods raise :class:`DaemonUnreachable` when the socket cannot
    be dialed, :class:`ApiError` when the daemon answers non-2xx, :class:`ProtocolError` when the
    answer is not JSON.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.socket_path = default_socket_path(socket_path)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Client(socket_path={self.socket_path!r}, timeout={self.timeout!r})"

    @staticmethod
    def _job_path(job_id: str, *rest: str) -> str:
        parts = [quote(str(job_id), safe="")] + [quote(str(part), safe="") for part in rest]
        return "/v1/jobs/" + "/".join(parts)

    # --- daemon ----------------------------------------------------------------------------

    def health(self) -> JSON:
        """``GET /v1/health``: 200 while the daemon is alive."""
        return self._json("GET", "/v1/health")

    def ready(self) -> tuple[bool, JSON]:
        """``GET /v1/ready``: ``(True, body)`` on 200, ``(False, body)`` on 503 (``body["not_ready"]``)."""
        status, body = self._request("GET", "/v1/ready", accept_statuses=(503,))
        return status == 200, body if isinstance(body, dict) else {}

    def pipelines(self) -> JSON:
        """``GET /v1/pipelines``: ``{"pipelines": [...]}``."""
        return self._json("GET", "/v1/pipelines")

    def pipeline(self, name: str) -> JSON:
        """``GET /v1/pipelines/{name}``: one pipeline with its inputs, each stage's parameters
        (types, limits, defaults), edges and outputs; 404 ``unknown_pipeline``."""
        return self._json("GET", f"/v1/pipelines/{quote(name, safe='')}")

    def openapi(self) -> JSON:
        """``GET /v1/openapi.json``: the API's OpenAPI 3.1 document."""
        return self._json("GET", "/v1/openapi.json")

    def stages(self) -> JSON:
        """``GET /v1/stages``: ``{"stages": [...]}``."""
        return self._json("GET", "/v1/stages")

    def restart_stage(self, name: str) -> JSON:
        """``POST /v1/stages/{name}/restart`` (root or the daemon's admin group): new workers; 202."""
        return self._json("POST", f"/v1/stages/{quote(name, safe='')}/restart")

    def sleep_stage(self, name: str) -> JSON:
        """``POST /v1/stages/{name}/sleep`` (root or the admin group): stop its workers until a job
        needs it; 202 (200 if asleep already); 409 ``stage_busy`` while it has jobs."""
        return self._json("POST", f"/v1/stages/{quote(name, safe='')}/sleep")

    def wake_stage(self, name: str) -> JSON:
        """``POST /v1/stages/{name}/wake`` (root or the admin group): load a sleeping stage again;
        202 (200 if awake already)."""
        return self._json("POST", f"/v1/stages/{quote(name, safe='')}/wake")

    def reload(self) -> JSON:
        """``POST /v1/reload`` (admin): read the config file again, as SIGHUP; ``{"status", "reloaded"}``."""
        return self._json("POST", "/v1/reload")

    def adapters(self, stage: str) -> JSON:
        """``GET /v1/stages/{name}/adapters``: the stage's LoRA adapters in force and its base model."""
        return self._json("GET", f"/v1/stages/{quote(stage, safe='')}/adapters")

    def add_adapter(self, stage: str, name: str, path: str) -> JSON:
        """``POST /v1/stages/{name}/adapters`` (root or the admin group): a LoRA adapter, at once."""
        return self._json("POST", f"/v1/stages/{quote(stage, safe='')}/adapters", body={"name": name, "path": path})

    def remove_adapter(self, stage: str, name: str) -> JSON:
        """``DELETE /v1/stages/{name}/adapters/{adapter}`` (root or the admin group)."""
        return self._json("DELETE", f"/v1/stages/{quote(stage, safe='')}/adapters/{quote(name, safe='')}")

    def keys(self) -> JSON:
        """``GET /v1/keys`` (root or the admin group, on the socket): ``{"keys": [...], "file"}``;
        never the keys themselves."""
        return self._json("GET", "/v1/keys")

    def add_key(self, name: str, uid: int | None = None, max_jobs: int | None = None,
                rps: float | None = None, admin: bool = False) -> JSON:
        """``POST /v1/keys``: a new API key for the TCP listener, for `uid` (default: the caller's;
        root must name one); ``admin``: it may do the admin actions over TCP. The answer's ``key``
        is its secret, shown this once."""
        body: dict[str, Any] = {"name": name}
        if admin:
            body["admin"] = True
        for field_name, value in (("uid", uid), ("max_jobs", max_jobs), ("rps", rps)):
            if value is not None:
                body[field_name] = value
        return self._json("POST", "/v1/keys", body=body)

    def remove_key(self, name: str) -> JSON:
        """``DELETE /v1/keys/{name}``: the key stops working at once."""
        return self._json("DELETE", f"/v1/keys/{quote(name, safe='')}")

    def logs(
        self,
        stage: str | None = None,
        *,
        since: str | float | None = None,
        tail: int | None = None,
        follow: bool = False,
        replica: int | None = None,
    ) -> Iterator[str]:
        """``GET /v1/stages/{stage}/logs`` (``stage=None``: ``GET /v1/logs``, the daemon's own records):
        yield each line, ``"<UTC time it was read> <line>"``, without its newline (root or the daemon's
        admin group; 403 ``not_admin`` otherwise).

        ``since``: a duration ago (``"10m"``, ``"1h"``), an ISO 8601 time or a Unix time; ``tail``: only
        the last N lines; ``follow``: keep yielding new lines, without a time limit, until the caller
        closes the generator (or the daemon stops). Connecting is bounded by the client's timeout.
        """
        path = "/v1/logs" if stage is None else f"/v1/stages/{quote(stage, safe='')}/logs"
        query = {"since": since, "tail": tail, "follow": "1" if follow else None, "replica": replica}
        conn, response = self._open("GET", path, query=query)
        try:
            self._check(response)
            if follow and conn.sock is not None:
                conn.sock.settimeout(None)      # a quiet stage may say nothing for hours
            while True:
                try:
                    raw = response.readline()
                except (socket.timeout, TimeoutError):
                    raise ConnectionLost(self.socket_path, f"no data within {self.timeout} s") from None
                except (OSError, http.client.HTTPException) as exc:
                    raise ConnectionLost(self.socket_path, f"log stream broke ({exc or type(exc).__name__})") from None
                if not raw:
                    return
                yield raw.decode("utf-8", "replace").rstrip("\n")
        finally:
            conn.close()

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        conn, response = self._open("GET", "/metrics")
        try:
            self._check(response)
            return self._read_body(response).decode("utf-8", "replace")
        finally:
            conn.close()

    # --- jobs ------------------------------------------------------------------------------

    def submit(
        self,
        pipeline: str,
        inputs: Mapping[str, Any],
        params: Mapping[str, Mapping[str, Any]] | None = None,
        timeout_s: float | None = None,
        priority: int | None = None,
    ) -> JSON:
        """``POST /v1/jobs``: submit a job and return it (state ``queued`` or later); ``priority``:
        lower runs earlier (0 by default), within the owner's ``max_priority``.

        ``inputs`` feed the pipeline's first stage(s); a file goes in as :func:`file_input`.
        ``params`` are per-stage overrides: ``{"draw": {"num_inference_steps": 30}}``.
        """
        body: JSON = {"pipeline": pipeline, "inputs": dict(inputs), "params": {k: dict(v) for k, v in (params or {}).items()}}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if priority is not None:
            body["priority"] = priority
        return self._json("POST", "/v1/jobs", body=body)

    def jobs(self, state: str | None = None, pipeline: str | None = None, limit: int | None = None) -> JSON:
        """``GET /v1/jobs``: ``{"jobs": [...]}``, the caller's jobs, newest first."""
        return self._json("GET", "/v1/jobs", query={"state": state, "pipeline": pipeline, "limit": limit})

    def job(self, job_id: str) -> JSON:
        """``GET /v1/jobs/{id}``: one job with per-stage state, outputs and error."""
        return self._json("GET", self._job_path(job_id))

    def cancel(self, job_id: str) -> JSON:
        """``POST /v1/jobs/{id}/cancel``: cancel a queued or running job (idempotent); returns the job."""
        return self._json("POST", self._job_path(job_id, "cancel"))

    def delete(self, job_id: str) -> JSON:
        """``DELETE /v1/jobs/{id}``: forget a terminal job and its files; returns ``{"deleted": id}``."""
        return self._json("DELETE", self._job_path(job_id))

    def events(self, job_id: str, *, idle_timeout: float | None = None) -> Iterator[JSON]:
        """``GET /v1/jobs/{id}/events``: yield each event as it arrives, from the job's start.

        The stream ends after the terminal ``state`` event. Connecting is bounded by the client's
        timeout. Waiting for events is bounded only by ``idle_timeout``: with ``None`` (the
        default) it waits without limit; else it raises :class:`EventsIdleTimeout` (a
        :class:`TimeoutError` too) when no event arrives for that many seconds. Closing the
        generator early closes the connection. Raises :class:`ConnectionLost` when the stream
        breaks before the terminal state.
        """
        if idle_timeout is not None and not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds or None, not {idle_timeout!r}")
        conn, response = self._open("GET", self._job_path(job_id, "events"))
        seen = 0
        try:
            self._check(response)
            if conn.sock is not None:
                # A job may think for minutes between events; by default only a dead daemon ends the wait.
                conn.sock.settimeout(idle_timeout)
            while True:
                try:
                    line = response.readline()
                except (socket.timeout, TimeoutError):
                    raise EventsIdleTimeout(str(job_id), float(idle_timeout or 0), seen) from None
                except (OSError, http.client.HTTPException) as exc:
                    raise ConnectionLost(self.socket_path, f"event stream broke ({exc or type(exc).__name__})") from None
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise ProtocolError(f"the daemon sent an event line that is not JSON: {line[:200]!r}") from None
                if not isinstance(event, dict):
                    raise ProtocolError(f"the daemon sent an event that is not an object: {line[:200]!r}")
                seen += 1
                yield event
                if event.get("type") == "state" and event.get("state") in TERMINAL_STATES:
                    # Stop here even if the daemon kept the stream open: nothing can follow the end.
                    return
            raise ConnectionLost(self.socket_path, "event stream ended before the job finished")
        finally:
            conn.close()

    def wait(self, job_id: str, on_event: Callable[[JSON], None] | None = None) -> JSON:
        """Follow the job's events until it ends, calling ``on_event`` for each; return the final job.

        If the daemon is gone right after the job's last event (it was stopped, and that
        ended the job), the job is rebuilt from that terminal event rather than lost.
        """
        last: JSON = {}
        for event in self.events(job_id):
            last = event
            if on_event is not None:
                on_event(event)
        try:
            return self.job(job_id)
        except DaemonUnreachable:
            if last.get("type") != "state":
                raise
            return {"id": last.get("job", job_id), "state": last.get("state"), "error": last.get("error"),
                    "finished_at": last.get("ts"), "outputs": [], "stages": {}}

    def output(self, job_id: str, name: str) -> tuple[bytes, str]:
        """``GET /v1/jobs/{id}/outputs/{name}``: one output's bytes and content type, in memory."""
        conn, response = self._open("GET", self._job_path(job_id, "outputs", name))
        try:
            self._check(response)
            content_type = response.getheader("Content-Type") or "application/octet-stream"
            return self._read_body(response), content_type
        finally:
            conn.close()

    def save_output(self, job_id: str, name: str, path: str | os.PathLike[str]) -> str:
        """Stream one output into ``path`` (written whole or not at all); return its content type."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        conn, response = self._open("GET", self._job_path(job_id, "outputs", name))
        try:
            self._check(response)
            content_type = response.getheader("Content-Type") or "application/octet-stream"
            # Write beside the target and rename, so a broken download never looks like a result.
            fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as sink:
                    self._copy_body(response, sink)
                os.chmod(partial, 0o666 & ~_umask())   # mkstemp makes 0600; results are ordinary files
                os.replace(partial, target)
            except BaseException:
                try:
                    os.unlink(partial)
                except FileNotFoundError:
                    pass
                raise
            return content_type
        finally:
            conn.close()

    def _copy_body(self, response: http.client.HTTPResponse, sink: BinaryIO) -> None:
        while True:
            try:
                chunk = response.read(_COPY_CHUNK)
            except (socket.timeout, TimeoutError):
                raise ConnectionLost(self.socket_path, f"no data within {self.timeout} s") from None
            except (OSError, http.client.HTTPException) as exc:
                raise ConnectionLost(self.socket_path, f"download broke ({exc or type(exc).__name__})") from None
            if not chunk:
                return
            sink.write(chunk)

    def save_outputs(self, job: str | Mapping[str, Any], directory: str | os.PathLike[str]) -> list[Path]:
        """Write every output of a job into ``directory`` (created if missing); return the paths.

        ``job`` is a job id or a job as returned by :meth:`job`. Files are named after each
        output's ``file`` (its basename only, so a daemon can never write outside ``directory``).
        """
        job_doc = self.job(job) if isinstance(job, str) else job
        job_id = str(job_doc.get("id"))
        folder = Path(directory)
        written: list[Path] = []
        used: set[str] = set()
        for output in job_doc.get("outputs") or []:
            if not isinstance(output, Mapping) or not output.get("name"):
                continue
            filename = _safe_filename(output)
            if filename in used:
                filename = f"{os.path.basename(str(output['name']))}-{filename}"
            used.add(filename)
            target = folder / filename
            self.save_output(job_id, str(output["name"]), target)
            written.append(target)
        return written
