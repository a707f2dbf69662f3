"""A fake omnid for omnictl's unit tests: a real HTTP/1.1 server on a real AF_UNIX socket.

Runs in the pytest process: the server's accept loop in one daemon thread and each connection
in its own thread (``ThreadingUnixStreamServer``), so a test can hold a streaming response open
while the client under test reads it. Handlers block only on their socket and on the gates a test
hands them. Routes serve canned documents; every request is recorded for assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import socketserver
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

# `python3 -m pytest` puts the repo root on sys.path; plain `pytest` may not.
REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

Route = Callable[["FakeHandler"], None]


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


class FakeHandler(BaseHTTPRequestHandler):
    """Dispatches each request to the route its test registered."""

    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # the default logger reads client_address[0], which a Unix socket does not have

    def _dispatch(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        split = urlsplit(self.path)
        daemon = self.server.fake
        daemon.requests.append(
            Recorded(self.command, split.path, parse_qs(split.query), json.loads(raw) if raw else None)
        )
        route = daemon.routes.get((self.command, split.path))
        if route is None:
            self.send_json(404, {"error": {"code": "not_found", "message": f"nothing at {split.path}"}})
            return
        route(self)

    do_GET = do_POST = do_DELETE = _dispatch

    def send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def send_json(self, status: int, document: Any) -> None:
        self.send_bytes(status, json.dumps(document).encode(), "application/json")

    def start_chunked(self, content_type: str = "application/x-ndjson") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    fake: "FakeDaemon"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-stream (a test that stops reading events) is normal here;
        # socketserver would print a traceback to stderr, after the test that caused it.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class FakeDaemon:
    """The routes and the request log of one fake daemon."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[Recorded] = []

    def route(self, method: str, path: str, handler: Route) -> None:
        self.routes[(method, path)] = handler

    def json(self, method: str, path: str, document: Any, status: int = 200) -> None:
        self.route(method, path, lambda h: h.send_json(status, document))

    def error(self, method: str, path: str, status: int, code: str, message: str) -> None:
        self.json(method, path, {"error": {"code": code, "message": message}}, status)

    def bytes(self, method: str, path: str, data: bytes, content_type: str) -> None:
        self.route(method, path, lambda h: h.send_bytes(200, data, content_type))

    def events(self, job_id: str, events: Iterable[dict[str, Any]]) -> None:
        """Serve the events as a chunked NDJSON stream, one chunk per line."""
        lines = [json.dumps(event).encode() + b"\n" for event in events]

        def stream(h: FakeHandler) -> None:
            h.start_chunked()
            for line in lines:
                h.write_chunk(line)
            h.end_chunked()

        self.route("GET", f"/v1/jobs/{job_id}/events", stream)


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer than that.
    folder = tempfile.mkdtemp(prefix="omnictl-", dir="/tmp")
    path = os.path.join(folder, "omnid.sock")
    fake = FakeDaemon(path)
    server = _Server(path, FakeHandler)
    server.fake = fake
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-omnid", daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        shutil.rmtree(folder, ignore_errors=True)
