"""The wire under `omnictl.client.Client`: one HTTP request over the daemon's Unix socket, its
answer read and checked, and the errors a caller catches (re-exported by `omnictl.client`).

Standard library only, like the client: `import omnictl` stays fast."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

JSON = dict[str, Any]


class ClientError(Exception):
    """Base class of every error this client raises."""


class DaemonUnreachable(ClientError):
    """The socket is missing, refuses connections, or the daemon did not answer in time."""

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(f"cannot reach omnid at {socket_path}: {reason}")


class ConnectionLost(DaemonUnreachable):
    """The daemon went away in the middle of a response (for example while streaming events)."""


class EventsIdleTimeout(ClientError, TimeoutError):
    """:meth:`Client.events` got no event from the daemon within its ``idle_timeout``.

    The daemon answered but went quiet: the job may be stuck, or just slow between two events.
    Also a :class:`TimeoutError`, so ``except TimeoutError`` catches it.
    """

    def __init__(self, job_id: str, idle_timeout: float, events_seen: int) -> None:
        self.job_id = job_id
        self.idle_timeout = idle_timeout
        self.events_seen = events_seen
        super().__init__(f"no event for job {job_id} within {idle_timeout:g} s "
                         f"(after {events_seen} event{'' if events_seen == 1 else 's'})")


class ProtocolError(ClientError):
    """The daemon answered with something that is not the API (bad JSON, a truncated event)."""


class ApiError(ClientError):
    """The daemon refused the request: a non-2xx status with its ``{"error": {...}}`` body.

    ``retry_after``: the seconds its ``Retry-After`` header says to wait before trying again (a 429,
    a 503 such as a real-time pipeline at capacity, a 507), or None when it sent none.
    """

    def __init__(self, status: int, code: str, message: str, body: Any = None,
                 retry_after: int | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.body = body
        self.retry_after = retry_after
        super().__init__(f"{message} ({code})")


def _seconds(header: str | None) -> int | None:
    """A Retry-After header's delay in seconds (the daemon sends seconds, never an HTTP date)."""
    try:
        return max(0, int(header)) if header else None
    except ValueError:
        return None


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``http.client`` connection that dials an AF_UNIX stream socket instead of TCP."""

    def __init__(self, socket_path: str, timeout: float | None) -> None:
        # The host only fills the Host header; it is what `curl --unix-socket` users write too.
        super().__init__("omnid", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connect_reason(exc: OSError) -> str:
    """Say in a few words why dialing the socket failed."""
    if isinstance(exc, FileNotFoundError):
        return "no such socket (is omnid running?)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is omnid running?)"
    if isinstance(exc, PermissionError):
        return "permission denied (is your user in the socket's group?)"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return exc.strerror or str(exc)


def _api_error(status: int, reason: str, raw: bytes, retry_after: str | None = None) -> ApiError:
    """Build the ApiError for a non-2xx response, tolerating bodies that are not the API's shape
    (`retry_after`: its Retry-After header)."""
    wait = _seconds(retry_after)
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code") or f"http_{status}")
        message = str(error.get("message") or reason or f"HTTP {status}")
        return ApiError(status, code, message, body, wait)
    text = raw.decode("utf-8", "replace").strip()
    return ApiError(status, f"http_{status}", text or reason or f"HTTP {status}", body if body is not None else text,
                    wait)


def _parse_json(raw: bytes) -> Any:
    """Parse a 2xx response body; an empty body (e.g. 204) is an empty object."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"the daemon sent a response that is not JSON: {exc}") from None


class Transport:
    """One daemon's socket, and the JSON round trips over it (`Client` adds the API's methods)."""

    socket_path: str
    timeout: float | None

    # --- transport -------------------------------------------------------------------------

    def _open(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
    ) -> tuple[UnixHTTPConnection, http.client.HTTPResponse]:
        """Send one request and return the connection and its response, headers read, body not.

        The caller owns the connection and must close it. Only the dial can raise
        DaemonUnreachable; a failure after the request went out raises ConnectionLost, because
        the daemon may already have acted on it.
        """
        if query:
            pairs = {key: value for key, value in query.items() if value is not None}
            if pairs:
                path = f"{path}?{urlencode(pairs)}"
        headers = {"Accept": "application/json"}
        payload: bytes | None = None
        if body is not None:
            payload = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        conn = UnixHTTPConnection(self.socket_path, self.timeout)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise DaemonUnreachable(self.socket_path, _connect_reason(exc)) from None
        try:
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
        except (socket.timeout, TimeoutError):
            conn.close()
            raise ConnectionLost(self.socket_path, f"no answer within {self.timeout} s") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ConnectionLost(self.socket_path, f"connection lost ({exc or type(exc).__name__})") from None
        return conn, response

    def _read_body(self, response: http.client.HTTPResponse) -> bytes:
        """Read a whole response body, mapping a broken connection to ConnectionLost."""
        try:
            return response.read()
        except (socket.timeout, TimeoutError):
            raise ConnectionLost(self.socket_path, f"no answer within {self.timeout} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionLost(self.socket_path, f"connection lost ({exc or type(exc).__name__})") from None

    def _check(self, response: http.client.HTTPResponse) -> None:
        """Raise ApiError (having read the error body) unless the response is 2xx."""
        if not 200 <= response.status < 300:
            raise _api_error(response.status, response.reason, self._read_body(response),
                             response.getheader("Retry-After"))

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        accept_statuses: tuple[int, ...] = (),
    ) -> tuple[int, Any]:
        """One JSON round trip. Statuses in ``accept_statuses`` are returned instead of raised."""
        conn, response = self._open(method, path, query=query, body=body)
        try:
            raw = self._read_body(response)
        finally:
            conn.close()
        if not 200 <= response.status < 300 and response.status not in accept_statuses:
            raise _api_error(response.status, response.reason, raw, response.getheader("Retry-After"))
        if 200 <= response.status < 300:
            return response.status, _parse_json(raw)
        try:
            return response.status, json.loads(raw) if raw.strip() else {}
        except ValueError:
            return response.status, {}

    def _json(self, method: str, path: str, **kwargs: Any) -> JSON:
        body = self._request(method, path, **kwargs)[1]
        if not isinstance(body, dict):
            raise ProtocolError(f"{method} {path}: the daemon answered a JSON {type(body).__name__}, not an object")
        return body
