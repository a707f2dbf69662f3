"""The OpenAI Realtime API's server events, as omnid writes them (the `RealtimeServerEvent*`
components of openai/openai-openapi), a client event refused (`EventError`, said as an `error`
event), the ids of a session's things, and a refusal at the door said as one.

Standard library and aiohttp only; no state but two counters. The session itself is session.py's
(its conversation conversation.py's, its responses responses.py's); the TCP door
(access.py) uses `refuse` to answer a WebSocket upgrade without a valid key.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from aiohttp import web

REALTIME_PATH = "/v1/realtime"
OPENAI_RATE = 24000                     # the one PCM rate OpenAI's schema names (audio/pcm, 24 kHz)

# WebSocket close codes (RFC 6455): what each end of a session is closed with.
CLOSE_NORMAL = 1000                     # the client closed, or the session was idle too long
CLOSE_GOING_AWAY = 1001                 # the daemon is stopping
CLOSE_POLICY = 1008                     # no key, a wrong key, an unknown model
CLOSE_TOO_BIG = 1009                    # a message over daemon.max_request_bytes
CLOSE_INTERNAL = 1011                   # the daemon failed
CLOSE_TRY_LATER = 1013                  # too many sessions, rate limited, draining

_ids = itertools.count(1)
_seq = itertools.count(1)


class EventError(Exception):
    """A client event refused: said to the client as an `error` event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def event_id() -> str:
    return f"event_{next(_ids)}"


def new_id(prefix: str) -> str:
    """A new id of a session's thing (`sess`, `item`, `resp`): the time, and a counter."""
    return f"{prefix}_{int(time.time() * 1000):x}{next(_seq):04x}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event: its `event_id`, its `type`, then its fields."""
    return {"event_id": event_id(), "type": kind, **fields}


def error(code: str, message: str, param: str | None = None, client_event: str | None = None,
          type_: str = "invalid_request_error") -> dict[str, Any]:
    """An `error` event (RealtimeServerEventError): the session stays open unless its sender closes it."""
    return event("error", error={"type": type_, "code": code, "message": message, "param": param,
                                 "event_id": client_event})


def is_upgrade(request: web.Request) -> bool:
    """A WebSocket upgrade request for the realtime path."""
    return request.path == REALTIME_PATH and request.headers.get("Upgrade", "").lower() == "websocket"


async def refuse(request: web.Request, code: str, message: str, close_code: int,
                 type_: str = "invalid_request_error", status: int = 400) -> web.StreamResponse:
    """A session refused as it opens: the upgrade is accepted, one `error` event says why, and the
    socket is closed with `close_code` and a reason (a WebSocket client reads an event and a close,
    where an HTTP status would be an opaque handshake failure). A request that is no upgrade gets
    the same error as JSON, with `status`."""
    ws = web.WebSocketResponse(compress=False)
    if not ws.can_prepare(request).ok:
        return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": code}},
                                 status=status)
    await ws.prepare(request)
    try:
        await ws.send_str(json.dumps(error(code, message, type_=type_)))
        await ws.close(code=close_code, message=reason(message))
    except ConnectionError:
        pass
    return ws


def reason(text: str) -> bytes:
    """A close frame's reason: at most 123 bytes of UTF-8 (RFC 6455), cut at a character."""
    data = text.encode("utf-8")
    if len(data) <= 123:
        return data
    return data[:120].decode("utf-8", errors="ignore").encode("utf-8") + b"..."
