"""A fake omnid for omnictl's unit tests: a real HTTP/1.1 server on a real AF_UNIX socket.

Runs in the pytest process: the server's accept loop in one daemon thread and each connection
in its own thread (``ThreadingUnixStreamServer``), so a test can hold a streaming response open
while the client under test reads it. Handlers block only on their socket and on the gates a test
hands them. Routes serve canned documents; every request is recorded for assertions.

Every error code, job state and event type the fake answers comes from ``omnid.vocabulary``, the
words the real daemon uses, and each error goes out with the status the real API gives that code
(``ERROR_STATUS``, checked against the daemon's source by test_client_unit.py). A code, state or
type outside the vocabulary is refused when a test registers it, so the fake cannot drift.
"""

from __future__ import annotations

import json
import os
import re
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

from omnid.vocabulary import ErrorCode, EventType, JobState, StageRunState  # noqa: E402  (needs the path above)

Route = Callable[["FakeHandler"], None]

# The status the real API answers each error code with (omnid/supervisor/http/api/ and the
# scheduler's refusals). `http_error` is missing on purpose: it carries whatever status aiohttp
# raised, so a test that sends it names the status.
ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_JSON: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_INPUT: 400,
    ErrorCode.MISSING_INPUT: 400,
    ErrorCode.INVALID_PARAM: 400,
    ErrorCode.INVALID_MEDIA: 400,
    ErrorCode.MEDIA_NOT_ACCEPTED: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,         # a prompt over a first vLLM stage's max_model_len
    ErrorCode.UNKNOWN_PIPELINE: 400,
    ErrorCode.AMBIGUOUS_JOB: 400,
    ErrorCode.NOT_YOURS: 403,
    ErrorCode.NO_CREDENTIALS: 403,
    ErrorCode.UNKNOWN_JOB: 404,
    ErrorCode.UNKNOWN_OUTPUT: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.JOB_NOT_FINISHED: 409,
    ErrorCode.OUTPUT_GONE: 410,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.OVER_CAPACITY: 503,           # a real-time pipeline at its measured capacity
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.STAGE_FAILED: 503,   # a stage given up for good refuses new jobs
    ErrorCode.DRAINING: 503,
    ErrorCode.NOT_ADMIN: 403,
    ErrorCode.UNKNOWN_STAGE: 404,
    ErrorCode.STAGE_BUSY: 409,     # a stage with jobs in progress is not put to sleep
    ErrorCode.SOCKET_ONLY: 403,    # API keys are managed over the socket only (supervisor/access.py)
    ErrorCode.UNKNOWN_KEY: 404,
    ErrorCode.KEY_EXISTS: 409,
    ErrorCode.INSUFFICIENT_STORAGE: 507,    # the state dir is under daemon.min_free_mb
    ErrorCode.TOO_MANY_CONNECTIONS: 503,    # past the open-files limit's room
    ErrorCode.PRIORITY_NOT_ALLOWED: 403,    # more urgent than the owner's max_priority (omnid/fair_queue.py)
    ErrorCode.OWNER_QUEUE_FULL: 429,        # the owner's max_queued jobs queued already
    ErrorCode.UNKNOWN_ADAPTER: 404,         # DELETE /v1/stages/{name}/adapters/{adapter}: no such adapter
    ErrorCode.ADAPTER_EXISTS: 409,          # POST /v1/stages/{name}/adapters: the name is taken
    ErrorCode.INVALID_ADAPTER: 400,         # ... the folder holds no adapter for this stage's model
}
# Codes the real API also answers with another status: unknown_pipeline is a 400 in a job
# (POST /v1/jobs) and a 404 as the path's resource (GET /v1/pipelines/{name}).
# stage_failed is a 409 for `POST /v1/stages/{name}/sleep` (restart it instead).
# invalid_adapter is a 409 for a stage with no `lora` table.
ALSO_STATUS: dict[ErrorCode, set[int]] = {ErrorCode.UNKNOWN_PIPELINE: {404}, ErrorCode.STAGE_FAILED: {409},
                                          ErrorCode.INVALID_ADAPTER: {409}}

# /v1/jobs/{id} and everything under it: the real API answers unknown_job for an id it does not know.
_JOB_PATH = re.compile(r"^/v1/jobs/([^/]+)(?:/.*)?$")


def error_status(code: ErrorCode | str, status: int | None = None) -> tuple[ErrorCode, int]:
    """The vocabulary's code and the real API's status for it; ValueError for a code omnid never sends."""
    member = ErrorCode(code)  # ValueError: not a word of omnid.vocabulary
    expected = ERROR_STATUS.get(member)
    if expected is None:
        if status is None:
            raise ValueError(f"{member} has no fixed status; name the one the daemon would send")
        return member, status
    if status is not None and status != expected and status not in ALSO_STATUS.get(member, set()):
        raise ValueError(f"the daemon answers {member} with {expected}, not {status}")
    return member, expected


def check_job(document: Any) -> None:
    """ValueError unless a job document's state (and each stage's) is a word of the vocabulary."""
    if isinstance(document, dict) and "state" in document and "pipeline" in document:
        JobState(document["state"])
        for run in (document.get("stages") or {}).values():
            StageRunState(run["state"])
        if document.get("error"):
            ErrorCode(document["error"]["code"])
    if isinstance(document, dict) and isinstance(document.get("jobs"), list):
        for job in document["jobs"]:
            check_job(job)


def check_event(event: dict[str, Any]) -> None:
    """ValueError unless an event's type, state and error code are words of the vocabulary."""
    kind = EventType(event["type"])
    if kind is EventType.STATE:
        JobState(event["state"])
        if event.get("error"):
            ErrorCode(event["error"]["code"])
    elif kind is EventType.ERROR:
        ErrorCode(event["code"])


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
            # What the real daemon answers for what nobody registered.
            job = _JOB_PATH.match(split.path)
            if job:
                self.send_error_code(ErrorCode.UNKNOWN_JOB, f"no job {job.group(1)!r}")
            else:
                self.send_error_code(ErrorCode.NOT_FOUND, f"no such endpoint: {self.command} {split.path}")
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

    def send_error_code(self, code: ErrorCode, message: str, status: int | None = None) -> None:
        """An API error the way the daemon sends it: its status for the code, `{"error": {...}}`."""
        member, status = error_status(code, status)
        self.server.fake.answered.append(member)
        self.send_json(status, {"error": {"code": member, "message": message}})

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
        self.answered: list[ErrorCode] = []   # every error code sent, in order

    def route(self, method: str, path: str, handler: Route) -> None:
        self.routes[(method, path)] = handler

    def json(self, method: str, path: str, document: Any, status: int = 200) -> None:
        """Serve a document as it is (a job or a list of jobs must use the vocabulary's states)."""
        if not 200 <= status < 300 and isinstance(document, dict) and isinstance(document.get("error"), dict):
            raise ValueError("errors go through FakeDaemon.error, which gives each code its real status")
        check_job(document)
        self.route(method, path, lambda h: h.send_json(status, document))

    def error(self, method: str, path: str, code: ErrorCode, message: str, status: int | None = None) -> None:
        """Refuse the request with ``code`` and the status the real API gives it."""
        member, status = error_status(code, status)   # fails here, in the test, on a drifted code
        self.route(method, path, lambda h: h.send_error_code(member, message, status))

    def bytes(self, method: str, path: str, data: bytes, content_type: str) -> None:
        self.route(method, path, lambda h: h.send_bytes(200, data, content_type))

    def events(self, job_id: str, events: Iterable[dict[str, Any]]) -> None:
        """Serve the events as a chunked NDJSON stream, one chunk per line."""
        events = list(events)
        for event in events:
            check_event(event)
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
